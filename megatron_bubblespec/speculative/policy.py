"""Config -> the drafting policy: which steps a bubble drafts, which samples in which order and how
they are claimed, each drafting request, which drafts a step verifies (the bubbles' or the previous
epoch's), what continuation proposes from, and what the run remembers.

One object per replica, the same decisions on every rank: its state is the run's draft queue and
response memory (``loop.replica.RunState``, checkpointed), and every input it reads (the lookahead
sampler's batches, the exchanged drafts, the gathered responses) is the same on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from megatron_bubblespec.sampling.requests import (Proposals, RolloutRequest, RolloutResult,
                                                   settle_eos)
from megatron_bubblespec.speculative.claims import ClaimPolicy
from megatron_bubblespec.speculative.drafts import Draft
from megatron_bubblespec.speculative.previous_epoch import ResponseMemory
from megatron_bubblespec.speculative.queue import DraftQueue, SampleId
from megatron_bubblespec.speculative.samples import SampleBook, StepPlan

if TYPE_CHECKING:   # an annotation only
    from megatron_bubblespec.config import Config


class DraftingPolicy:
    """What BubbleSpec drafts, verifies, proposes and remembers, as the config says."""

    def __init__(self, cfg: Config, book: SampleBook, queue: DraftQueue,
                 memory: ResponseMemory):
        s, a = cfg.spec, cfg.ablation
        self.book, self.queue, self.memory = book, queue, memory
        self.enabled = s.enabled
        self.previous_epoch = s.enabled and a.draft_source == "previous_epoch"
        self.bubble_drafts = s.enabled and a.draft_source == "bubble" and s.max_draft_tokens > 0
        self.continuation = s.enabled and a.speculative_continuation
        self.history = "history" in s.proposal_sources
        # the chunk's slots at least: a claimed chunk is never short of room
        self.claims = ClaimPolicy(chunk=s.draft_chunk, in_flight=max(s.draft_in_flight,
                                                                     s.draft_chunk),
                                  prefill_budget=s.draft_prefill_tokens)

    # ------------------------------------------------------------------ the step's drafts
    def plan(self, step: int, dp_rank: int) -> StepPlan:
        """Replica ``dp_rank``'s samples of ``step`` with the drafts to verify: the bubbles' (out
        of the queue), or, for the previous-epoch ablation, each sample's response the last time
        its prompt was rolled out."""
        plan = self.book.plan(step, dp_rank)
        drafts = self.queue.pop(step)
        if self.previous_epoch:
            drafts = self.memory.drafts(plan.samples, self.queue.budget)
        return plan.with_drafts(drafts)

    def with_pools(self, plan: StepPlan,
                   requests: Sequence[RolloutRequest]) -> list[RolloutRequest]:
        """Speculative continuation: each sample may keep proposing from its prompt's drafts and,
        with the ``history`` source, from its prompt's responses the last time it was rolled out
        (``requests`` in the plan's sample order; unchanged without continuation)."""
        requests = list(requests)
        if not self.continuation:
            return requests
        pools: dict[int, list[list[int]]] = {}   # prompt index -> its drafts
        own: dict[int, int] = {}   # sample -> the place of its draft in its prompt's pool
        for s in plan.samples:
            if s.draft is not None:
                pool = pools.setdefault(s.prompt.index, [])
                own[s.index] = len(pool)
                pool.append(list(s.draft.tokens))
        for request, s in zip(requests, plan.samples):
            request.proposals = Proposals(pools.get(s.prompt.index, []), own.get(s.index),
                                          self.memory.of(s.prompt.uid) if self.history else [])
        return requests

    # ------------------------------------------------------------------ the bubble's drafts
    def drafted_steps(self, step: int) -> list[int]:
        """The steps whose samples step ``step``'s bubble drafts (none without bubble drafting);
        the same on every rank."""
        return self.queue.target_steps(step) if self.bubble_drafts else []

    def to_draft(self, step: int, weight_version: int | None = None) -> list[SampleId]:
        """The samples step ``step``'s bubble drafts with weights ``weight_version``, in the order
        the cursor hands them out (complete drafts of older weights last, to refresh)."""
        return self.queue.left_to_draft([self.book.batch(t) for t in self.drafted_steps(step)],
                                        weight_version)

    def drafting_request(self, sample: SampleId) -> RolloutRequest:
        """A sample's drafting request: its prompt and key, the draft budget, and the sample's
        earlier draft: a partial one as a prefix to extend, a complete one (a refresh) as the
        draft the engine verifies and proposes from."""
        request = self.book.sample(*sample).request(self.queue.budget, "draft")
        request.drafting = True   # no logprobs over its old part; may extend on cached KV
        earlier = self.queue.get(*sample)
        if earlier is not None and self.queue.is_complete(earlier):
            request.draft = list(earlier.tokens)
            request.proposals = Proposals([list(earlier.tokens)], own=0)
        elif earlier is not None:   # a prefix may hold no EOS (a corrupted draft might)
            kept, ended = settle_eos(earlier.tokens, self.queue.eos_token_ids)
            request.response_prefix = list(earlier.tokens[:kept - ended])
        return request

    def absorb(self, drafts: Sequence[Draft]) -> int:
        """Every engine's exchanged drafts -> the queue, checked against the keys of the samples
        they name (``DraftQueue.absorb``)."""
        expected: dict[SampleId, int] = {}
        for t in sorted({d.step for d in drafts}):
            expected.update(self.book.keys(t))
        return self.queue.absorb(drafts, expected)

    # ------------------------------------------------------------------ memory
    @property
    def remembers(self) -> bool:
        """Whether each step's responses are kept for later rollouts of their prompts (the
        previous-epoch drafts, or the history proposal source)."""
        return self.previous_epoch or (self.continuation and self.history)

    def remember(self, plan: StepPlan, results: Sequence[RolloutResult], group=None) -> None:
        """The replica's responses -> every rank's memory (collective over the DP ``group``
        whenever the policy remembers)."""
        if self.remembers:
            self.memory.remember({(s.prompt.uid, s.sample_index): list(r.token_ids)
                                  for s, r in zip(plan.samples, results)}, group=group)
