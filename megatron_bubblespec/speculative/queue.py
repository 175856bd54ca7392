"""Pending drafts: the exchanged bubble drafts in -> what is left to draft, and a step's drafts out.

``DraftQueue`` holds ``step -> (global sample index -> Draft)`` for the coming steps, the same on
every rank (every rank absorbs every rank's drafts after the exchange), so all ranks compute the
same list of samples still to draft and a checkpoint needs only one rank's queue.

Step t's bubble drafts the samples of steps t+k .. t+k+H-1 (k = ``ablation.draft_lookahead``,
H = ``spec.draft_horizon``), next step first. Within a step the order (``ablation.draft_order``) is
round-robin over the rollout engines that will roll the samples out (engine 0's first sample,
engine 1's first, ..., engine 0's second, ...), so a short bubble shortens every engine's next
rollout a little rather than one engine's a lot: the step waits for the slowest engine. With
``stragglers`` the samples whose drafts are still running (partial: no EOS yet, so likely long)
come first, longest first, then the undrafted ones round-robin. A draft that ran to EOS or to the
draft budget is complete and not drafted again (its slot in the drafting batch goes to the next
sample in order); a partial one is extended by a later bubble's newer policy.

With ``refresh`` (``spec.refresh_drafts``), once nothing is left to draft a bubble re-drafts the
complete drafts that older weights made, after the samples above: nearest step first, longest
first within a step. A long response drafted several steps ahead diverges from the policy that
verifies it somewhere, and everything after the divergence is lost; re-drafted by the newest
weights (which verify the old draft as proposals, so the part they agree with costs few engine
steps), it is one update stale instead of several.
"""

from __future__ import annotations

from itertools import zip_longest
from typing import Iterable, Sequence

from megatron_bubblespec.config.schema import DRAFT_ORDERS
from megatron_bubblespec.speculative.drafts import Draft, select_drafts

SampleId = tuple[int, int]   # (step, global sample index within the step)


class DraftQueue:
    def __init__(self, *, budget: int, eos_token_ids: Sequence[int], vocab_size: int,
                 lookahead: int = 1, horizon: int = 1, num_steps: int | None = None,
                 engines_per_replica: int = 1, order: str = "engines", refresh: bool = False):
        if order not in DRAFT_ORDERS:
            raise ValueError(f"draft order {order!r}: expected one of {DRAFT_ORDERS}")
        self.order, self.refresh = order, refresh
        self.budget, self.eos_token_ids = budget, tuple(eos_token_ids)
        self.vocab_size, self.lookahead, self.horizon = vocab_size, lookahead, horizon
        self.num_steps, self.engines_per_replica = num_steps, engines_per_replica
        self._by_step: dict[int, dict[int, Draft]] = {}

    @classmethod
    def from_config(cls, cfg, eos_token_ids: Sequence[int], vocab_size: int,
                    engines_per_replica: int = 1) -> "DraftQueue":
        s = cfg.spec
        return cls(budget=min(s.max_draft_tokens, cfg.rollout.max_new_tokens),
                   eos_token_ids=eos_token_ids, vocab_size=vocab_size,
                   lookahead=cfg.ablation.draft_lookahead, horizon=s.draft_horizon, num_steps=cfg.run.steps,
                   engines_per_replica=engines_per_replica, order=cfg.ablation.draft_order,
                   refresh=s.refresh_drafts and s.verifier == "engine"
                   and cfg.rollout.engine == "vllm")   # the engine verifies the old draft

    # ------------------------------------------------------------------ what to draft
    def target_steps(self, step: int) -> list[int]:
        """The steps whose samples step ``step``'s bubble drafts (those the run still has)."""
        first = step + self.lookahead
        return [s for s in range(first, first + self.horizon)
                if self.num_steps is None or s < self.num_steps]

    def get(self, step: int, sample_index: int) -> Draft | None:
        return self._by_step.get(step, {}).get(sample_index)

    def is_complete(self, draft: Draft | None) -> bool:
        """A draft that ran to EOS or to the draft budget: a later bubble has nothing to add."""
        return draft is not None and bool(draft.tokens) and (
            len(draft.tokens) >= self.budget or draft.tokens[-1] in self.eos_token_ids)

    def left_to_draft(self, batches: Iterable, weight_version: int | None = None) -> list[SampleId]:
        """The samples of ``batches`` (``data.lookahead.StepBatch``, in step order) still to
        draft, in drafting order (``ablation.draft_order``: see the module docstring); with
        ``refresh``, then the complete drafts made by weights older than ``weight_version``."""
        samples, stale = [], []
        for batch in batches:
            order = drafting_order(batch, self.engines_per_replica)
            left = [g for g in order if not self.is_complete(self.get(batch.step, g))]
            if self.order == "stragglers":   # stable: engine order among equal draft lengths
                left.sort(key=lambda g: -self.drafted_tokens(batch.step, g))
            samples += [(batch.step, g) for g in left]
            if self.refresh and weight_version is not None:
                old = [g for g in order if g not in left
                       and self.get(batch.step, g).weight_version < weight_version]
                old.sort(key=lambda g: -self.drafted_tokens(batch.step, g))
                stale += [(batch.step, g) for g in old]
        return samples + stale

    def drafted_tokens(self, step: int, sample_index: int) -> int:
        draft = self.get(step, sample_index)
        return len(draft.tokens) if draft is not None else 0

    # ------------------------------------------------------------------ in and out
    def absorb(self, drafts: Sequence[Draft], expected_keys: dict[SampleId, int]) -> int:
        """Every rank's exchanged drafts -> the queue (a newer draft of a sample replaces the
        older one it extends); malformed ones are dropped with a warning. Returns how many were
        kept."""
        kept = select_drafts(list(drafts), expected_keys, self.vocab_size, self.budget)
        for (step, g), draft in kept.items():
            self._by_step.setdefault(step, {})[g] = draft
        return len(kept)

    def pop(self, step: int) -> dict[int, Draft]:
        """Step ``step``'s drafts (global sample index -> draft), removed from the queue."""
        return self._by_step.pop(step, {})

    def __len__(self) -> int:
        return sum(map(len, self._by_step.values()))

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, list[list]]:
        return {str(step): [[d.sample_index, d.key, d.weight_version, list(d.tokens)]
                            for _, d in sorted(drafts.items())]
                for step, drafts in sorted(self._by_step.items())}

    def load_state_dict(self, state: dict[str, list[list]]) -> None:
        self._by_step = {
            int(step): {int(g): Draft(int(step), int(g), int(key), int(version),
                                      tuple(int(t) for t in tokens))
                        for g, key, version, tokens in rows}
            for step, rows in state.items()}


def drafting_order(batch, engines_per_replica: int = 1) -> list[int]:
    """A step's global sample indices, round-robin over the engines that will roll them out (a
    replica's samples are dealt round-robin to its engines: ``loop.layout.RolloutLayout.share``)."""
    e = engines_per_replica
    per_engine = [list(batch.rank_sample_range(r))[k::e] for r in range(batch.dp_size)
                  for k in range(e)]
    return [g for column in zip_longest(*per_engine) for g in column if g is not None]
