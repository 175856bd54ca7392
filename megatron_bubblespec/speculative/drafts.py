"""Drafts: coming steps' samples pre-generated in a bubble -> packed int64 tensors -> all-gathered over DP.

A draft names the sample it was made for (its step, global sample index within that step and key),
the weight version that made it, and its tokens. Packing is a flat int64 tensor
``[count, (step, index, key, version, length, tokens...) * count]``; unpacking validates every field and
drops (with a warning) whatever does not parse, so a corrupted draft can cost acceptance but never
crash a step or change a token (drafts are only ever proposals to the exact verifier).

Transport (``exchange_route``): drafts are made and consumed on the CPU, so the all-gather runs on
CPU tensors whenever the group's backend takes them (gloo, or a ``cpu:gloo,cuda:nccl`` group). NCCL
takes no CPU tensors: there the exchange uses megatron-core's gloo twin of the data-parallel group
(``parallel_state.get_data_parallel_group_gloo()``, built by ``initialize_model_parallel`` unless
``create_gloo_process_groups=False``), and only when no twin with the same ranks exists, device
tensors on the NCCL group itself. Why the twin first: even the long-context configs' largest
exchange (every sample's draft at the full budget, as int64) moves over TCP well within a step's
time, while NCCL would need a host-to-device copy, the gathered tensor in GPU memory that vLLM and
training share, a stream sync and a device-to-host copy back; and unpacking the drafts into Python
ints costs more than either transport. Both are far below one long-context step, so the path that
takes nothing from the GPU wins.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_bubblespec.speculative.validate import verifiable_draft

HEADER = 5


@dataclass(frozen=True)
class Draft:
    step: int               # the step whose sample it drafts (t + 1 .. t + H for step t's bubble)
    sample_index: int       # the sample's global index within that step
    key: int                # that sample's key (sampling.sample_key with that step)
    weight_version: int     # version of the policy that drafted it
    tokens: tuple[int, ...]


def pack(drafts: list[Draft]) -> torch.Tensor:
    flat = [len(drafts)]
    for d in drafts:
        flat += [d.step, d.sample_index, d.key, d.weight_version, len(d.tokens), *d.tokens]
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
        step, index, key, version, length = values[pos:pos + HEADER]
        if length < 0 or pos + HEADER + length > len(values) or index < 0 or step < 0:
            warnings.warn(f"{source}: draft {n} has a bad header (step {step}, index {index}, "
                          f"length {length}); it and the rest are dropped")
            break
        out.append(Draft(step, index, key, version,
                         tuple(values[pos + HEADER:pos + HEADER + length])))
        pos += HEADER + length
    return out


@dataclass(frozen=True)
class Route:
    """Where an exchange runs: the process group of its all-gathers and the tensors' device."""
    group: object
    device: torch.device
    why: str


def _takes_cpu_tensors(backend: str) -> bool:
    """Whether a backend name (``gloo``, ``nccl``, ``cpu:gloo,cuda:nccl``...) has a CPU backend."""
    if ":" in backend:
        return any(part.split(":")[0] == "cpu" for part in backend.split(","))
    return backend in ("gloo", "mpi")


def choose_route(backend: str, group, gloo_twin) -> Route:
    """The exchange's route for a group with ``backend`` and its gloo twin (None if absent)."""
    if _takes_cpu_tensors(backend):
        return Route(group, torch.device("cpu"), f"{backend} takes CPU tensors")
    if gloo_twin is not None:
        return Route(gloo_twin, torch.device("cpu"), f"{backend} has no CPU tensors: gloo twin")
    return Route(group, torch.device("cuda"),
                 f"{backend} has no CPU tensors and the group has no gloo twin: device tensors")


def data_parallel_gloo_twin(group):
    """megatron-core's gloo data-parallel group when it has exactly ``group``'s ranks, else None."""
    try:
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            return None
        twin = ps.get_data_parallel_group_gloo()
    except (ImportError, AssertionError):  # no megatron, or built without gloo groups
        return None
    if twin is None:
        return None
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    return twin if dist.get_process_group_ranks(twin) == ranks else None


def exchange_route(group=None) -> Route:
    return choose_route(dist.get_backend(group), group, data_parallel_gloo_twin(group))


def exchange(drafts: list[Draft], group=None) -> list[Draft]:
    """All-gather every rank's drafts over the (data-parallel) group; all drafts, rank order."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(drafts)
    route = exchange_route(group)
    group, device = route.group, route.device
    mine = pack(drafts).to(device)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([mine.numel()], device=device), group=group)
    counts = [int(s.item()) for s in sizes]
    padded = torch.zeros(max(counts), dtype=torch.int64, device=device)
    padded[:mine.numel()] = mine
    gathered = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(gathered, padded, group=group)
    out = []
    for rank, (tensor, count) in enumerate(zip(gathered, counts)):
        out += unpack(tensor[:count].cpu(), source=f"drafts from DP rank {rank}")
    return out


def select_drafts(drafts: list[Draft], expected_keys: dict[tuple[int, int], int],
                  vocab_size: int, max_tokens: int) -> dict[tuple[int, int], Draft]:
    """Keep the drafts of the samples ``expected_keys`` names ((step, sample index) -> key).

    Drafts for unknown samples, with a key that is not the sample's, or with token ids outside
    the vocabulary are dropped with a warning; drafts longer than ``max_tokens`` are truncated
    (``speculative.validate.verifiable_draft``).
    """
    kept: dict[tuple[int, int], Draft] = {}
    for d in drafts:
        sample = (d.step, d.sample_index)
        name = f"draft for sample {d.sample_index} of step {d.step}"
        if sample not in expected_keys:
            warnings.warn(f"{name}: no such sample is being drafted; dropped")
            continue
        if d.key != expected_keys[sample]:
            warnings.warn(f"{name} carries key {d.key}, expected {expected_keys[sample]}; dropped")
            continue
        if sample in kept:
            warnings.warn(f"two drafts for sample {d.sample_index} of step {d.step}; keeping the "
                          "first")
            continue
        tokens = verifiable_draft(d.tokens, vocab_size, max_tokens, name)
        if tokens is None:
            continue
        kept[sample] = Draft(d.step, d.sample_index, d.key, d.weight_version, tuple(tokens))
    return kept
