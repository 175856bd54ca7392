"""Proposal index: a sample's sources (its prompt's bubble drafts, the prompt, its own text so far)
+ its text so far -> the next k tokens to propose, and which source proposed them.

Speculative continuation: while a sample decodes, it proposes tokens that followed the longest
suffix of its current text seen in one of its sources; the keyed verifier decides, so any source is
exact. The sources (``spec.proposal_sources``, each switchable):

* ``bubble``: the drafts of the same prompt made by the older policy in the bubble (its siblings'
  and its own, after a divergence; each indexed as prompt + draft);
* ``prompt``: the prompt's text (a response often quotes the question's numbers and phrases);
* ``self``: the sample's own response so far, indexed online as it grows (repetitions).

One index per sample: every n-gram (n in [min_match, max_match]) of every source sequence -> the
first place it occurred, so the longest suffix match wins and, among equal lengths, the prompt,
then the drafts (as prompt + draft: without the prompt source, matches inside the prompt are the
drafts'), then the own text.
"""

from __future__ import annotations

from typing import Sequence

from megatron_bubblespec.config.schema import PROPOSAL_SOURCES as SOURCES


def has_sources(sources, drafts) -> bool:
    """Whether a sample with these ``drafts`` has anything to propose from (its prompt and its own
    text always exist; drafts only when there are some)."""
    return bool(drafts) or bool(set(sources) - {"bubble"})


class DraftPool:
    def __init__(self, prompt: Sequence[int], drafts: Sequence[Sequence[int]],
                 min_match: int = 2, max_match: int = 8, sources: Sequence[str] = ("bubble",)):
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        unknown = sorted(set(sources) - set(SOURCES))
        if unknown:
            raise ValueError(f"unknown proposal sources {unknown}; known: {', '.join(SOURCES)}")
        self.min_match, self.max_match = min_match, max_match
        self.prompt_len = len(prompt)
        self.sequences: list[list[int]] = []
        self.source_of: list[str] = []
        self.index: dict[tuple[int, ...], tuple[int, int]] = {}
        if "prompt" in sources:
            self._add(list(prompt), "prompt")
        if "bubble" in sources:
            for d in drafts:
                if d:
                    self._add(list(prompt) + list(d), "bubble")
        self.own: int | None = None   # the sample's own response, when ``self`` is a source
        if "self" in sources:
            self.own = len(self.sequences)
            self.sequences.append([])
            self.source_of.append("self")

    def _add(self, seq: list[int], source: str) -> None:
        self.sequences.append(seq)
        self.source_of.append(source)
        self._index_ends(len(self.sequences) - 1, range(1, len(seq)))

    def _index_ends(self, s: int, ends: range) -> None:
        """n-grams of sequence ``s`` ending before each ``end`` (so each has a follower)."""
        seq = self.sequences[s]
        for end in ends:
            for n in range(self.min_match, min(self.max_match, end) + 1):
                self.index.setdefault(tuple(seq[end - n:end]), (s, end))

    def __bool__(self) -> bool:
        return bool(self.sequences)

    def observe(self, context: Sequence[int]) -> None:
        """The sample's text so far (prompt + response): index its new response tokens."""
        if self.own is None:
            return
        own = self.sequences[self.own]
        start = len(own)
        own.extend(int(t) for t in context[self.prompt_len + start:])
        self._index_ends(self.own, range(max(1, start), len(own)))

    def propose(self, context: Sequence[int], k: int) -> tuple[list[int], str | None]:
        """Up to k tokens that followed the longest matching suffix of ``context``, and their
        source ([] and None without a match)."""
        if k <= 0:
            return [], None
        for n in range(min(self.max_match, len(context)), self.min_match - 1, -1):
            hit = self.index.get(tuple(int(t) for t in context[len(context) - n:]))
            if hit is not None:
                s, end = hit
                return self.sequences[s][end:end + k], self.source_of[s]
        return [], None


