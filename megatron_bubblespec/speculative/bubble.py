"""The step barrier with bubble drafting: finished engine -> arrive at a store counter -> draft the
coming steps' samples (claimed in chunks from a shared cursor) one engine step at a time -> abort
when all engines arrived.

Every rollout engine (``loop.layout``; one per DP rank in a DP-only layout) arrives once, through
its first rank. A drafting engine claims samples as ``speculative.claims.ClaimPolicy`` decides (a
full decode batch in flight, refilled from the cursor as drafts finish; the prefill per engine step
paced by a budget) and stops within one engine step of the barrier's close whatever the batch. The
prefill estimate of a claimed request is prompt + prefix, less the tokens this engine itself
computed for the sample in an earlier bubble (their KV is likely still cached:
``ablation.reuse_draft_kv``).

The counter and the cursor live in the torch.distributed store, which works for gloo and NCCL
alike and costs one round trip per check. Fast engines arrive first and claim more chunks; no
sample is claimed twice. When the last engine arrives it stamps the closing time, so each drafting
engine can measure its overshoot (time spent drafting after the barrier had in fact closed, at
most one engine step). An engine that never arrives makes the others fail after ``timeout_s`` with
a message naming the step and how many engines had arrived, never a silent hang.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from megatron_bubblespec.sampling import SamplingParams
from megatron_bubblespec.sampling.requests import RolloutRequest, RolloutResult
from megatron_bubblespec.speculative.claims import ClaimPolicy
from megatron_bubblespec.speculative.drafts import Draft
from megatron_bubblespec.speculative.queue import SampleId

if TYPE_CHECKING:   # an annotation only: speculative sits below rollout
    from megatron_bubblespec.rollout.base import RolloutEngine


@dataclass
class BubbleStats:
    idle_s: float = 0.0          # from my arrival to the barrier's close (as I observed it)
    drafting_s: float = 0.0      # inside engine steps while waiting
    overshoot_s: float = 0.0     # drafting past the true close (last arrival)
    claimed_samples: int = 0
    drafted_samples: int = 0     # with at least one token
    drafted_tokens: int = 0
    engine_steps: int = 0
    new_tokens: int = 0          # tokens this bubble added to the drafts (beyond their prefixes)
    refreshed: int = 0           # complete drafts of older weights drafted again
    prefill_tokens: int = 0      # prompt + earlier-draft tokens the claimed requests prefilled
    last_to_arrive: bool = False


class BubbleDrafter:
    """Arrive, draft while others are still generating, return the partial drafts."""

    def __init__(self, store, num_engines: int, engine: RolloutEngine, params: SamplingParams,
                 claims: ClaimPolicy, *, timeout_s: float = 600.0, poll_s: float = 0.002,
                 namespace: str = "bubblespec"):
        self.store, self.num_engines, self.engine, self.params = store, num_engines, engine, params
        self.claims = claims
        self.timeout_s, self.poll_s, self.namespace = timeout_s, poll_s, namespace
        # prompt + draft tokens this engine ran, per sample
        self.computed: dict[SampleId, int] = {}

    def _key(self, what: str, step: int) -> str:
        return f"{self.namespace}/{what}/{step}"

    def arrive_and_draft(self, step: int, samples: Sequence[SampleId],
                         next_request: Callable[[SampleId], RolloutRequest] | None,
                         weight_version: int) -> tuple[list[Draft], BubbleStats]:
        """Arrive at step ``step``'s barrier; draft ``samples`` until it closes.

        ``samples`` lists the (step, global sample index) pairs to draft, in the order the shared
        cursor hands them out (``speculative.queue.DraftQueue.left_to_draft``);
        ``next_request(sample)`` builds a sample's drafting request (its key and prompt,
        ``max_new_tokens`` = the draft budget). An empty list or no ``next_request`` is a plain
        barrier.
        """
        stats, drafts = BubbleStats(), []
        arrive, closed = self._key("arrive", step), self._key("closed", step)
        arrived_at = time.perf_counter()
        if self.store.add(arrive, 1) >= self.num_engines:
            self.store.set(closed, repr(time.time()))
            stats.last_to_arrive = True
            return drafts, stats
        cursor = _Cursor(self.store, self._key("cursor", step), samples, self.claims.chunk,
                         next_request)
        # request id -> (sample, key, prefix length, prompt length, the draft it refreshes)
        pending: dict[str, tuple[SampleId, int, int, int, tuple[int, ...]]] = {}
        self.computed = {s: n for s, n in self.computed.items() if s[0] > step}
        while self.store.add(arrive, 0) < self.num_engines:
            self._check_timeout(step, arrive, arrived_at)
            self._claim(cursor, pending, stats)
            if not self.engine.has_unfinished():
                time.sleep(self.poll_s)  # nothing left to draft: plain waiting
                continue
            began = time.perf_counter()
            finished = self.engine.step()
            stats.drafting_s += time.perf_counter() - began
            stats.engine_steps += 1
            drafts += self._collect(finished, pending, weight_version, stats)
        closed_seen = time.time()
        stats.idle_s = time.perf_counter() - arrived_at
        if self.engine.has_unfinished():
            drafts += self._collect(self.engine.abort(), pending, weight_version, stats)
        closed_at = float(self.store.get(closed).decode())
        stats.overshoot_s = max(0.0, closed_seen - closed_at) if stats.engine_steps else 0.0
        stats.drafted_samples = sum(1 for d in drafts if d.tokens)
        stats.drafted_tokens = sum(len(d.tokens) for d in drafts)
        return [d for d in drafts if d.tokens], stats

    def _check_timeout(self, step: int, arrive: str, arrived_at: float) -> None:
        if time.perf_counter() - arrived_at > self.timeout_s:
            raise TimeoutError(
                f"step {step}: only {self.store.add(arrive, 0)} of {self.num_engines} rollout "
                f"engines reached the barrier within {self.timeout_s:.0f} s; a rank died or hangs "
                "(see its log); raise spec.barrier_timeout_s if steps are legitimately slower")

    def _claim(self, cursor: _Cursor, pending: dict, stats: BubbleStats) -> None:
        """This engine step's claims (``ClaimPolicy``) -> requests added to the engine."""
        def prefill(chunk) -> int:   # a refresh runs its old draft through a forward too
            tokens = [len(r.prompt_token_ids) + len(r.response_prefix) + len(r.draft)
                      for _, r in chunk]
            stats.prefill_tokens += sum(tokens)
            return sum(max(n - self.computed.get(sample, 0), 0)
                       for n, (sample, _) in zip(tokens, chunk))

        for chunk in self.claims.claim(len(pending), cursor.next_chunk, prefill):
            stats.claimed_samples += len(chunk)
            pending.update({r.request_id: (sample, r.key, len(r.response_prefix),
                                           len(r.prompt_token_ids), tuple(r.draft))
                            for sample, r in chunk})
            self.engine.add([r for _, r in chunk], self.params)

    def _collect(self, results: list[RolloutResult],
                 pending: dict[str, tuple[SampleId, int, int, int, tuple[int, ...]]],
                 weight_version: int, stats: BubbleStats) -> list[Draft]:
        out = []
        for r in results:
            claimed = pending.pop(r.request_id, None)
            if claimed is None:
                continue
            (step, index), key, prefix, prompt, old = claimed
            tokens = tuple(r.token_ids)
            self.computed[(step, index)] = prompt + len(tokens)
            if old:
                prefix = common_prefix(tokens, old)
                # an unfinished refresh that still agrees with the old draft would only shorten
                # it: the old draft stays
                if not r.finished and prefix == len(tokens):
                    continue
                stats.refreshed += 1
            stats.new_tokens += max(len(tokens) - prefix, 0)
            out.append(Draft(step, index, key, weight_version, tokens))
        return out


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class _Cursor:
    """The shared drafting cursor in the store: each call takes the next chunk of ``samples``
    (with their drafting requests), None once they are all handed out."""

    def __init__(self, store, key: str, samples: Sequence[SampleId], chunk: int,
                 next_request: Callable[[SampleId], RolloutRequest] | None):
        self.store, self.key, self.samples, self.chunk = store, key, samples, chunk
        self.next_request = next_request
        self.exhausted = next_request is None or not samples

    def next_chunk(self) -> list[tuple[SampleId, RolloutRequest]] | None:
        if self.exhausted:
            return None
        end = self.store.add(self.key, self.chunk)
        start = end - self.chunk
        if start >= len(self.samples):
            self.exhausted = True
            return None
        return [(sample, self.next_request(sample)) for sample in self.samples[start:end]]
