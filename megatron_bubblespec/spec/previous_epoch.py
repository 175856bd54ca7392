"""SPEC-RL-like drafts (ablation): every DP rank's responses -> memory by (prompt uid, sample index)
-> the drafts of the next time that prompt is rolled out.

A sample proposes the response its prompt and sample index got the last time the prompt was rolled
out: another key and an older policy, so only the exact keyed verification keeps it exact.
"""

from __future__ import annotations

from typing import Sequence

import torch.distributed as dist

from megatron_bubblespec.spec.drafts import Draft


class ResponseMemory:
    """(prompt uid, sample index) -> that sample's latest response tokens, the same on every rank
    (a prompt can land on another DP rank next epoch)."""

    def __init__(self) -> None:
        self.responses: dict[tuple[str, int], list[int]] = {}

    def drafts(self, step: int, samples: Sequence[tuple[int, str, int, int]],
               budget: int) -> dict[int, Draft]:
        """``samples``: (global index, prompt uid, sample index, key) of my step-``step`` samples
        -> their drafts (global index -> draft), for those the memory holds."""
        out = {}
        for g, uid, sample_index, key in samples:
            tokens = self.responses.get((uid, sample_index))
            if tokens:
                out[g] = Draft(step, g, key, -1, tuple(tokens[:budget]))
        return out

    def remember(self, mine: dict[tuple[str, int], list[int]], group=None) -> None:
        """This rank's responses -> every rank's memory (collective over the DP ``group``)."""
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        for part in everyone:
            self.responses.update(part)

    def state_dict(self) -> list[list]:
        return [[uid, sample_index, tokens]
                for (uid, sample_index), tokens in sorted(self.responses.items())]

    def load_state_dict(self, rows: list[list]) -> None:
        self.responses = {(uid, int(sample_index)): [int(t) for t in tokens]
                          for uid, sample_index, tokens in rows}