class Continuation:
    """One sample's speculative continuation: its own draft first, then pool proposals of up to
    ``k`` tokens, and a pause after repeated pool misses (a rejected proposal costs compute: a
    k-token verify step is slower than a plain step on a CPU).

    ``draft`` (``spec.verifier: engine``): the sample's own draft, in response positions. While
    the response so far is a prefix of it, the sample proposes the draft's next ``draft_k``
    tokens (all of them by default), so the engine verifies the draft in its own forward, with the
    prompt already in its KV cache and nothing prefilled twice. The first token the response
    disagrees with the draft ends it for good: the accepted prefix is the longest common prefix of
    response and draft. Draft proposals are counted apart (``draft_counts``), never pause the
    pool, and are not in ``counts``.

    After ``MISSES_BEFORE_PAUSE`` proposals in a row with nothing accepted, the sample stops
    proposing for a number of its decode steps that doubles with every pause (at most
    ``MAX_PAUSE``); an accepted token resets both.

    ``token_cost`` (``spec.proposal_token_cost``, None: always up to ``k``): the cost of one
    proposed token as a fraction of a plain decode step (a step verifying j tokens costs
    1 + token_cost * j steps). The sample then proposes the j in 0 .. k that maximises expected
    emitted tokens per cost, (1 - a^(j+1)) / (1 - a) / (1 + token_cost * j), with a its recent
    per-token acceptance (accepted tokens and rejections counted with a decay of ``DECAY`` per
    proposal, and one of each as a prior). When no j beats a plain step it proposes one token as
    a probe and pauses as after misses, so a sample whose proposals start to match finds out.

    Both engines call ``propose`` once per decode
    step with the sample's whole text (prompt + response) and ``record`` once per verified
    proposal, so they propose the same tokens. ``counts`` holds (proposed, accepted) tokens per
    source.
    """

    MISSES_BEFORE_PAUSE = 2
    MAX_PAUSE = 16
    DECAY = 0.8

    DRAFT = "draft"   # the source name of own-draft proposals

    def __init__(self, pool: DraftPool, k: int, draft: Sequence[int] = (),
                 draft_k: int | None = None, token_cost: float | None = None):
        if k < 1:
            raise ValueError(f"need k >= 1 proposed tokens, got {k}")
        if draft_k is not None and draft_k < 1:
            raise ValueError(f"need draft_k >= 1 proposed draft tokens, got {draft_k}")
        if token_cost is not None and token_cost < 0:
            raise ValueError(f"need token_cost >= 0 (a fraction of a decode step), got {token_cost}")
        self.pool, self.k, self.token_cost = pool, k, token_cost
        self._hits = self._rejections = 0.0      # decayed accepted tokens and rejections
        self.draft: list[int] | None = [int(t) for t in draft] or None   # None: ended or none
        self.draft_k = draft_k
        self._draft_checked = 0                  # response tokens compared with the draft so far
        self.counts: dict[str, list[int]] = {}   # source -> [proposed, accepted]
        self.draft_counts = [0, 0]               # own-draft tokens [proposed, accepted]
        self._source: str | None = None          # of the proposal awaiting its verdict
        self._misses = self._pause = self._waiting = 0

    @property
    def proposed(self) -> int:
        return sum(p for p, _ in self.counts.values())

    @property
    def accepted(self) -> int:
        return sum(a for _, a in self.counts.values())

    def by_source(self) -> dict[str, tuple[int, int]]:
        """(proposed, accepted) tokens per source."""
        return {source: (p, a) for source, (p, a) in self.counts.items()}

    def propose(self, context: Sequence[int], budget: int) -> list[int]:
        """Up to min(k, budget) tokens for the next decode step (``context``: the sample's text,
        prompt + response; ``budget``: tokens the response may still take after the one this step
        surely emits)."""
        self.pool.observe(context)
        own = self._draft_proposal(context, budget)
        if own:
            self._source = self.DRAFT
            return own
        if self._waiting > 0:
            self._waiting -= 1
            return []
        width = self.width()
        proposal, self._source = self.pool.propose(context, min(max(width, 1), budget))
        if width == 0 and proposal:   # nothing pays: this was a one-token probe; now a pause
            self._pause = min(self.MAX_PAUSE, max(1, 2 * self._pause))
            self._waiting = self._pause
        return proposal

    @property
    def acceptance(self) -> float:
        """Recent per-token acceptance of the pool's proposals (1/2 before any)."""
        return (self._hits + 1) / (self._hits + self._rejections + 2)

    def width(self) -> int:
        """Pool tokens to propose next: ``k``, or with a ``token_cost`` the j in 0 .. k with the
        most expected emitted tokens per step cost (0: none beats a plain step)."""
        if self.token_cost is None:
            return self.k
        a, best, best_gain = self.acceptance, 0, 1.0
        emitted = term = 1.0
        for j in range(1, self.k + 1):
            term *= a
            emitted += term
            gain = emitted / (1 + self.token_cost * j)
            if gain > best_gain:
                best, best_gain = j, gain
        return best

    def _draft_proposal(self, context: Sequence[int], budget: int) -> list[int]:
        """The own draft's next tokens while the response so far is a prefix of it, else []."""
        if self.draft is None or budget <= 0:
            return []
        response = context[self.pool.prompt_len:]
        n = len(response)
        for position in range(self._draft_checked, min(n, len(self.draft))):
            if int(response[position]) != self.draft[position]:
                self.draft = None
                return []
        self._draft_checked = n
        if n >= len(self.draft):
            self.draft = None
            return []
        width = min(budget, self.draft_k or len(self.draft))
        return self.draft[n:n + width]

    def record(self, proposal: Sequence[int], accepted: int) -> None:
        """The verifier kept the first ``accepted`` tokens of ``proposal``."""
        if not proposal:
            return
        if self._source == self.DRAFT:
            self.draft_counts[0] += len(proposal)
            self.draft_counts[1] += accepted
            return
        counts = self.counts.setdefault(self._source or "bubble", [0, 0])
        counts[0] += len(proposal)
        counts[1] += accepted
        self._hits = self.DECAY * self._hits + accepted
        self._rejections = self.DECAY * self._rejections + (accepted < len(proposal))
        if accepted:
            self._misses = self._pause = 0
            return
        self._misses += 1
        if self._misses >= self.MISSES_BEFORE_PAUSE:
            self._pause = min(self.MAX_PAUSE, max(1, 2 * self._pause))
            self._waiting, self._misses = self._pause, 0
