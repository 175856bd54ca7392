"""The learner's fingerprints (``train.fingerprint``): any changed bit of any element, a different
order, shape or dtype, or a missing tensor changes the value; the value does not depend on how the
tensor is laid out in memory or on the chunking of the sum."""

import pytest
import torch

from megatron_bubblespec.train import fingerprint as fp
from megatron_bubblespec.train.fingerprint import fingerprint, tensor_fingerprint, world_fingerprint


def _every_bit_flip(tensor: torch.Tensor):
    bits = tensor.clone().view(torch.int32)
    for index in range(bits.numel()):
        for bit in range(32):
            flipped = bits.clone()
            flipped.view(-1)[index] ^= (1 << bit) if bit < 31 else -(1 << 31)
            yield flipped.view(tensor.dtype)


def test_any_single_bit_changes_the_fingerprint():
    t = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    base = tensor_fingerprint(t)
    seen = {tensor_fingerprint(f) for f in _every_bit_flip(t)}
    assert base not in seen and len(seen) == 15 * 32


def test_the_last_bit_of_a_float_counts():
    t = torch.tensor([0.1764661003561581, 0.5], dtype=torch.float64)
    nudged = t.clone()
    nudged[0] = torch.nextafter(t[0], torch.tensor(1.0, dtype=torch.float64))
    assert tensor_fingerprint(t) != tensor_fingerprint(nudged)


def test_order_shape_dtype_and_missing_tensors_count():
    a, b = torch.arange(6.0), torch.ones(4)
    assert fingerprint([a, b]) != fingerprint([b, a])
    assert tensor_fingerprint(a) != tensor_fingerprint(a.view(2, 3))
    assert tensor_fingerprint(a) != tensor_fingerprint(a.double())
    assert fingerprint([a, None]) != fingerprint([a])
    assert fingerprint([a, b]) == fingerprint([a.clone(), b.clone()])
    swapped = a.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert tensor_fingerprint(a) != tensor_fingerprint(swapped)   # a permutation is a change


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64,
                                   torch.bool, torch.uint8])
def test_every_dtype_a_state_holds(dtype):
    t = (torch.arange(10) % 3).to(dtype)
    changed = t.clone()
    changed[4] = 1 - changed[4] if dtype != torch.bool else ~changed[4]
    assert tensor_fingerprint(t) != tensor_fingerprint(changed)


def test_memory_layout_and_chunking_do_not_count(monkeypatch):
    t = torch.randn(64, 33, generator=torch.Generator().manual_seed(1))
    strided = t.t().contiguous().t()   # the same values, column-major
    assert not strided.is_contiguous() and tensor_fingerprint(strided) == tensor_fingerprint(t)
    whole = tensor_fingerprint(t)
    monkeypatch.setattr(fp, "_CHUNK", 100)
    assert tensor_fingerprint(t) == whole


def test_one_process_world_is_its_own_fingerprint_as_an_exact_float():
    value = world_fingerprint(fingerprint([torch.ones(3)]), "cpu")
    assert value == float(int(value)) and 0 <= value < 2 ** 53
    assert value != world_fingerprint(fingerprint([torch.zeros(3)]), "cpu")
