"""``rollout/vllm_cpu_rows``: a step of fewer than ``SMALL_STEP_ROWS`` rows is computed in a block
of that many where the layer's kernel gives each row the same bits there (a lone row that the
kernel rounds otherwise then gets the bits of its company); where the block would change a row's
bits, a lone row is computed in a pair if it rounds otherwise and the kernel is kept if not. The
real oneDNN layers are checked in an engine by tests/test_engine_rows.py."""

import pytest
import torch
from torch import nn

from megatron_bubblespec.rollout import vllm_cpu_rows

BLOCK = vllm_cpu_rows.SMALL_STEP_ROWS


@pytest.fixture(autouse=True)
def _fresh_decisions():
    """Each test's kernel is its own, where vLLM's is fixed by the layer's shape."""
    vllm_cpu_rows._STEP_BLOCK.clear()


def _row_by_row(x, weight, bias):
    """Each row on its own: the same bits in any company."""
    return torch.stack([weight @ row for row in x])


def _lone_row_in_double(x, weight, bias):
    """Like oneDNN below two rows: a lone row summed another way (here in float64)."""
    if x.shape[0] == 1:
        return (x.double() @ weight.double().t()).float()
    return _row_by_row(x, weight, bias)


def _block_in_double(x, weight, bias):
    """A kernel whose block of BLOCK rows or more sums another way than smaller steps."""
    if x.shape[0] >= BLOCK:
        return (x.double() @ weight.double().t()).float()
    return _row_by_row(x, weight, bias)


def _lone_row_and_block_in_double(x, weight, bias):
    """Both: a lone row and a block summed otherwise than a step of 2 .. BLOCK - 1 rows."""
    if x.shape[0] == 1:
        return (x.double() @ weight.double().t()).float().mul(1 + 2 ** -20)
    return _block_in_double(x, weight, bias)


def _recording(seen: list):
    """``_row_by_row`` that notes in ``seen`` how many rows each call holds."""

    def kernel(x, weight, bias):
        seen.append(x.shape[0])
        return _row_by_row(x, weight, bias)

    return kernel


def _layer(kernel, in_features=1536, out_features=64):
    layer = nn.Module()
    layer.weight = nn.Parameter(torch.randn(out_features, in_features,
                                            generator=torch.Generator().manual_seed(1)),
                                requires_grad=False)
    layer.bias = None
    layer.cpu_linear = kernel
    return layer


def _rows(n):
    return torch.randn(n, 1536, generator=torch.Generator().manual_seed(2))


def test_a_lone_row_rounded_otherwise_gets_its_company_bits_in_the_block():
    layer = _layer(_lone_row_in_double)
    x = _rows(BLOCK + 1)
    assert not torch.equal(layer.cpu_linear(x[:1], layer.weight, None), layer.cpu_linear(
        x, layer.weight, None)[:1])
    vllm_cpu_rows._patch(layer, (64, 1536), torch.float32)
    assert layer.cpu_linear.__wrapped__ is _lone_row_in_double
    company = layer.cpu_linear(x, layer.weight, None)
    for rows in range(1, BLOCK + 2):
        for first in range(BLOCK + 2 - rows):
            step = layer.cpu_linear(x[first:first + rows], layer.weight, None)
            assert step.shape == (rows, 64)
            assert torch.equal(step, company[first:first + rows])


def test_a_small_step_reaches_the_kernel_as_a_block():
    seen = []
    layer = _layer(_recording(seen))
    vllm_cpu_rows._patch(layer, (64, 1536), torch.float32)
    seen.clear()
    x = _rows(BLOCK + 2)
    for rows in range(1, BLOCK + 3):
        assert torch.equal(layer.cpu_linear(x[:rows], layer.weight, None),
                           _row_by_row(x[:rows], layer.weight, None))
    assert seen == [max(rows, BLOCK) for rows in range(1, BLOCK + 3)]


def test_a_block_that_rounds_otherwise_is_not_used():
    layer = _layer(_block_in_double)
    vllm_cpu_rows._patch(layer, (64, 1536), torch.float32)
    assert layer.cpu_linear is _block_in_double       # a lone row is exact: the kernel as it is
    vllm_cpu_rows._STEP_BLOCK.clear()                 # another kernel of the same shape
    layer = _layer(_lone_row_and_block_in_double)
    vllm_cpu_rows._patch(layer, (64, 1536), torch.float32)
    x = _rows(2)
    assert torch.equal(layer.cpu_linear(x[:1], layer.weight, None),
                       layer.cpu_linear(x, layer.weight, None)[:1])   # the lone row in a pair


def test_the_decision_is_kept_per_kernel_shape():
    layer = _layer(_lone_row_in_double)
    vllm_cpu_rows._patch(layer, (64, 1536), torch.float32)
    assert list(vllm_cpu_rows._STEP_BLOCK.values()) == [BLOCK]
    again = _layer(_block_in_double)        # the same shape: vLLM's kernel would be the same
    vllm_cpu_rows._patch(again, (64, 1536), torch.float32)
    assert again.cpu_linear.__wrapped__ is _block_in_double


def test_a_layer_that_cannot_be_asked_computes_a_lone_row_in_a_pair():
    seen = []
    layer = _layer(_recording(seen))
    weight = layer.weight
    layer.weight = nn.Parameter(torch.empty(64, 1536, device="meta"), requires_grad=False)
    vllm_cpu_rows._patch(layer, (64, 1536), torch.float32)
    assert vllm_cpu_rows._STEP_BLOCK == {}      # nothing learnt of the kernel
    x = _rows(3)
    for rows in (1, 2, 3):
        assert torch.equal(layer.cpu_linear(x[:rows], weight, None),
                           _row_by_row(x[:rows], weight, None))
    assert seen == [2, 2, 3]
