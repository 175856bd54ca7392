"""A prompt's texts (its prompt, bubble drafts, earlier responses and its samples' responses as
they grow) + a decoding sample's text so far -> each proposal source's longest match -> the tokens
that followed it, which the pool proposes.

A proposal source (``spec.proposal_sources``) is one class registered here by name; nothing else in
the project knows a source by name. Every source reads the same ``PromptTexts``: one list of
sequences, each of a corpus (``prompt``, ``drafts``, ``history``, ``responses``) and, for drafts and
responses, the sample it belongs to, with one n-gram index over all of them (every n-gram, n in
[min_match, max_match], -> per sequence the first and the last place it ended). A source answers
``match(texts, member, lookup)`` (``lookup``: the context's n-gram hits) with a ``Match``: how
many of the context's last tokens it matched, in which sequence, and what followed. The pool takes
the longest match; among equal lengths the earlier sequence, then the source registered first.
Proposals are only proposals (the keyed verifier decides), so any source is exact.

The sources:

* ``prompt``: the prompt's text (a response often quotes the question's numbers and phrases);
* ``bubble``: the drafts of the same prompt's other samples, made by an older policy in the bubble
  (each as prompt + draft);
* ``realign``: the sample's own bubble draft after the response left it: a suffix match finds
  where the response meets the draft again, and the draft resumes from there;
* ``history``: the prompt's responses from the last time it was rolled out (an earlier epoch);
* ``self``: the sample's own response so far (repetitions);
* ``siblings``: the same prompt's other samples in the same engine, as they are generated;
* ``suffix``: every text above, matched as far back as it agrees with the sample's text (not only
  ``max_match`` tokens), in the manner of SuffixDecoding (arXiv 2411.04975): the proposal is as long
  as the match, up to ``spec.suffix_k`` tokens, so a response that repeats itself proposes tens of
  tokens a step.

Adding a source: a class with ``name`` and ``match`` below, one ``register_source`` line, and a
test; it is then a value of ``spec.proposal_sources`` and counted in
``spec/continuation_{proposed,accepted}_tokens/<name>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Protocol, Sequence

from megatron_bubblespec.registry import Registry

CORPORA = ("prompt", "drafts", "history", "responses")
SUFFIX_WALK = 256   # the most tokens a suffix match is traced back (its length caps there)


@dataclass(frozen=True)
class Match:
    """``length`` context tokens matched, ending at ``end`` of sequence ``sequence``; ``limit``:
    the most tokens the source proposes from it (None: the engine's ``spec.spec_k``); ``period``:
    the match is in the sample's own text, ``period`` tokens before its end, and the proposal
    repeats what followed it (a text that repeats itself goes on repeating)."""

    length: int
    sequence: int
    end: int
    limit: int | None = None
    period: int | None = None

    def tokens(self, texts: PromptTexts, width: int) -> list[int]:
        seq = texts.sequences[self.sequence]
        if self.period is None:
            return seq[self.end:self.end + width]
        return [seq[self.end + i % self.period] for i in range(width)]


class PromptTexts:
    """One prompt's sequences and their n-gram index, shared by its samples in one engine.

    ``corpora``: which sequences to hold (those the enabled sources read). Members write their
    responses with ``extend``; the engines write every sample's new tokens once per engine step,
    in request-id order, before any sample proposes, so two engines that step alike match alike."""

    def __init__(self, prompt: Sequence[int], drafts: Sequence[Sequence[int]] = (),
                 history: Sequence[Sequence[int]] = (), min_match: int = 2, max_match: int = 8,
                 corpora: Sequence[str] = CORPORA):
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        self.min_match, self.max_match = min_match, max_match
        self.prompt = [int(t) for t in prompt]
        self.corpora = frozenset(corpora)
        self.sequences: list[list[int]] = []
        self.corpus_of: list[str] = []
        self.owner_of: list[str | None] = []   # the member whose draft or response it is
        # n-gram -> {sequence: [the first, the last place it ended]}
        self.index: dict[tuple[int, ...], dict[int, list[int]]] = {}
        self.members: dict[str, int] = {}      # member -> its response's sequence
        self.draft_sequence: dict[int, int] = {}   # draft's place in ``drafts`` -> its sequence
        if "prompt" in self.corpora:
            self._add(list(self.prompt), "prompt")
        if "drafts" in self.corpora:
            for i, text in enumerate(drafts):
                if text:
                    self.draft_sequence[i] = self._add(self.prompt + [int(t) for t in text],
                                                       "drafts")
        if "history" in self.corpora:
            for text in history:
                if text:
                    self._add(self.prompt + [int(t) for t in text], "history")

    def _add(self, seq: list[int], corpus: str, owner: str | None = None) -> int:
        self.sequences.append(seq)
        self.corpus_of.append(corpus)
        self.owner_of.append(owner)
        self._index_ends(len(self.sequences) - 1, range(1, len(seq)))
        return len(self.sequences) - 1

    def _index_ends(self, s: int, ends: range) -> None:
        """n-grams of sequence ``s`` ending before each ``end`` (so each has a follower)."""
        seq = self.sequences[s]
        for end in ends:
            for n in range(self.min_match, min(self.max_match, end) + 1):
                places = self.index.setdefault(tuple(seq[end - n:end]), {})
                if s in places:
                    places[s][1] = end
                else:
                    places[s] = [end, end]

    @property
    def grows(self) -> bool:
        """Whether the samples' responses are held (a source reads them)."""
        return "responses" in self.corpora

    def join(self, member: str, own_draft: int | None = None) -> None:
        """A sample of this prompt (``own_draft``: the place of its own draft in ``drafts``)."""
        if own_draft in self.draft_sequence:
            self.owner_of[self.draft_sequence[own_draft]] = member
        if member not in self.members and self.grows:
            self.members[member] = self._add([], "responses", member)

    def written(self, member: str) -> int:
        """How many response tokens of ``member`` the texts hold."""
        s = self.members.get(member)
        return 0 if s is None else len(self.sequences[s])

    def extend(self, member: str, tokens: Sequence[int]) -> None:
        """The member's next response tokens: hold and index them."""
        s = self.members.get(member)
        if s is None or not len(tokens):
            return
        own = self.sequences[s]
        start = len(own)
        own.extend(int(t) for t in tokens)
        self._index_ends(s, range(max(1, start), len(own)))

    def mine(self, s: int, member: str) -> bool:
        return self.owner_of[s] == member


class Lookup:
    """A context's n-gram hits, longest first, looked up once per proposal for every source."""

    def __init__(self, texts: PromptTexts, context: Sequence[int]):
        self.texts, self.context = texts, [int(t) for t in context[-SUFFIX_WALK:]]

    @cached_property
    def hits(self) -> list[tuple[int, dict[int, list[int]]]]:
        """(n, {sequence: [first end, last end]}) for every n from the longest down that occurs."""
        t, c = self.texts, self.context
        found = ((n, t.index.get(tuple(c[len(c) - n:])))
                 for n in range(min(t.max_match, len(c)), t.min_match - 1, -1))
        return [(n, places) for n, places in found if places]


class ProposalSource(Protocol):
    name: str
    reads_siblings: bool   # matches other samples' responses: the prompt's samples share texts

    def match(self, texts: PromptTexts, member: str, lookup: Lookup) -> Match | None:
        """The longest match of the context's end in this source's part of ``texts``."""


@dataclass(frozen=True)
class NgramSource:
    """The first place the longest n-gram the context ends with occurs in one corpus, in the
    member's own sequences (``whose="own"``), the others' or any."""

    name: str
    corpus: str
    whose: str = "any"   # own | others | any

    @property
    def reads_siblings(self) -> bool:
        return self.corpus == "responses" and self.whose != "own"

    def match(self, texts: PromptTexts, member: str, lookup: Lookup) -> Match | None:
        for n, places in lookup.hits:
            for s, (first, _) in places.items():
                if texts.corpus_of[s] == self.corpus and self._whose(texts.mine(s, member)):
                    return Match(n, s, first)
        return None

    def _whose(self, mine: bool) -> bool:
        return self.whose == "any" or mine == (self.whose == "own")


@dataclass(frozen=True)
class SuffixSource:
    """Every sequence, each match traced back as far as it agrees with the context (from the last
    place its n-gram occurred: in a repeating text the latest repetition agrees furthest); the
    longest wins and proposes as many tokens as it matched, up to ``suffix_k``. In the sample's
    own text the proposal repeats the stretch from the match to the text's end."""

    name: str = "suffix"
    reads_siblings: bool = True

    def match(self, texts: PromptTexts, member: str, lookup: Lookup) -> Match | None:
        if not lookup.hits:
            return None
        context, best = lookup.context, None
        n, places = lookup.hits[0]
        for s, (_, last) in places.items():
            seq, length, reach = texts.sequences[s], n, min(last, len(context))
            while length < reach and seq[last - 1 - length] == context[-1 - length]:
                length += 1
            if best is None or length > best.length:
                period = len(seq) - last if texts.members.get(member) == s else None
                best = Match(length, s, last, limit=length, period=period)
        return best


SOURCES: Registry = Registry("proposal source")


def register_source(source: ProposalSource, corpora: Sequence[str]) -> ProposalSource:
    """``source`` under its name, reading ``corpora`` of a prompt's texts."""
    unknown = sorted(set(corpora) - set(CORPORA))
    if unknown:
        raise ValueError(f"source {source.name!r} reads unknown corpora {unknown}")
    return SOURCES.register(source.name, (source, tuple(corpora)))


register_source(NgramSource("prompt", "prompt"), ("prompt",))
register_source(NgramSource("bubble", "drafts", "others"), ("drafts",))
register_source(NgramSource("realign", "drafts", "own"), ("drafts",))
register_source(NgramSource("history", "history"), ("history",))
register_source(NgramSource("self", "responses", "own"), ("responses",))
register_source(NgramSource("siblings", "responses", "others"), ("responses",))
register_source(SuffixSource(), CORPORA)

def sources_named(names: Sequence[str]) -> list[ProposalSource]:
    """The registered sources ``names`` in registration order (the order that settles ties)."""
    unknown = sorted(set(names) - set(SOURCES))
    if unknown:
        raise ValueError(f"unknown proposal sources {unknown}; known: {', '.join(SOURCES)}")
    return [source for name, (source, _) in SOURCES.items() if name in names]


def corpora_of(names: Sequence[str]) -> set[str]:
    """The corpora the sources ``names`` read."""
    return {c for name in names for c in SOURCES.entry(name)[1]}


def has_sources(names: Sequence[str], drafts, history=()) -> bool:
    """Whether a sample with these ``drafts`` (and earlier responses) has anything to propose
    from (its prompt and the samples' texts always exist; drafts and responses when there are
    some)."""
    corpora = corpora_of(names)
    return bool(corpora & {"prompt", "responses"}) or bool(drafts and "drafts" in corpora) \
        or bool(history and "history" in corpora)
