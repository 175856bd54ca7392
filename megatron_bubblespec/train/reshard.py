"""Weight resharding: Megatron TP/EP/PP shards -> gather TP -> gather EP -> broadcast PP -> convert to HF -> buckets.

Every rank of a model replica ends with the full HF-layout tensors (every expert whole: an engine
at rollout TP 1 needs them all), streamed in buckets of at most
``bucket_bytes`` so a large model never sits twice in memory. The conversion metadata (global
name, full shape, dtype, TP partitioning of every tensor of every stage) is computed once and
asserted identical on all ranks of the replica before the first transfer: a rank with a
different model or layout fails loudly instead of corrupting weights.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_bubblespec.models.architecture import ModelSpec
from megatron_bubblespec.train.convert import megatron_to_hf
from megatron_bubblespec.train.sharding import (
    experts_per_rank,
    global_layer_names,
    is_expert,
    renumber_expert,
)


@dataclass(frozen=True)
class TensorMeta:
    stage: int
    name: str                 # Megatron name with global layer numbers (local expert numbers)
    local_name: str
    full_shape: tuple[int, ...]
    dtype: str
    partition_dim: int        # -1 = not tensor-parallel
    partition_stride: int
    expert: bool = False      # split over the expert-parallel ranks (gathered from all of them)


@dataclass
class ReshardStats:
    seconds: float = 0.0
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0


def _local_meta(model, stage: int, tp_size: int, etp_size: int) -> list[TensorMeta]:
    names = global_layer_names(model)
    metas = []
    for local, param in model.named_parameters():
        size = etp_size if is_expert(param) else tp_size
        tp = getattr(param, "tensor_model_parallel", False) and size > 1
        dim = param.partition_dim if tp else -1
        shape = list(param.shape)
        if tp:
            shape[dim] *= size
        metas.append(TensorMeta(stage, names[local], local, tuple(shape), str(param.dtype), dim,
                                getattr(param, "partition_stride", 1) if tp else 1,
                                is_expert(param)))
    return metas


class Resharder:
    """Streams the replica's full HF tensors on every one of its ranks."""

    def __init__(self, model, arch: ModelSpec, bucket_bytes: int = 256 << 20):
        from megatron.core import parallel_state as ps

        self.model, self.arch, self.bucket_bytes = model, arch, bucket_bytes
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.tp_size = ps.get_tensor_model_parallel_world_size()
        self.etp_group = ps.get_expert_tensor_parallel_group()
        self.etp_size = ps.get_expert_tensor_parallel_world_size()
        self.ep_group = ps.get_expert_model_parallel_group()
        self.ep_size = ps.get_expert_model_parallel_world_size()
        self.experts_per_rank = experts_per_rank(model)
        self.stage = ps.get_pipeline_model_parallel_rank()
        self.pp_ranks = dist.get_process_group_ranks(self.pp_group) if dist.is_initialized() else [0]
        self.params = dict(model.named_parameters())
        self.manifest = _local_meta(model, self.stage, self.tp_size, self.etp_size)
        self.metas = self._agreed_metadata()
        self.last = ReshardStats()

    def _agreed_metadata(self) -> list[TensorMeta]:
        mine = self.manifest
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return mine
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (self.stage, mine))
        by_stage: dict[int, list[TensorMeta]] = {}
        for rank, (stage, metas) in enumerate(everyone):
            if by_stage.setdefault(stage, metas) != metas:
                raise RuntimeError(
                    f"reshard metadata of rank {rank} (pipeline stage {stage}) differs from another "
                    "rank of the same stage: every replica must build the same model and layout")
        for metas in by_stage.values():
            for meta in metas:
                megatron_to_hf(meta.name, torch.empty(meta.full_shape), self.arch)  # maps or raises
        return [m for stage in sorted(by_stage) for m in by_stage[stage]]

    def _gather_tp(self, meta: TensorMeta) -> torch.Tensor:
        local = self.params[meta.local_name].detach()
        if meta.partition_dim < 0:
            return local
        size, group = ((self.etp_size, self.etp_group) if meta.expert
                       else (self.tp_size, self.tp_group))
        shards = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(shards, local.contiguous(), group=group)
        pieces = [torch.chunk(s, meta.partition_stride, dim=meta.partition_dim) for s in shards]
        return torch.cat([pieces[r][k] for k in range(meta.partition_stride)
                          for r in range(size)], dim=meta.partition_dim)

    def _full(self, meta: TensorMeta) -> list[tuple[str, torch.Tensor]]:
        """(global name, full tensor) of ``meta``: one, or for an expert weight the same local
        expert of every EP rank (global expert ``ep_rank * experts_per_rank + local``)."""
        copies = self.ep_size if meta.expert else 1
        if meta.stage == self.stage:
            tensors = [self._gather_tp(meta)]
            if copies > 1:
                gathered = [torch.empty_like(tensors[0]) for _ in range(copies)]
                dist.all_gather(gathered, tensors[0].contiguous(), group=self.ep_group)
                tensors = gathered
        else:
            tensors = [torch.empty(meta.full_shape, dtype=getattr(torch, meta.dtype.split(".")[-1]),
                                   device=next(iter(self.params.values())).device)
                       for _ in range(copies)]
        if len(self.pp_ranks) > 1:
            for tensor in tensors:
                dist.broadcast(tensor, src=self.pp_ranks[meta.stage], group=self.pp_group)
        return [(renumber_expert(meta.name, rank * self.experts_per_rank), tensor)
                for rank, tensor in enumerate(tensors)]

    def check_manifest(self) -> None:
        """The model's parameters still have the names, shapes and dtypes agreed by every rank
        at start (so every rank still agrees); raises naming the first difference."""
        now = _local_meta(self.model, self.stage, self.tp_size, self.etp_size)
        if now != self.manifest:
            changed = next(((a, b) for a, b in zip(self.manifest, now) if a != b),
                           (f"{len(self.manifest)} tensors", f"{len(now)} tensors"))
            raise RuntimeError(f"the model's weights manifest changed since the resharder agreed "
                               f"it with every rank: {changed[0]} is now {changed[1]}; a rank "
                               "would send tensors the engine does not expect")
        current = dict(self.model.named_parameters())
        replaced = [name for name, param in self.params.items() if current.get(name) is not param]
        if replaced:
            raise RuntimeError(f"parameters {replaced[:3]} were replaced after the resharder "
                               "started: it would send stale tensors; rebuild the resharder")

    def buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Lists of (HF name, full tensor), each at most ``bucket_bytes`` (or one tensor); the
        weights manifest is checked first (``check_manifest``)."""
        self.check_manifest()
        start, stats = time.perf_counter(), ReshardStats()
        bucket, size = [], 0
        with torch.no_grad():
            for meta in self.metas:
                if meta.name == "output_layer.weight" and self.arch.tie_word_embeddings:
                    continue  # the tied copy: HF has no lm_head
                for hf_name, tensor in self._hf_tensors(meta):
                    nbytes = tensor.numel() * tensor.element_size()
                    if bucket and size + nbytes > self.bucket_bytes:
                        stats.buckets += 1
                        yield bucket
                        bucket, size = [], 0
                    bucket.append((hf_name, tensor.contiguous()))
                    size += nbytes
                    stats.bytes += nbytes
                    stats.tensors += 1
        if bucket:
            stats.buckets += 1
            yield bucket
        stats.seconds = time.perf_counter() - start
        self.last = stats

    def _hf_tensors(self, meta: TensorMeta) -> Iterator[tuple[str, torch.Tensor]]:
        for name, full in self._full(meta):
            yield from megatron_to_hf(name, full, self.arch)

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in self.buckets():
            yield from bucket

    def sync(self, engine=None, version: int | None = None) -> ReshardStats:
        """Stream every bucket into ``engine.update_weights`` (in-process transport), which then
        holds weight version ``version``; a rank without an engine still takes part in the gathers
        and broadcasts (collective)."""
        if engine is not None:
            engine.update_weights(self.named_tensors(), version)
        else:
            for _ in self.buckets():
                pass
        return self.last
