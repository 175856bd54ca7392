"""(step, global sample index) + lookahead sampler + task + run seed -> a ``Sample`` (prompt, key,
pending draft) -> its rollout or drafting request.

A sample is looked up once: the step's plan (``StepPlan``) holds the replica's samples of the step,
and the drafting policy resolves the coming steps' samples through the same ``SampleBook``. Its key
is ``sampling.sample_key(seed, step, prompt uid, sample index)``, the noise its keyed draws share
wherever they are made (the engine, the verifier, a bubble's draft). Which engine of the replica
rolls a sample out is the rollout layout's deal of the plan (``loop.layout.RolloutLayout.share``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Mapping

from megatron_bubblespec.sampling import sample_key
from megatron_bubblespec.sampling.requests import RolloutRequest
from megatron_bubblespec.speculative.drafts import Draft

if TYPE_CHECKING:   # annotations only
    from megatron_bubblespec.data.lookahead import LookaheadSampler, StepBatch
    from megatron_bubblespec.data.tasks import Prompt, Task


@dataclass(frozen=True)
class Sample:
    step: int
    index: int                        # global sample index within the step
    prompt: Prompt                    # its prompt (token ids, uid, reference answer)
    sample_index: int                 # its place in the prompt's group
    key: int
    eos_token_ids: tuple[int, ...]
    draft: Draft | None = None        # its pending draft (in a step's plan)

    def request(self, max_new_tokens: int, tag: str) -> RolloutRequest:
        """Its request: prompt, key and budget, with no response yet."""
        return RolloutRequest(f"{tag}{self.step}-{self.index}", list(self.prompt.token_ids),
                              self.key, max_new_tokens, eos_token_ids=self.eos_token_ids)


@dataclass(frozen=True)
class StepPlan:
    """One step's samples of this rank's model replica, in sample order, with their drafts."""

    step: int
    samples: tuple[Sample, ...]

    def requests(self, max_new_tokens: int) -> list[RolloutRequest]:
        return [s.request(max_new_tokens, "s") for s in self.samples]

    def drafts(self) -> list[tuple[int, ...]]:
        """Each sample's pending draft tokens (empty: none)."""
        return [s.draft.tokens if s.draft is not None else () for s in self.samples]

    def with_drafts(self, drafts: Mapping[int, Draft]) -> StepPlan:
        """The plan with ``drafts`` (global sample index -> draft) as its samples' drafts."""
        return replace(self, samples=tuple(replace(s, draft=drafts.get(s.index))
                                           for s in self.samples))


class SampleBook:
    """Every step's samples, from the lookahead sampler's batches, the task and the run seed."""

    def __init__(self, task: Task, sampler: LookaheadSampler, seed: int):
        self.task, self.sampler, self.seed = task, sampler, seed

    def batch(self, step: int) -> StepBatch:
        return self.sampler.batch(step)

    def sample(self, step: int, index: int) -> Sample:
        return self._sample(self.sampler.batch(step), index)

    def plan(self, step: int, dp_rank: int) -> StepPlan:
        """The samples of ``step`` that replica ``dp_rank`` rolls out, without drafts."""
        batch = self.sampler.batch(step)
        return StepPlan(step, tuple(self._sample(batch, g)
                                    for g in batch.rank_sample_range(dp_rank)))

    def keys(self, step: int) -> dict[tuple[int, int], int]:
        """(step, global index) -> key of every sample of ``step``, on every replica."""
        batch = self.sampler.batch(step)
        return {(step, g): self._sample(batch, g).key for g in range(batch.num_samples)}

    def _sample(self, batch: StepBatch, index: int) -> Sample:
        slot = batch.slot(index)
        prompt = self.task.prompt(slot.prompt_index)
        return Sample(batch.step, index, prompt, slot.sample_index,
                      sample_key(self.seed, batch.step, prompt.uid, slot.sample_index),
                      tuple(self.task.eos_token_ids))
