"""The proposal-source registry and the suffix source: what each source may match, how the pool
chooses among them, and that a suffix match proposes as many tokens as it matched."""

from __future__ import annotations

import pytest

from megatron_bubblespec.config import load_config
from megatron_bubblespec.preflight import PreflightError, check_registered
from megatron_bubblespec.speculative.pool import Continuation, DraftPool, PromptIndex
from megatron_bubblespec.speculative.sources import (SOURCES, Lookup, NgramSource, PromptTexts,
                                                     SuffixSource, has_sources, register_source,
                                                     sources_named)

PROMPT = [1, 2, 3]
LOOP = [10, 11, 12, 13, 14, 15, 16]


def test_every_source_is_registered_once_and_an_unknown_one_is_refused():
    assert list(SOURCES) == ["prompt", "bubble", "realign", "history", "self", "siblings",
                             "suffix"]
    with pytest.raises(ValueError, match="registered twice"):
        register_source(NgramSource("self", "responses", "own"), ("responses",))
    with pytest.raises(ValueError, match="unknown proposal sources .'elsewhere'."):
        sources_named(["self", "elsewhere"])
    with pytest.raises(ValueError, match="unknown corpora"):
        register_source(NgramSource("new", "scratch"), ("scratch",))
    cfg = load_config(None, ["spec.proposal_sources=[self,elsewhere]"])   # the config loads ...
    with pytest.raises(PreflightError, match="spec.proposal_sources has .'elsewhere'."):
        check_registered(cfg)                                             # ... preflight refuses
    check_registered(load_config(None, ["spec.proposal_sources=[suffix]"]))


def test_sources_read_only_their_corpora():
    # the prompt and the samples' texts always exist; drafts and responses only when given
    assert has_sources(["suffix"], drafts=[])
    assert not has_sources(["bubble", "realign"], drafts=[])
    assert has_sources(["bubble"], drafts=[[5]]) and has_sources(["history"], [], [[5]])
    texts = PromptTexts(PROMPT, [[7, 8]], [[9]], corpora=("drafts",))
    assert texts.corpus_of == ["drafts"] and not texts.grows


def test_a_looping_response_proposes_as_far_as_it_repeated():
    """The own text repeats a 7-token loop: the suffix source traces the match back through every
    repetition and proposes that many tokens of the loop (up to suffix_k), where the n-gram
    ``self`` source proposes k."""
    text = PROMPT + LOOP * 4 + LOOP[:3]
    index = PromptIndex(PROMPT, sources=("self", "suffix"), suffix_k=100)
    index.join("a")
    index.extend("a", text[len(PROMPT):])
    tokens, source = index.propose("a", text, k=4)
    assert source == "suffix"
    # the latest earlier place of the context's end is one loop back: it agrees back to the
    # response's start (24 tokens), and the proposal repeats the loop that far
    assert tokens == (LOOP[3:] + LOOP * 4)[:24]
    capped = PromptIndex(PROMPT, sources=("suffix",), suffix_k=5)
    capped.join("a")
    capped.extend("a", text[len(PROMPT):])
    assert capped.propose("a", text, k=4) == (LOOP[3:] + LOOP[:1], "suffix")
    ngram = PromptIndex(PROMPT, sources=("self",))
    ngram.join("a")
    ngram.extend("a", text[len(PROMPT):])
    assert ngram.propose("a", text, k=4) == (LOOP[3:7], "self")


def test_the_suffix_source_matches_drafts_and_siblings_and_ties_go_to_the_ngram_sources():
    draft = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]
    index = PromptIndex(PROMPT, [draft], min_match=2, max_match=4,
                        sources=("bubble", "realign", "suffix"), suffix_k=32)
    index.join("a", own_draft=0)
    # the response met the draft again after a wrong token: 6 tokens agree, over max_match
    context = PROMPT + [20, 21, 99, 23, 24, 25, 26, 27, 28]
    assert index.propose("a", context, k=4) == (draft[9:], "suffix")
    # 3 tokens agree (fewer than max_match): the n-gram source of the same sequence wins the tie
    assert index.propose("a", PROMPT + [99, 26, 27, 28], k=4) == (draft[9:], "realign")
    assert index.propose("b", PROMPT + [99, 26, 27, 28], k=2) == (draft[9:11], "bubble")
    shared = PromptIndex(PROMPT, sources=("suffix",))
    shared.join("a")
    shared.join("b")
    shared.extend("a", LOOP)
    assert shared.propose("b", PROMPT + [5] + LOOP[:5], k=4) == (LOOP[5:], "suffix")
    lookup = Lookup(shared, PROMPT + [40, 41])
    assert lookup.hits == [] and SuffixSource().match(shared, "b", lookup) is None


def test_a_suffix_proposal_is_cut_to_what_pays_and_to_the_budget():
    text = PROMPT + LOOP * 4 + LOOP[:3]
    pool = DraftPool(PROMPT, [], 2, 8, sources=("suffix",), suffix_k=64)
    free = Continuation(pool, k=4)
    assert free.propose(text, budget=100) == (LOOP[3:] + LOOP * 4)[:24]   # as long as the match
    assert free.propose(text, budget=2) == LOOP[3:5]          # the budget caps it
    costly = Continuation(DraftPool(PROMPT, [], 2, 8, sources=("suffix",), suffix_k=64),
                          k=4, token_cost=0.4)
    assert costly.propose(text, budget=100) == LOOP[3:4]      # a = 1/2: one token pays
    widths = []
    for _ in range(12):                                       # every proposed token accepted
        proposal = costly.propose(text, budget=100)
        costly.record(proposal, len(proposal))
        widths.append(len(proposal))
    assert widths == sorted(widths) and widths[-1] > 4        # past spec_k as acceptance climbs
    assert costly.by_source()["suffix"][0] > 0
