"""Proposal index: one prompt's sources (its bubble drafts, the prompt, earlier responses, its samples'
texts as they grow) + a sample's text so far -> the next k tokens to propose, and their source.

Speculative continuation: while a sample decodes, it proposes tokens that followed the longest
suffix of its current text seen in one of its sources; the keyed verifier decides, so any source is
exact. The sources (``spec.proposal_sources``, each switchable):

* ``bubble``: the drafts of the same prompt's other samples, made by the older policy in the
  bubble (each indexed as prompt + draft);
* ``realign``: the sample's own bubble draft after the response left it (a rejected token): a
  suffix match finds where the response meets the draft again, and the draft resumes from there;
* ``prompt``: the prompt's text (a response often quotes the question's numbers and phrases);
* ``history``: the prompt's responses from the last time it was rolled out (an earlier epoch;
  each indexed as prompt + response);
* ``self``: the sample's own response so far, indexed online as it grows (repetitions);
* ``siblings``: the same prompt's other samples in the same engine, as they are generated.

One ``PromptIndex`` per prompt and engine, shared by the prompt's samples (each a member, seen
through its ``DraftPool``): every n-gram (n in [min_match, max_match]) of every sequence -> the
first place it occurred in each sequence, in the order the n-grams were indexed. The longest
suffix match wins; among equal lengths the earliest indexed: the prompt, the drafts (as prompt +
draft: without the prompt source, matches inside the prompt are the drafts'), the earlier
responses, then the samples' texts in the order they were written.
"""

from __future__ import annotations

from typing import Sequence

from megatron_bubblespec.config.schema import PROPOSAL_SOURCES as SOURCES

STATIC = ("prompt", "bubble", "history")   # fixed when the prompt's index is built
GROWING = ("self", "siblings")              # the samples' own texts, indexed as they grow
DRAFTS = ("bubble", "realign")              # the prompt's bubble drafts: the others', one's own
DEFAULT_SOURCES = DRAFTS   # an index built directly (the engines pass their settings' sources)


def has_sources(sources, drafts, history=()) -> bool:
    """Whether a sample with these ``drafts`` (and earlier responses) has anything to propose
    from (its prompt and the samples' texts always exist; drafts and responses when there are
    some)."""
    sources = set(sources)
    return bool(sources - {*DRAFTS, "history"}) or bool(drafts and sources & set(DRAFTS)) \
        or bool(history and "history" in sources)


