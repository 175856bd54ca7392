"""Draft pool: a prompt's drafts + a sample's text so far -> the next k tokens to propose.

Speculative continuation after a divergence: the sample's own draft stops matching, but the drafts
of the same prompt (its siblings, made by the older policy in the bubble) often continue the same
way. The pool indexes every n-gram of ``prompt + draft`` for n in [min_match, max_match] and
proposes what followed the longest suffix of the current context that it has seen (earliest
draft first on ties). Proposals are only proposals: the keyed verifier decides, so any pool is exact.
"""

from __future__ import annotations

from typing import Sequence


class DraftPool:
    def __init__(self, prompt: Sequence[int], drafts: Sequence[Sequence[int]],
                 min_match: int = 2, max_match: int = 8):
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        self.min_match, self.max_match = min_match, max_match
        self.sequences = [list(prompt) + list(d) for d in drafts if d]
        self.index: dict[tuple[int, ...], tuple[int, int]] = {}
        for s, seq in enumerate(self.sequences):
            for end in range(1, len(seq)):  # an n-gram ending before the last token has a follower
                for n in range(min_match, min(max_match, end) + 1):
                    self.index.setdefault(tuple(seq[end - n:end]), (s, end))

    def __bool__(self) -> bool:
        return bool(self.sequences)

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest matching suffix of ``context`` (or [])."""
        if k <= 0:
            return []
        for n in range(min(self.max_match, len(context)), self.min_match - 1, -1):
            hit = self.index.get(tuple(context[len(context) - n:]))
            if hit is not None:
                s, end = hit
                return self.sequences[s][end:end + k]
        return []
