"""Every DP rank's responses -> memory by (prompt uid, sample index) -> the next rollout of that
prompt: its drafts (SPEC-RL-like, the ``previous_epoch`` ablation) or the ``history`` proposal
source.

A sample proposes the response its prompt (and sample index) got the last time the prompt was
rolled out: another key and an older policy, so only the exact keyed verification keeps it exact.
The memory holds one response per (prompt, sample index): the latest, so at most
``rollout.samples_per_prompt`` per prompt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch.distributed as dist

from megatron_bubblespec.speculative.drafts import Draft

if TYPE_CHECKING:   # an annotation only
    from megatron_bubblespec.speculative.samples import Sample


class ResponseMemory:
    """prompt uid -> sample index -> that sample's latest response tokens, the same on every rank
    (a prompt can land on another DP rank next epoch)."""

    def __init__(self) -> None:
        self.by_prompt: dict[str, dict[int, list[int]]] = {}

    def drafts(self, samples: Sequence[Sample], budget: int) -> dict[int, Draft]:
        """``samples`` (of one step) -> their drafts (global index -> draft), for those the
        memory holds, cut to ``budget``."""
        out = {}
        for s in samples:
            tokens = self.by_prompt.get(s.prompt.uid, {}).get(s.sample_index)
            if tokens:
                out[s.index] = Draft(s.step, s.index, s.key, -1, tuple(tokens[:budget]))
        return out

    def of(self, uid: str) -> list[list[int]]:
        """The prompt's latest responses, by sample index ([] if it was never rolled out)."""
        return [tokens for _, tokens in sorted(self.by_prompt.get(uid, {}).items())]

    def remember(self, mine: dict[tuple[str, int], list[int]], group=None) -> None:
        """This rank's responses -> every rank's memory (collective over the DP ``group``)."""
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        for part in everyone:
            for (uid, sample_index), tokens in part.items():
                self.by_prompt.setdefault(uid, {})[sample_index] = tokens

    def state_dict(self) -> list[list]:
        return [[uid, sample_index, tokens] for uid, samples in sorted(self.by_prompt.items())
                for sample_index, tokens in sorted(samples.items())]

    def load_state_dict(self, rows: list[list]) -> None:
        self.by_prompt = {}
        for uid, sample_index, tokens in rows:
            self.by_prompt.setdefault(uid, {})[int(sample_index)] = [int(t) for t in tokens]
