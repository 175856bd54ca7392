"""``rollout/vllm_cpu_rows``: a layer whose kernel rounds a lone row otherwise is wrapped (its lone
row then computed in a pair, the same bits as in company); a layer whose lone row is already exact
keeps its kernel. The real oneDNN layers are checked in an engine by tests/test_engine_rows.py."""

import pytest
import torch
from torch import nn

from megatron_bubblespec.rollout import vllm_cpu_rows


@pytest.fixture(autouse=True)
def _fresh_decisions():
    """Each test's kernel is its own, where vLLM's is fixed by the layer's shape."""
    vllm_cpu_rows._ROUNDS_ALONE_OTHERWISE.clear()


def _row_by_row(x, weight, bias):
    """Each row on its own: the same bits in any company."""
    return torch.stack([weight @ row for row in x])


def _lone_row_in_double(x, weight, bias):
    """Like oneDNN below two rows: a lone row summed another way (here in float64)."""
    if x.shape[0] == 1:
        return (x.double() @ weight.double().t()).float()
    return _row_by_row(x, weight, bias)


def _layer(kernel, in_features=1536, out_features=64):
    layer = nn.Module()
    layer.weight = nn.Parameter(torch.randn(out_features, in_features,
                                            generator=torch.Generator().manual_seed(1)),
                                requires_grad=False)
    layer.bias = None
    layer.cpu_linear = kernel
    return layer


def test_a_layer_that_rounds_a_lone_row_otherwise_is_wrapped_and_then_exact():
    layer = _layer(_lone_row_in_double)
    x = torch.randn(3, 1536, generator=torch.Generator().manual_seed(2))
    assert not torch.equal(layer.cpu_linear(x[:1], layer.weight, None), layer.cpu_linear(
        x, layer.weight, None)[:1])
    vllm_cpu_rows._patch(layer, (64, 1536), torch.float32)
    assert layer.cpu_linear.__wrapped__ is _lone_row_in_double
    for row in range(3):
        alone = layer.cpu_linear(x[row:row + 1], layer.weight, None)
        assert torch.equal(alone, layer.cpu_linear(x, layer.weight, None)[row:row + 1])


def test_a_layer_whose_lone_row_is_exact_keeps_its_kernel():
    layer = _layer(_row_by_row)
    vllm_cpu_rows._patch(layer, (64, 1536), torch.float32)
    assert layer.cpu_linear is _row_by_row


def test_a_layer_that_cannot_be_asked_is_wrapped():
    layer = _layer(_row_by_row)
    layer.weight = nn.Parameter(torch.empty(64, 1536, device="meta"), requires_grad=False)
    vllm_cpu_rows._patch(layer, (64, 1536), torch.float32)
    assert layer.cpu_linear.__wrapped__ is _row_by_row
