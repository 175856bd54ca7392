"""Drafts: next-step samples pre-generated in a bubble -> packed int64 tensors -> all-gathered over DP.

A draft names the step-(t+1) sample it was made for (its global sample index and key), the weight
version that made it, and its tokens. Packing is a flat int64 tensor
``[count, (index, key, version, length, tokens...) * count]``; unpacking validates every field and
drops (with a warning) whatever does not parse, so a corrupted draft can cost acceptance but never
crash a step or change a token (drafts are only ever proposals to the exact verifier).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

HEADER = 4


@dataclass(frozen=True)
class Draft:
    sample_index: int       # global index of the step-(t+1) sample
    key: int                # that sample's key (sampling.sample_key with step t+1)
    weight_version: int     # version of the policy that drafted it
    tokens: tuple[int, ...]


def pack(drafts: list[Draft]) -> torch.Tensor:
    flat = [len(drafts)]
    for d in drafts:
        flat += [d.sample_index, d.key, d.weight_version, len(d.tokens), *d.tokens]
    return torch.tensor(flat, dtype=torch.int64)


def unpack(packed: torch.Tensor, source: str = "packed drafts") -> list[Draft]:
    """Inverse of ``pack``; malformed content is dropped with a warning naming ``source``."""
    values = packed.tolist()
    if not values:
        return []
    count, pos, out = values[0], 1, []
    if count < 0:
        warnings.warn(f"{source}: negative draft count {count}; all drafts dropped")
        return []
    for n in range(count):
        if pos + HEADER > len(values):
            warnings.warn(f"{source}: truncated at draft {n} of {count}; the rest is dropped")
            break
        index, key, version, length = values[pos:pos + HEADER]
        if length < 0 or pos + HEADER + length > len(values) or index < 0:
            warnings.warn(f"{source}: draft {n} has a bad header (index {index}, length {length}); "
                          "it and the rest are dropped")
            break
        out.append(Draft(index, key, version, tuple(values[pos + HEADER:pos + HEADER + length])))
        pos += HEADER + length
    return out


def exchange(drafts: list[Draft], group=None) -> list[Draft]:
    """All-gather every rank's drafts over the (data-parallel) group; all drafts, rank order."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(drafts)
    mine = pack(drafts)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([mine.numel()]), group=group)
    width = int(max(s.item() for s in sizes))
    padded = torch.zeros(width, dtype=torch.int64)
    padded[:mine.numel()] = mine
    gathered = [torch.empty(width, dtype=torch.int64) for _ in sizes]
    dist.all_gather(gathered, padded, group=group)
    out = []
    for rank, (tensor, size) in enumerate(zip(gathered, sizes)):
        out += unpack(tensor[:int(size.item())], source=f"drafts from DP rank {rank}")
    return out


def select_drafts(drafts: list[Draft], expected_keys: dict[int, int], vocab_size: int,
                  max_tokens: int) -> dict[int, Draft]:
    """Keep the drafts of my samples (``expected_keys``: sample index -> key).

    Drafts for unknown samples, with a key that is not the sample's, or with token ids outside
    the vocabulary are dropped with a warning; drafts longer than ``max_tokens`` are truncated.
    """
    kept: dict[int, Draft] = {}
    for d in drafts:
        if d.sample_index not in expected_keys:
            continue  # another rank's sample: the normal case after an all-gather
        if d.key != expected_keys[d.sample_index]:
            warnings.warn(f"draft for sample {d.sample_index} carries key {d.key}, expected "
                          f"{expected_keys[d.sample_index]}; dropped")
            continue
        if any(t < 0 or t >= vocab_size for t in d.tokens):
            warnings.warn(f"draft for sample {d.sample_index} has token ids outside [0, "
                          f"{vocab_size}); dropped")
            continue
        if d.sample_index in kept:
            warnings.warn(f"two drafts for sample {d.sample_index}; keeping the first")
            continue
        kept[d.sample_index] = Draft(d.sample_index, d.key, d.weight_version, d.tokens[:max_tokens])
    return kept
