"""Rank arrival times + the coming steps' draft lengths -> shared-cursor drafting until the last
arrival -> drafted tokens per sample, drafting and overshoot seconds per rank.

The event model of ``speculative.bubble.BubbleDrafter``: a rank that reaches the barrier before the
last one claims next-step samples from one global cursor, ``chunk`` at a time, keeping up to
``concurrency`` drafts in flight; its engine then runs steps of ``EngineCosts.decode_step`` with
``concurrency`` live sequences (each step adds one token to every draft in flight), and the chunks
claimed at one moment add one prefill of their prompts to the rank's next step, delaying all its
drafts. A draft ends at its length (EOS under the drafting policy, or the draft budget), which frees
a slot that is refilled from the cursor at once. Claims happen in global time order, so fast ranks
take more samples and the cursor hands the next step's samples out from global index 0 up (those of
the low DP ranks first), as the real cursor does. When the last rank arrives, every draft keeps the
tokens of the engine steps begun before that moment (the step in progress completes: overshoot).
``draft_ahead`` lays out a bubble's samples as the draft queue does (the steps of the drafting
horizon, each in ``ablation.draft_order``) and keeps each step's drafts.

Claims and pacing are the drafter's own rule (``speculative.claims.ClaimPolicy``): with
``prefill_budget`` (``spec.draft_prefill_tokens``) a rank claims at one moment only until the
claimed prompts reach the budget (at least one chunk), and claims again one engine step later while
it has free slots.

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
from typing import TYPE_CHECKING

import numpy as np

from megatron_bubblespec.speculative.claims import ClaimPolicy

if TYPE_CHECKING:   # an annotation only: the step model imports this module
    from megatron_bubblespec.measure.sim.model import Setting

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
    if len(lens) == 0:
        return DraftOutcome(np.zeros(0, dtype=np.int64), np.zeros(len(arrive)),
                            np.zeros(len(arrive)))
    claims = ClaimPolicy(chunk=chunk, in_flight=concurrency, prefill_budget=prefill_budget)
    live = min(concurrency, len(lens))     # a job with fewer next-step samples than slots
    step_s = engine.decode_step(live, live * (prompt_len + lens.mean() / 2))
    bubble = _Bubble(arrive, lens, engine, prompt_len, claims, step_s)
    bubble.run()
    return bubble.outcome()


def drafting_order(drafted: np.ndarray, engines: int, order: str) -> np.ndarray:
    """Flat indices into one step's (R, B) samples in the order a bubble claims them
    (``speculative.queue``): round-robin over the ``R x engines`` engines (engine ``e`` of a replica
    owns its samples ``e, e + engines, ...``); with ``stragglers`` the samples with a partial
    draft first, longest first (stable)."""
    replicas, samples = drafted.shape
    r, b = np.meshgrid(np.arange(replicas), np.arange(samples), indexing="ij")
    flat = np.lexsort(((b % engines).ravel(), r.ravel(), (b // engines).ravel()))
    if order == "stragglers":
        flat = flat[np.argsort(-drafted.ravel()[flat], kind="stable")]
    return flat


def draft_ahead(setting: Setting, engine, pending: dict[int, np.ndarray], all_lengths,
                step: int, arrive: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """Step ``step``'s bubble drafts steps step+1 .. step+H (``Setting.draft_horizon``): every
    sample whose draft is still short of its length (the response under the current policy, cut
    at the budget) continues from where an earlier bubble left it, next step first, within a step
    in ``Setting.draft_order``. Updates ``pending``; returns drafting and overshoot seconds per
    engine (``arrive`` is per engine). A draft's age does not change its acceptance here (one
    ``accept_prob`` for all)."""
    targets = [s for s in range(step + 1, step + 1 + setting.draft_horizon)
               if s < len(all_lengths)]
    if not targets:
        return np.zeros(len(arrive)), np.zeros(len(arrive))
    shape = all_lengths[0].shape
    per_step = int(np.prod(shape))
    done = np.concatenate([pending.get(s, np.zeros(shape, dtype=np.int64)).reshape(-1)
                           for s in targets])
    full = np.concatenate([np.minimum(all_lengths[s], budget).reshape(-1) for s in targets])
    ordered = np.concatenate([
        i * per_step + drafting_order(done[i * per_step:(i + 1) * per_step].reshape(shape),
                                      setting.engines_per_replica, setting.draft_order)
        for i in range(len(targets))])
    todo = ordered[done[ordered] < full[ordered]]
    concurrency = min(setting.draft_concurrency, setting.kv_slots or setting.draft_concurrency)
    outcome = draft_in_bubble(arrive, full[todo] - done[todo], engine, setting.prompt_len,
                              concurrency=concurrency, chunk=setting.draft_chunk,
                              prefill_budget=setting.draft_prefill_tokens)
    done[todo] += outcome.tokens
    for s, drafted in zip(targets, done.reshape(len(targets), *shape)):
        pending[s] = drafted
    return outcome.drafting_s, outcome.overshoot_s


class _Bubble:
    """The event simulation of one bubble: arrivals, claims and finished drafts in time order,
    until the last rank arrives."""

    def __init__(self, arrive: np.ndarray, lens: np.ndarray, engine, prompt_len: int,
                 claims: ClaimPolicy, step_s: float):
        self.arrive, self.lens, self.engine, self.prompt_len = arrive, lens, engine, prompt_len
        self.claims, self.step_s = claims, step_s
        ranks, self.total = len(arrive), len(lens)
        self.close = arrive.max()
        self.tokens = np.zeros(self.total, dtype=np.int64)
        self.delay = np.zeros(ranks)                            # prefill seconds added per rank
        self.in_flight: list[dict[int, tuple[float, float]]] = [{} for _ in range(ranks)]
        self.busy_until = arrive.copy()
        self.events: list[tuple[float, int, int, int, int]] = []
        self.order = 0
        self.cursor = 0
        self.claim_due = [False] * ranks    # a paced rank's next claim is scheduled

    def push(self, time: float, kind: int, rank: int, sample: int) -> None:
        heapq.heappush(self.events, (time, self.order, kind, rank, sample))
        self.order += 1

    def next_chunk(self) -> range | None:
        if self.cursor >= self.total:
            return None
        chunk = range(self.cursor, min(self.cursor + self.claims.chunk, self.total))
        self.cursor += self.claims.chunk
        return chunk

    def claim(self, rank: int, now: float) -> None:
        mine = self.in_flight[rank]
        claimed = self.claims.claim(len(mine), self.next_chunk,
                                    lambda chunk: len(chunk) * self.prompt_len)
        for chunk in claimed:
            for g in chunk:
                mine[g] = (now, self.delay[rank])
        samples = [g for chunk in claimed for g in chunk]
        if samples:     # the claimed prompts are prefilled together in the rank's next step
            prefill_s = float(self.engine.prefill(len(samples) * self.prompt_len))
            self.delay[rank] += prefill_s
            for g in samples:
                self.push(now + self.lens[g] * self.step_s + self.delay[rank] - mine[g][1],
                          FINISH, rank, g)
            if (self.claims.has_room(len(mine)) and self.cursor < self.total
                    and not self.claim_due[rank]):
                self.claim_due[rank] = True     # paced: the rest of the slots one step later
                self.push(now + prefill_s + self.step_s, CLAIM, rank, -1)
        if not mine:
            self.busy_until[rank] = now

    def run(self) -> None:
        for rank in np.flatnonzero(self.arrive < self.close):
            self.push(float(self.arrive[rank]), ARRIVE, int(rank), -1)
        while self.events and self.events[0][0] < self.close:
            now, _, kind, rank, g = heapq.heappop(self.events)
            if kind == CLAIM:
                self.claim_due[rank] = False
            if kind != FINISH:
                self.claim(rank, now)
                continue
            claimed_at, before = self.in_flight[rank][g]
            finish = claimed_at + self.lens[g] * self.step_s + self.delay[rank] - before
            if finish > now + 1e-12:                  # later prefills on this rank delayed it
                self.push(finish, FINISH, rank, g)
                continue
            self.tokens[g] = self.lens[g]
            del self.in_flight[rank][g]
            self.claim(rank, now)

    def outcome(self) -> DraftOutcome:
        """Every draft in flight at the close keeps the engine steps begun before it."""
        ranks = len(self.arrive)
        drafting, overshoot = np.zeros(ranks), np.zeros(ranks)
        for rank in range(ranks):
            for g, (claimed_at, before) in self.in_flight[rank].items():
                started = claimed_at + self.delay[rank] - before
                steps = max(math.ceil((self.close - started) / self.step_s - 1e-12), 1)
                self.tokens[g] = min(int(self.lens[g]), steps)
                overshoot[rank] = max(overshoot[rank], started + steps * self.step_s - self.close)
            if self.in_flight[rank]:
                self.busy_until[rank] = self.close
            drafting[rank] = max(self.busy_until[rank] - self.arrive[rank], 0.0) + overshoot[rank]
        return DraftOutcome(self.tokens, drafting, overshoot)
