"""Training layout + rollout TP r -> the rollout layout: TP x PP x CP / r engines per model replica,
on consecutive ranks, every rank in one; a replica's samples round-robin over its engines.

A model replica is the TP x PP x CP ranks that share one DP rank's samples. Its ranks, in world
order, are cut into blocks of r consecutive ranks; block e is the replica's engine e (vLLM's own
tensor-parallel groups are the same blocks: ``distributed.vllm_groups``), led by its first rank.
Engine e of replica d has the global index ``d * E + e`` (E engines per replica), which is what
the bubble's arrival counter, its drafting cursor and the per-engine metrics count.

Megatron orders ranks TP innermost, then CP, DP, PP by default: r consecutive ranks stay inside one
replica exactly when r divides TP x CP (config checks it). With ``parallel.order`` tp-cp-ep-pp-dp
(or DP 1) a replica's ranks are consecutive, and an engine may span its pipeline stages: r any
divisor of TP x PP x CP. With r = 1 every rank is an engine of its own; a DP-only run keeps one
engine per rank, as before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence, TypeVar

import torch.distributed as dist

T = TypeVar("T")


@dataclass(frozen=True)
class RolloutLayout:
    rank: int                          # this rank, in the world
    replica_ranks: tuple[int, ...]     # the world ranks of this rank's model replica, ascending
    engine_tp: int                     # r: ranks per engine
    dp_rank: int
    dp_size: int

    def __post_init__(self):
        if len(self.replica_ranks) % self.engine_tp:
            raise ValueError(f"rollout.tensor_parallel={self.engine_tp} does not divide the "
                             f"{len(self.replica_ranks)} ranks of a model replica")

    @property
    def engines_per_replica(self) -> int:
        return len(self.replica_ranks) // self.engine_tp

    @property
    def num_engines(self) -> int:
        return self.dp_size * self.engines_per_replica

    @property
    def local_engine(self) -> int:
        """This rank's engine within its replica."""
        return self.replica_ranks.index(self.rank) // self.engine_tp

    @property
    def engine_index(self) -> int:
        """This rank's engine, counted over the whole world."""
        return self.dp_rank * self.engines_per_replica + self.local_engine

    @property
    def engine_ranks(self) -> tuple[int, ...]:
        e, r = self.local_engine, self.engine_tp
        return self.replica_ranks[e * r:(e + 1) * r]

    @property
    def leads_engine(self) -> bool:
        return self.rank == self.engine_ranks[0]

    def share(self, items: Sequence[T], engine: int | None = None) -> list[T]:
        """The replica's items (in sample order) that ``engine`` (default: mine) rolls out."""
        return deal(items, self.engines_per_replica,
                    self.local_engine if engine is None else engine)

    def merge(self, shares: Sequence[Sequence[T]]) -> list[T]:
        """Inverse of ``share``: the engines' shares (in engine order) -> the replica's items."""
        total = sum(map(len, shares))
        out: list = [None] * total
        for e, part in enumerate(shares):
            out[e::self.engines_per_replica] = part
        return out


def deal(items: Sequence[T], engines: int, engine: int) -> list[T]:
    """Round-robin: the share of a replica's ``items`` (in sample order) that its engine
    ``engine`` of ``engines`` rolls out."""
    return list(items[engine::engines])


def build_layout(engine_tp: int, dp_rank: int, dp_size: int):
    """Collective (every rank): this rank's ``RolloutLayout`` and two gloo groups, the replica's
    ranks (results back to the learners) and the world (the drafts' all-gather, per-engine
    metrics), so objects move on the CPU whatever the training backend."""
    world = dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if per_node % engine_tp:
        raise ValueError(f"rollout.tensor_parallel={engine_tp} does not divide the {per_node} "
                         "ranks of a node: an engine's ranks must share a node (vLLM's tensor "
                         "parallelism); choose a divisor of the GPUs per node")
    dp_of: list = [None] * world
    dist.all_gather_object(dp_of, dp_rank)
    replicas = [tuple(r for r in range(world) if dp_of[r] == d) for d in range(dp_size)]
    replica_group = None
    for ranks in replicas:   # every rank creates every group, in the same order
        group = dist.new_group(list(ranks), backend="gloo")
        if dist.get_rank() in ranks:
            replica_group = group
    world_group = dist.new_group(list(range(world)), backend="gloo")
    layout = RolloutLayout(dist.get_rank(), replicas[dp_rank], engine_tp, dp_rank, dp_size)
    return layout, replica_group, world_group