class PromptIndex:
    """One prompt's proposal index, shared by its samples in one engine (see the module doc).

    Members write their responses with ``extend``. The engines write every sample's new tokens
    once per engine step, in request-id order, before any sample proposes, so two engines that
    step alike index alike and propose alike."""

    def __init__(self, prompt: Sequence[int], drafts: Sequence[Sequence[int]] = (),
                 min_match: int = 2, max_match: int = 8,
                 sources: Sequence[str] = DEFAULT_SOURCES, history: Sequence[Sequence[int]] = ()):
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        unknown = sorted(set(sources) - set(SOURCES))
        if unknown:
            raise ValueError(f"unknown proposal sources {unknown}; known: {', '.join(SOURCES)}")
        self.min_match, self.max_match = min_match, max_match
        self.prompt = [int(t) for t in prompt]
        self.sources = frozenset(sources)
        self.sequences: list[list[int]] = []
        self.source_of: list[str] = []   # a static source, or "response"
        self.owner_of: list[str | None] = []   # the member whose response it is
        self.index: dict[tuple[int, ...], dict[int, int]] = {}   # n-gram -> {sequence: end}
        self.members: dict[str, int] = {}   # member -> its response's sequence
        self.draft_sequence: dict[int, int] = {}   # draft's place in ``drafts`` -> its sequence
        if "prompt" in self.sources:
            self._add(list(self.prompt), "prompt")
        if self.sources & set(DRAFTS):
            for i, text in enumerate(drafts):
                if text:
                    self.draft_sequence[i] = self._add(self.prompt + [int(t) for t in text],
                                                       "bubble")
        if "history" in self.sources:
            for text in history:
                if text:
                    self._add(self.prompt + [int(t) for t in text], "history")

    def _add(self, seq: list[int], source: str, owner: str | None = None) -> int:
        self.sequences.append(seq)
        self.source_of.append(source)
        self.owner_of.append(owner)
        self._index_ends(len(self.sequences) - 1, range(1, len(seq)))
        return len(self.sequences) - 1

    def _index_ends(self, s: int, ends: range) -> None:
        """n-grams of sequence ``s`` ending before each ``end`` (so each has a follower)."""
        seq = self.sequences[s]
        for end in ends:
            for n in range(self.min_match, min(self.max_match, end) + 1):
                self.index.setdefault(tuple(seq[end - n:end]), {}).setdefault(s, end)

    @property
    def grows(self) -> bool:
        """Whether the samples' texts are indexed (``self`` or ``siblings`` is a source)."""
        return bool(self.sources & set(GROWING))

    def join(self, member: str, own_draft: int | None = None) -> None:
        """A sample of this prompt (``own_draft``: the place of its own draft in ``drafts``): its
        response gets a sequence once it writes one."""
        if own_draft in self.draft_sequence:
            self.owner_of[self.draft_sequence[own_draft]] = member
        if member not in self.members and self.grows:
            self.members[member] = self._add([], "response", member)

    def written(self, member: str) -> int:
        """How many response tokens of ``member`` the index holds."""
        s = self.members.get(member)
        return 0 if s is None else len(self.sequences[s])

    def extend(self, member: str, tokens: Sequence[int]) -> None:
        """The member's next response tokens: index them."""
        s = self.members.get(member)
        if s is None or not len(tokens):
            return
        own = self.sequences[s]
        start = len(own)
        own.extend(int(t) for t in tokens)
        self._index_ends(s, range(max(1, start), len(own)))

    def _source(self, s: int, member: str) -> str | None:
        """What sequence ``s`` is to ``member``: its source if ``member`` may propose from it."""
        source, own = self.source_of[s], self.owner_of[s] == member
        if source == "bubble":
            source = "realign" if own else "bubble"
        elif source == "response":
            source = "self" if own else "siblings"
        return source if source in self.sources else None

    def propose(self, member: str, context: Sequence[int], k: int) -> tuple[list[int], str | None]:
        """Up to k tokens that followed the longest suffix of ``context`` that ``member`` may
        match, and their source ([] and None without a match)."""
        if k <= 0:
            return [], None
        for n in range(min(self.max_match, len(context)), self.min_match - 1, -1):
            hits = self.index.get(tuple(int(t) for t in context[len(context) - n:]))
            for s, end in (hits or {}).items():
                source = self._source(s, member)
                if source is not None:
                    return self.sequences[s][end:end + k], source
        return [], None


class DraftPool:
    """One sample's view of its prompt's ``PromptIndex``: its own (``index`` None) or one shared
    with the prompt's other samples in the engine (``siblings``)."""

    def __init__(self, prompt: Sequence[int], drafts: Sequence[Sequence[int]] = (),
                 min_match: int = 2, max_match: int = 8,
                 sources: Sequence[str] = DEFAULT_SOURCES, history: Sequence[Sequence[int]] = (),
                 *, index: PromptIndex | None = None, member: str = "sample",
                 own_draft: int | None = None):
        self.index = index or PromptIndex(prompt, drafts, min_match, max_match, sources, history)
        self.member = member
        self.prompt_len = len(prompt)
        self.index.join(member, own_draft)

    def __bool__(self) -> bool:
        """Whether anything may ever propose (a static sequence, or the samples' texts)."""
        return self.index.grows or any(s in STATIC for s in self.index.source_of)

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

    def __init__(self, min_match: int, max_match: int, sources: Sequence[str]):
        self.min_match, self.max_match, self.sources = min_match, max_match, tuple(sources)
        self.shared = "siblings" in self.sources
        self.indexes: dict[tuple, tuple[PromptIndex, set[str]]] = {}
        self.key_of: dict[str, tuple] = {}   # member -> its prompt's key

    def pool(self, member: str, prompt: Sequence[int], drafts: Sequence[Sequence[int]] = (),
             history: Sequence[Sequence[int]] = (), own_draft: int | None = None) -> DraftPool:
        """The sample ``member``'s pool (``own_draft``: the place of its own draft in
        ``drafts``): a view of its prompt's shared index."""
        if not self.shared:
            return DraftPool(prompt, drafts, self.min_match, self.max_match, self.sources,
                             history, member=member, own_draft=own_draft)
        key = (tuple(prompt), tuple(map(tuple, drafts)), tuple(map(tuple, history)))
        if key not in self.indexes:
            self.indexes[key] = (PromptIndex(prompt, drafts, self.min_match, self.max_match,
                                             self.sources, history), set())
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
