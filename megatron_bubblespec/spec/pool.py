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


class Continuation:
    """One sample's speculative continuation: pool proposals of up to ``k`` tokens, and a pause
    after repeated misses (a rejected proposal costs compute: a k-token verify step is slower than
    a plain step on a CPU).

    After ``MISSES_BEFORE_PAUSE`` proposals in a row with nothing accepted, the sample stops
    proposing for a number of its decode steps that doubles with every pause (at most
    ``MAX_PAUSE``); an accepted token resets both. Both engines call ``propose`` once per decode
    step and ``record`` once per verified proposal, so they propose the same tokens.
    """

    MISSES_BEFORE_PAUSE = 2
    MAX_PAUSE = 16

    def __init__(self, pool: DraftPool, k: int):
        if k < 1:
            raise ValueError(f"need k >= 1 proposed tokens, got {k}")
        self.pool, self.k = pool, k
        self.proposed = self.accepted = 0      # totals over the sample
        self._misses = self._pause = self._waiting = 0

    def propose(self, context: Sequence[int], budget: int) -> list[int]:
        """Up to min(k, budget) tokens for the next decode step (``budget``: tokens the response
        may still take after the one this step surely emits)."""
        if self._waiting > 0:
            self._waiting -= 1
            return []
        return self.pool.propose(context, min(self.k, budget))

    def record(self, proposal: Sequence[int], accepted: int) -> None:
        """The verifier kept the first ``accepted`` tokens of ``proposal``."""
        if not proposal:
            return
        self.proposed += len(proposal)
        self.accepted += accepted
        if accepted:
            self._misses = self._pause = 0
            return
        self._misses += 1
        if self._misses >= self.MISSES_BEFORE_PAUSE:
            self._pause = min(self.MAX_PAUSE, max(1, 2 * self._pause))
            self._waiting, self._misses = self._pause, 0

