"""Rollout tensor parallelism: the leader's engine calls -> broadcast over the engine's CPU group ->
every rank's engine shard runs the same call, in the same order.

An engine that spans a tensor-parallel group (vLLM with its external launcher) runs one scheduler
per rank, and its forward passes all-reduce across the group: every rank must add the same
requests and step and abort at the same moments, or the ranks deadlock or diverge. The loop and
the bubble drafter stay single-minded: they drive a :class:`LockstepEngine` on the replica's leader,
which forwards every state-changing call (``add``, ``step``, ``abort``) to the other ranks, which
sit in :func:`follow` until the leader sends ``release``. The keyed sampler draws on the full
vocabulary identically on every rank, so all shards produce the leader's tokens; the followers'
results are dropped.

Weight updates are not forwarded: the resharder gives every rank of the replica the full HF
tensors, and each rank loads them into its own shard (vLLM slices them).
"""

from __future__ import annotations

from typing import Iterable

import torch.distributed as dist

from megatron_bubblespec.rollout.base import RolloutEngine
from megatron_bubblespec.sampling import SamplingParams
from megatron_bubblespec.sampling.requests import RolloutRequest, RolloutResult

_RELEASE = "release"


def _broadcast(command, src: int, group):
    box = [command]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


class LockstepEngine(RolloutEngine):
    """The leader's view of a tensor-parallel engine: its own shard, mirrored on the followers.

    What every rank must do for itself (weight updates, sleep, waking up) is refused here: the
    loop calls it on each rank's own shard."""

    def __init__(self, shard: RolloutEngine, group):
        self.shard, self.group = shard, group
        self.src = dist.get_rank()

    @property
    def weight_version(self) -> int:
        return self.shard.weight_version

    @property
    def spec_token_cost(self) -> float | None:
        return self.shard.spec_token_cost

    @property
    def dtype(self) -> str | None:
        return self.shard.dtype

    @property
    def prefix_caching(self) -> bool | None:
        return self.shard.prefix_caching

    def _send(self, *command) -> None:
        _broadcast(command, self.src, self.group)

    def add(self, requests: Iterable[RolloutRequest], params: SamplingParams) -> None:
        requests = list(requests)
        self._send("add", requests, params)
        self.shard.add(requests, params)

    def step(self) -> list[RolloutResult]:
        self._send("step")
        return self.shard.step()

    def abort(self, request_ids: Iterable[str] | None = None) -> list[RolloutResult]:
        ids = None if request_ids is None else list(request_ids)
        self._send("abort", ids)
        return self.shard.abort(ids)

    def has_unfinished(self) -> bool:
        return self.shard.has_unfinished()

    def update_weights(self, named_tensors, version: int | None = None) -> None:
        raise RuntimeError("a tensor-parallel engine is updated shard by shard: every rank of the "
                           "replica loads the full tensors into its own engine shard")

    def verify(self, requests, drafts, params: SamplingParams, rule=None):
        raise NotImplementedError("a tensor-parallel engine does not verify drafts before the "
                                  "rollout: use spec.verifier=megatron, or spec.verifier=engine "
                                  "on vLLM (each request's draft is verified inside the rollout)")

    def measure_proposal_cost(self, rows: int, verify_steps: int = 8, repeats: int = 2,
                              seed: int = 0) -> float:
        raise RuntimeError("a tensor-parallel engine measures its proposal token cost shard by "
                           "shard, when every rank builds it (build_engine's "
                           "measure_cost_at_rows)")

    def sleep(self, level: int = 1) -> None:
        raise RuntimeError("a tensor-parallel engine sleeps shard by shard: call sleep on every "
                           "rank's own engine shard")

    def wake_up(self, tags: list[str] | None = None) -> None:
        raise RuntimeError("a tensor-parallel engine wakes up shard by shard: call wake_up on "
                           "every rank's own engine shard")

    def release(self) -> None:
        """Let the followers leave :func:`follow` (after the step's rollout and bubble)."""
        self._send(_RELEASE)

    def shutdown(self) -> None:
        self.shard.shutdown()


def follow(shard: RolloutEngine, leader: int, group) -> int:
    """Run the leader's engine calls on this rank's shard until it releases us; returns the number
    of engine steps taken (they must equal the leader's)."""
    steps = 0
    while True:
        command = _broadcast(None, leader, group)
        name = command[0]
        if name == _RELEASE:
            return steps
        if name == "add":
            shard.add(*command[1:])
        elif name == "step":
            shard.step()
            steps += 1
        elif name == "abort":
            shard.abort(command[1])
        else:
            raise RuntimeError(f"unknown engine command {name!r} from rank {leader}")
