"""Draw words (``draw_words``): every draw of a response keyed by a word of its own, under either
keying and even when the context hash collides; the words pinned; ``ahead`` equal to appending;
a response that meets its draft's text again gets the draft's words back; and the verifier's word
rows."""

import random

import pytest
import torch

from megatron_bubblespec.sampling import draw_words
from megatron_bubblespec.sampling.draw_words import KEYINGS, Keying
from megatron_bubblespec.sampling import SamplingParams
from megatron_bubblespec.sampling.requests import RolloutRequest
from megatron_bubblespec.speculative.verify import draft_words

CONTEXT2 = Keying.parse("context2")


def _walk(keying, prompt, response):
    """Each draw's word, appending one token at a time."""
    words = keying.tracker(prompt)
    out = []
    for token in response:
        out.append(words.word())
        words.extend([token])
    return out + [words.word()]


def test_words_are_pinned():
    """Every stored draft depends on these values: change them only with a new version of them."""
    assert CONTEXT2.words([5, 6, 7], [8, 9, 8, 9, 8], [9, 8]) == [2528023045, 1086237875,
                                                                   3766843085]
    assert Keying.parse("context1").words([5], [1, 1, 1]) == [1098690018]
    assert Keying.parse("position").words([5], [1, 1, 1], [2, 3]) == [3, 4, 5]


@pytest.mark.parametrize("name", KEYINGS)
def test_a_responses_words_are_distinct_even_when_it_loops(name):
    rng = random.Random(name)
    keying = Keying.parse(name)
    for response in ([7] * 500, [3, 4] * 300, [rng.randrange(5) for _ in range(800)],
                     [rng.randrange(50_000) for _ in range(800)]):
        words = _walk(keying, [1, 2, 3], response)
        assert len(set(words)) == len(words), name
        assert all(0 <= w < 2 ** 32 for w in words)


def test_colliding_hashes_probe_to_distinct_words(monkeypatch):
    """A hash that maps every context to one word: the probe still gives each draw its own word,
    the same whether the response is walked token by token or looked ahead."""
    monkeypatch.setattr(draw_words, "chain", lambda *words: 2 ** 32 - 2)
    response = [random.Random(0).randrange(9) for _ in range(60)]
    words = _walk(CONTEXT2, [1], response)
    assert len(set(words)) == len(words)
    assert words[:3] == [2 ** 32 - 2, 2 ** 32 - 1, 0]   # wraps modulo 2**32
    assert CONTEXT2.words([1], response[:20], response[20:]) == words[20:]


@pytest.mark.parametrize("name", ["position", "context1", "context2", "context4"])
def test_looking_ahead_equals_appending(name):
    rng = random.Random(1)
    keying = Keying.parse(name)
    for _ in range(20):
        prompt = [rng.randrange(6) for _ in range(rng.randrange(0, 5))]
        response = [rng.randrange(6) for _ in range(rng.randrange(0, 40))]
        draft = [rng.randrange(6) for _ in range(rng.randrange(0, 12))]
        walked = _walk(keying, prompt, response + draft)
        tracker = keying.tracker(prompt, response)
        assert tracker.ahead(draft) == walked[len(response):]
        assert tracker.ahead(draft) == walked[len(response):]   # looking ahead changed nothing
        assert keying.words(prompt, response, draft) == walked[len(response):]


def test_a_response_that_meets_its_drafts_text_again_gets_its_words():
    """A response that parts from its draft at one token (a substitution) agrees with the
    draft's words again two tokens later under context2 (same 2-gram, same count), as by
    position; one that parts by an inserted pair of tokens agrees again under context2 only."""
    rng = random.Random(2)
    draft = [rng.randrange(100, 200) for _ in range(40)]
    substituted = draft[:10] + [7] + draft[11:]
    inserted = draft[:10] + [7, 8] + draft[10:]
    d, r = _walk(CONTEXT2, [1, 2], draft), _walk(CONTEXT2, [1, 2], substituted)
    assert d[:11] == r[:11] and d[11] != r[11] and d[12] != r[12] and d[13:] == r[13:]
    for keying, matched in ((CONTEXT2, len(draft) + 1 - 12), (Keying(), 0)):
        d, s = _walk(keying, [1, 2], draft), _walk(keying, [1, 2], inserted)
        assert d[:11] == s[:11]
        assert sum(a == b for a, b in zip(d[12:], s[14:])) == matched, keying.name


def test_the_verifiers_word_rows():
    """Row j of a request keys the draw after its prompt, prefix and draft[:j]; rows past the
    draft continue by ones (by position: the prefix length + j, as before words)."""
    requests = [RolloutRequest("a", [1, 2, 3], 5, 32, response_prefix=[4, 5]),
                RolloutRequest("b", [9], 6, 32)]
    drafts = [[6, 7], []]
    rows = draft_words(SamplingParams(1.0, keying=CONTEXT2), requests, drafts, 4)
    first = CONTEXT2.words([1, 2, 3], [4, 5], [6, 7])
    second = CONTEXT2.words([9], [])
    assert rows.tolist() == [first + [first[-1] + 1], second + [second[0] + j for j in (1, 2, 3)]]
    by_position = draft_words(SamplingParams(1.0), requests, drafts, 4)
    assert torch.equal(by_position, torch.tensor([[2, 3, 4, 5], [0, 1, 2, 3]]))


def test_an_unknown_keying_names_the_choices():
    with pytest.raises(ValueError, match="position or context1 .. context8"):
        Keying.parse("context9")
    assert [Keying.parse(name).name for name in KEYINGS] == list(KEYINGS)
