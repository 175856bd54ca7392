"""Tensors -> a 64-bit fingerprint that any changed bit of any element changes; a rank's piece of
the training state or batch -> one fingerprint over the world.

The on / off identity promise is about the learner: with BubbleSpec on and off, the trainer's
inputs and its weights after every step must be bitwise equal. Comparing final weights only says
so at the end; a fingerprint per step in the metrics (``exact/batch_hash``, ``exact/state_hash``)
says at which step two runs parted, and a bench can compare them without keeping checkpoints.

A tensor's fingerprint is ``sum_j bits_j * m_j mod 2**64``: ``bits_j`` its element j's bit pattern
as an integer, ``m_j`` an odd multiplier of the element's index. A change of any one element
changes the sum (its difference times an odd number is not 0 mod 2**64), the sum does not depend
on the order the device adds in (addition mod 2**64 is associative), and it runs where the tensor
is (a GPU's parameters are not copied to the host). Tensors are then chained with splitmix64, so
a different order or shape gives another value.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from megatron_bubblespec.splitmix import MASK64, chain

_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)   # the golden-ratio step as a signed int64
_CHUNK = 1 << 22                            # elements at a time: temporaries stay ~100 MB
_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def tensor_fingerprint(tensor: torch.Tensor, salt: int = 0) -> int:
    """One tensor's bits (dtype, shape and every element) -> a 64-bit int."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    bits = flat.view(_BITS[flat.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, bits.numel(), _CHUNK):
        part = bits[start:start + _CHUNK].to(torch.int64)
        index = torch.arange(start, start + part.numel(), dtype=torch.int64, device=flat.device)
        total += (part * ((index * _GOLDEN + salt) | 1)).sum()
    return chain(int(total) & MASK64, hash_text(str(tensor.dtype)), *tensor.shape)


def fingerprint(tensors: Iterable[torch.Tensor | None]) -> int:
    """Tensors in order (None: a missing one, which counts) -> a 64-bit int."""
    h = chain(0)
    for i, tensor in enumerate(tensors):
        h = chain(h, MASK64 if tensor is None else tensor_fingerprint(tensor, salt=i))
    return h


def hash_text(text: str) -> int:
    return chain(*text.encode())


def world_fingerprint(local: int, device) -> float:
    """Every rank's fingerprint, in rank order -> one value, the same on every rank, as a float
    that holds it exactly (53 bits: a metric's type)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        mine = torch.tensor([local - (1 << 64) if local >= 1 << 63 else local],
                            dtype=torch.int64, device=device)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        local = chain(0, *(int(t) & MASK64 for t in everyone))
    return float(local >> 11)
