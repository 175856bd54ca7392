"""A step's samples and responses -> the task's rewards, scored once per model replica (by its first
rank, in one batch) and shared with the replica's other ranks.

A reward that runs code (``data.code_task``) must not run TP x PP x CP times or once per sample in
turn: the replica's first rank scores the whole batch with the task's batch API
(``data.tasks.score``), within ``data.reward_time_limit_s`` for the code task's sandboxes (a
response that runs out of time scores 0 and is counted in ``train/reward_timeouts``), and the
replica's ranks receive the same rewards over its gloo group.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from megatron_bubblespec.data.tasks import RewardBreakdown, score


def score_rewards(task, group, samples, results) -> tuple[list[RewardBreakdown], float]:
    """(every sample's reward, the stage's seconds) on every rank of ``group``."""
    start = time.perf_counter()
    first = min(dist.get_process_group_ranks(group))
    box = [None]
    if dist.get_rank() == first:
        box[0] = score(task, [s.prompt for s in samples], [r.token_ids for r in results])
    dist.broadcast_object_list(box, src=first, group=group)
    return box[0], time.perf_counter() - start
