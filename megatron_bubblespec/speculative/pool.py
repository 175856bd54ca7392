"""Proposal index: one prompt's texts (``speculative.sources.PromptTexts``) and the enabled proposal
sources + a sample's text so far -> the next tokens to propose, and their source.

Speculative continuation: while a sample decodes, it proposes tokens that followed the longest
suffix of its current text that one of its sources (``spec.proposal_sources``, registered and
described in ``speculative.sources``) matches; the keyed verifier decides, so any source is exact.
One ``PromptIndex`` per prompt and engine, shared by the prompt's samples (each a member, seen
through its ``DraftPool``). The longest match wins; among equal lengths the earlier sequence (the
prompt, the drafts, the earlier responses, then the samples' texts in the order they joined), then
the source registered first.
"""

from __future__ import annotations

from typing import Sequence

from megatron_bubblespec.speculative.sources import (Lookup, PromptTexts, corpora_of,
                                                     sources_named)

DEFAULT_SOURCES = ("bubble", "realign")   # an index built directly (engines pass their settings')
DEFAULT_SUFFIX_K = 32                     # likewise: the most tokens a suffix match proposes


class PromptIndex(PromptTexts):
    """One prompt's texts with the enabled sources, shared by its samples in one engine (see the
    module doc)."""

    def __init__(self, prompt: Sequence[int], drafts: Sequence[Sequence[int]] = (),
                 min_match: int = 2, max_match: int = 8,
                 sources: Sequence[str] = DEFAULT_SOURCES, history: Sequence[Sequence[int]] = (),
                 suffix_k: int = DEFAULT_SUFFIX_K):
        self.sources = sources_named(sources)
        super().__init__(prompt, drafts, history, min_match, max_match,
                         sorted(corpora_of(sources)))
        self.suffix_k = suffix_k

    @property
    def static(self) -> bool:
        """Whether the texts hold a sequence fixed when the index was built."""
        return any(c != "responses" for c in self.corpus_of)

    def propose(self, member: str, context: Sequence[int], k: int) -> tuple[list[int], str | None]:
        """The tokens that followed the longest match ``member`` may use, and their source ([]
        and None without one): up to ``k``, or for a source that sets its own limit (``suffix``)
        as many as it matched, up to ``suffix_k``."""
        if k <= 0:
            return [], None
        lookup, best, name = Lookup(self, context), None, None
        for source in self.sources:
            m = source.match(self, member, lookup)
            if m is not None and (best is None or (m.length, -m.sequence)
                                  > (best.length, -best.sequence)):
                best, name = m, source.name
        if best is None:
            return [], None
        width = k if best.limit is None else min(best.limit, self.suffix_k)
        return best.tokens(self, width), name


class DraftPool:
    """One sample's view of its prompt's ``PromptIndex``: its own (``index`` None) or one shared
    with the prompt's other samples in the engine (``siblings``)."""

    def __init__(self, prompt: Sequence[int], drafts: Sequence[Sequence[int]] = (),
                 min_match: int = 2, max_match: int = 8,
                 sources: Sequence[str] = DEFAULT_SOURCES, history: Sequence[Sequence[int]] = (),
                 *, index: PromptIndex | None = None, member: str = "sample",
                 own_draft: int | None = None, suffix_k: int = DEFAULT_SUFFIX_K):
        self.index = index or PromptIndex(prompt, drafts, min_match, max_match, sources, history,
                                          suffix_k)
        self.member = member
        self.prompt_len = len(prompt)
        self.index.join(member, own_draft)

    def __bool__(self) -> bool:
        """Whether anything may ever propose (a static sequence, or the samples' texts)."""
        return self.index.grows or self.index.static

    def observe(self, context: Sequence[int]) -> None:
        """The sample's text so far (prompt + response): index its new response tokens."""
        self.extend(context[self.prompt_len + self.index.written(self.member):])

    def extend(self, tokens: Sequence[int]) -> None:
        """The sample's next response tokens: index them."""
        self.index.extend(self.member, tokens)

    def propose(self, context: Sequence[int], k: int) -> tuple[list[int], str | None]:
        return self.index.propose(self.member, context, k)


class Siblings:
    """An engine's prompt indexes, one per prompt (and drafts and earlier responses) among its
    running samples: the samples of a prompt share one, so each proposes from the others' texts
    (``siblings``). An index goes when its last sample leaves."""

    def __init__(self, min_match: int, max_match: int, sources: Sequence[str],
                 suffix_k: int = DEFAULT_SUFFIX_K):
        self.min_match, self.max_match, self.sources = min_match, max_match, tuple(sources)
        self.suffix_k = suffix_k
        self.shared = any(source.reads_siblings for source in sources_named(self.sources))
        self.indexes: dict[tuple, tuple[PromptIndex, set[str]]] = {}
        self.key_of: dict[str, tuple] = {}   # member -> its prompt's key

    def pool(self, member: str, prompt: Sequence[int], drafts: Sequence[Sequence[int]] = (),
             history: Sequence[Sequence[int]] = (), own_draft: int | None = None) -> DraftPool:
        """The sample ``member``'s pool (``own_draft``: the place of its own draft in
        ``drafts``): a view of its prompt's shared index."""
        if not self.shared:
            return DraftPool(prompt, drafts, self.min_match, self.max_match, self.sources,
                             history, member=member, own_draft=own_draft, suffix_k=self.suffix_k)
        key = (tuple(prompt), tuple(map(tuple, drafts)), tuple(map(tuple, history)))
        if key not in self.indexes:
            self.indexes[key] = (PromptIndex(prompt, drafts, self.min_match, self.max_match,
                                             self.sources, history, self.suffix_k), set())
        index, members = self.indexes[key]
        members.add(member)
        self.key_of[member] = key
        return DraftPool(prompt, index=index, member=member, own_draft=own_draft)

    def leave(self, member: str) -> None:
        """``member`` finished or was aborted: its text stays for the others until the last."""
        key = self.key_of.pop(member, None)
        if key is None:
            return
        members = self.indexes[key][1]
        members.discard(member)
        if not members:
            del self.indexes[key]


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
    1 + token_cost * j steps). The sample then proposes the j in 0 .. k (or what a ``suffix``
    match offers) that maximises expected
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
        """Up to ``budget`` tokens for the next decode step (``context``: the sample's text,
        prompt + response; ``budget``: tokens the response may still take after the one this step
        surely emits): the own draft's, else the pool's, as many as pay (``width``)."""
        self.pool.observe(context)
        own = self._draft_proposal(context, budget)
        if own:
            self._source = self.DRAFT
            return own
        if self._waiting > 0:
            self._waiting -= 1
            return []
        offered, self._source = self.pool.propose(context, self.k)
        if not offered:
            return []
        width = self.width(len(offered))
        if width == 0:   # nothing pays: propose one token as a probe, then pause
            self._pause = min(self.MAX_PAUSE, max(1, 2 * self._pause))
            self._waiting = self._pause
        return offered[:min(max(width, 1), budget)]

    @property
    def acceptance(self) -> float:
        """Recent per-token acceptance of the pool's proposals (1/2 before any)."""
        return (self._hits + 1) / (self._hits + self._rejections + 2)

    def width(self, limit: int | None = None) -> int:
        """Pool tokens to propose of the ``limit`` (default ``k``) a match offers: all, or with a
        ``token_cost`` the j in 0 .. limit with the most expected emitted tokens per step cost
        (0: none beats a plain step)."""
        limit = self.k if limit is None else limit
        if self.token_cost is None:
            return limit
        a, best, best_gain = self.acceptance, 0, 1.0
        emitted = term = 1.0
        for j in range(1, limit + 1):
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
