"""Training config + GPU memory + layout names -> the rollout layouts to simulate: rollout TP,
engines per model replica and each engine's KV slots (``sim.memory``).

Two layouts (``LAYOUTS``):

* ``one-per-replica``: one engine per model replica, at rollout TP = the training TP, on the
  first pipeline stage's TP group (context-parallel rank 0); the other GPUs of the replica do not
  generate. The layout before engines on every GPU.
* ``every-gpu``: rollout TP ``r`` dividing TP x CP, ``TP x PP x CP / r`` engines per replica on
  consecutive ranks (``loop.layout``), so every GPU generates; one layout per ``r`` that vLLM can
  split the model's heads over (or the given ``r`` only).

Every engine gets ``rollout.gpu_memory_utilization`` of its GPUs (unless overridden) whatever
stage it sits on: whether that fits beside the training memory of every stage (or needs the
engine asleep while Megatron trains) is the config's arithmetic, not this module's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from megatron_bubblespec.measure.sim.memory import KVCapacity, engine_tp_ok, kv_capacity, model_shape

LAYOUTS = ("one-per-replica", "every-gpu")


@dataclass(frozen=True)
class EngineLayout:
    name: str                    # one of LAYOUTS
    engine_tp: int               # r: GPUs per engine
    engines_per_replica: int
    capacity: KVCapacity

    @property
    def kv_slots(self) -> int:
        return self.capacity.sequences

    def samples_per_engine(self, samples_per_replica: int) -> int:
        return math.ceil(samples_per_replica / self.engines_per_replica)

    def waves(self, samples_per_replica: int) -> int:
        """``ceil(S / C)``: how many times an engine's ``C`` slots turn over for its ``S``
        sequences if every one ran to full length."""
        return math.ceil(self.samples_per_engine(samples_per_replica) / self.kv_slots)


def rollout_layouts(cfg, names: Sequence[str], *, gpu_bytes: float,
                    gpu_memory_utilization: float | None = None,
                    engine_tps: Sequence[int] | None = None,
                    overhead_bytes: float | None = None) -> tuple[list[EngineLayout], list[str]]:
    """The layouts ``names`` of training config ``cfg`` on GPUs of ``gpu_bytes``; returns them and
    one note per candidate left out (vLLM cannot split the heads, or its KV cache cannot hold one
    ``max_model_len`` sequence)."""
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        raise ValueError(f"unknown layouts {unknown}: use {', '.join(LAYOUTS)}")
    p = cfg.parallel
    shape = model_shape(cfg.model.path)
    utilization = (cfg.rollout.gpu_memory_utilization if gpu_memory_utilization is None
                   else gpu_memory_utilization)
    candidates = []
    if "one-per-replica" in names:
        candidates.append(("one-per-replica", p.tensor, 1))
    if "every-gpu" in names:
        group = p.tensor * p.context
        for r in (engine_tps or [d for d in range(1, group + 1) if group % d == 0]):
            if group % r:
                raise ValueError(f"rollout TP {r} does not divide TP x CP = {group}")
            candidates.append(("every-gpu", r, p.tensor * p.pipeline * p.context // r))
    layouts, notes = [], []
    for name, r, engines in candidates:
        if not engine_tp_ok(shape, r):
            notes.append(f"{name} at rollout TP {r} left out: vLLM cannot split {shape.heads} "
                         f"query / {shape.kv_heads} KV heads over {r} GPUs")
            continue
        capacity = kv_capacity(shape, r, gpu_bytes=gpu_bytes,
                               gpu_memory_utilization=utilization,
                               max_model_len=cfg.model.max_model_len, dtype=cfg.model.dtype,
                               overhead_bytes=overhead_bytes)
        if capacity.sequences < 1:
            notes.append(f"{name} at rollout TP {r} left out: {capacity.kv_bytes / 1e9:.1f} GB of "
                         f"KV per GPU holds no sequence of {cfg.model.max_model_len} tokens")
            continue
        layouts.append(EngineLayout(name, r, engines, capacity))
    return layouts, notes
