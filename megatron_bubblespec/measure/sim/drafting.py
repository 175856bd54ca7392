"""Rank arrival times + next step's draft lengths -> shared-cursor drafting until the last arrival
-> drafted tokens per next-step sample, drafting and overshoot seconds per rank.

The event model of ``spec.bubble.BubbleDrafter``: a rank that reaches the barrier before the last
one claims next-step samples from one global cursor, ``chunk`` at a time, keeping up to
``concurrency`` drafts in flight; its engine then runs steps of ``EngineCosts.decode_step`` with
``concurrency`` live sequences (each step adds one token to every draft in flight), and the chunks
claimed at one moment add one prefill of their prompts to the rank's next step, delaying all its
drafts. A draft ends at its length (EOS under the drafting policy, or the draft budget), which
frees a slot that is refilled from the cursor at once. Claims happen in global time order, so fast
ranks take more samples and the cursor hands the next step's samples out from global index 0 up
(those of the low DP ranks first), as the real cursor does. When the last rank arrives, every
draft keeps the tokens of the engine steps begun before that moment (the step in progress
completes: overshoot).
With ``prefill_budget`` (``spec.draft_prefill_tokens``) a rank claims at one moment only until the
claimed prompts reach the budget (at least one chunk), as the drafter paces its claims, and claims
again one engine step later while it has free slots.

Approximations: the step time assumes ``min(concurrency, next-step samples)`` live drafts even when
fewer are in flight (the pool ran dry, or other ranks hold the rest), the KV term uses the mean
draft length, a draft's length is the next step's response length under the current policy (cut at
the budget), store round trips cost nothing, and a claim's prefill delays every draft in flight on
its rank as a whole (the step that prefills is longer), so when paced claims prefill after a
draft began, the draft is counted a few tokens short.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

ARRIVE, FINISH, CLAIM = 0, 1, 2


@dataclass
class DraftOutcome:
    tokens: np.ndarray       # (samples,) drafted tokens of each next-step sample, global order
    drafting_s: np.ndarray   # (ranks,) seconds spent in engine steps while waiting (+ overshoot)
    overshoot_s: np.ndarray  # (ranks,) seconds the engine step in flight ran past the last arrival


def draft_in_bubble(arrive, draft_lens, engine, prompt_len: int, *, concurrency: int = 8,
                    chunk: int = 2, prefill_budget: int = 0) -> DraftOutcome:
    """Draft the next step's samples (lengths ``draft_lens``, global order) in the bubble of ranks
    arriving at ``arrive`` (seconds from the step's start); ``engine`` is an ``EngineCosts``;
    ``prefill_budget`` tokens of new prompts per claim (0: no bound)."""
    arrive = np.asarray(arrive, dtype=float)
    lens = np.asarray(draft_lens, dtype=np.int64)
    ranks, total = len(arrive), len(lens)
    close = arrive.max()
    tokens = np.zeros(total, dtype=np.int64)
    drafting = np.zeros(ranks)
    overshoot = np.zeros(ranks)
    if total == 0:
        return DraftOutcome(tokens, drafting, overshoot)
    live = min(concurrency, total)     # a job with fewer next-step samples than slots
    step_s = engine.decode_step(live, live * (prompt_len + lens.mean() / 2))
    delay = np.zeros(ranks)                                  # prefill seconds added per rank
    in_flight: list[dict[int, tuple[float, float]]] = [{} for _ in range(ranks)]
    busy_until = arrive.copy()
    events: list[tuple[float, int, int, int, int]] = []
    order = 0
    cursor = 0
    budget = prefill_budget if prefill_budget > 0 else math.inf
    claim_due = [False] * ranks    # a paced rank's next claim is scheduled

    def push(time: float, kind: int, rank: int, sample: int) -> None:
        nonlocal order
        heapq.heappush(events, (time, order, kind, rank, sample))
        order += 1

    def claim(rank: int, now: float) -> None:
        nonlocal cursor
        first = cursor
        while (len(in_flight[rank]) < concurrency and cursor < total
               and (cursor - first) * prompt_len < budget):
            for g in range(cursor, min(cursor + chunk, total)):
                in_flight[rank][g] = (now, delay[rank])
            cursor += chunk
        claimed = min(cursor, total) - first
        if claimed:     # the claimed prompts are prefilled together in the rank's next step
            prefill_s = float(engine.prefill(claimed * prompt_len))
            delay[rank] += prefill_s
            for g in range(first, first + claimed):
                push(now + lens[g] * step_s + delay[rank] - in_flight[rank][g][1], FINISH, rank, g)
            if len(in_flight[rank]) < concurrency and cursor < total and not claim_due[rank]:
                claim_due[rank] = True     # paced: the rest of the slots one engine step later
                push(now + prefill_s + step_s, CLAIM, rank, -1)
        if not in_flight[rank]:
            busy_until[rank] = now

    for rank in np.flatnonzero(arrive < close):
        push(float(arrive[rank]), ARRIVE, int(rank), -1)
    while events and events[0][0] < close:
        now, _, kind, rank, g = heapq.heappop(events)
        if kind == CLAIM:
            claim_due[rank] = False
        if kind != FINISH:
            claim(rank, now)
            continue
        claimed_at, before = in_flight[rank][g]
        finish = claimed_at + lens[g] * step_s + delay[rank] - before
        if finish > now + 1e-12:                  # later prefills on this rank delayed it
            push(finish, FINISH, rank, g)
            continue
        tokens[g] = lens[g]
        del in_flight[rank][g]
        claim(rank, now)
    for rank in range(ranks):
        for g, (claimed_at, before) in in_flight[rank].items():
            started = claimed_at + delay[rank] - before
            steps = max(math.ceil((close - started) / step_s - 1e-12), 1)
            tokens[g] = min(int(lens[g]), steps)
            overshoot[rank] = max(overshoot[rank], started + steps * step_s - close)
        if in_flight[rank]:
            busy_until[rank] = close
        drafting[rank] = max(busy_until[rank] - arrive[rank], 0.0) + overshoot[rank]
    return DraftOutcome(tokens, drafting, overshoot)
