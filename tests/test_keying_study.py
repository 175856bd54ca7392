"""scripts/keying_study.py: its position keying draws what the reference engine draws, its context
keying gives every draw of a response a word of its own and a draft's words back to a response
that meets the draft's text again, and its replay counts what a draft saves."""

from __future__ import annotations

import random

import pytest

from megatron_bubblespec.models.architecture import load_checkpoint
from megatron_bubblespec.rollout.reference import ReferenceEngine
from megatron_bubblespec.rollout.torch_llama import TorchLlama
from megatron_bubblespec.sampling import SamplingParams, sample_key
from megatron_bubblespec.sampling.requests import RolloutRequest

from conftest import load_script


@pytest.fixture(scope="module")
def study():
    return load_script("keying_study")


def _words(keying, prompt, response):
    state, words = keying(prompt), []
    for token in response:
        words.append(state.word())
        state.append(token)
    return words


def test_context_words_are_distinct_within_a_response_even_where_it_loops(study):
    loop = [7, 8] * 200 + [7] * 100
    for k in (1, 2, 4):
        words = _words(study.keying_factory(f"context{k}"), [1, 2, 3], loop)
        assert len(set(words)) == len(words), k


def test_a_response_that_meets_its_draft_again_gets_the_drafts_words_back(study):
    keying = study.keying_factory("context2")
    draft = [10, 11, 12, 13, 14, 15]
    # draws 20 where the draft drew 12 (same word: same context "10 11"), then writes the draft's
    # 11 12 13 14 15 one place later: from the first draw after "11 12" on, the words are the
    # draft's again
    response = [10, 11, 20, 11, 12, 13, 14, 15]
    d, r = _words(keying, [1, 2], draft), _words(keying, [1, 2], response)
    assert r[:3] == d[:3]
    assert r[3] not in d and r[4] not in d
    assert r[5:] == d[3:]
    # keyed by position, the realigned tokens keep other words than the draft's same tokens
    p = study.keying_factory("position")
    shifted = zip(_words(p, [1, 2], response)[5:], _words(p, [1, 2], draft)[3:])
    assert all(mine != drafts for mine, drafts in shifted)


def test_replay_counts_the_prefix_the_realigned_tokens_and_the_engine_steps(study):
    draft = list(range(100, 140))
    assert study.replay(draft, draft, cap=8) == {"tokens": 40, "prefix": 40, "covered": 36,
                                                 "covered_after": 0, "steps": 5,
                                                 "steps_after": 0}
    # one token inserted at 10: the prefix ends there, the draft proposes again once the
    # response's last 3 tokens (min_match) occur in it
    response = draft[:10] + [7] + draft[10:]
    row = study.replay(draft, response, cap=64, min_match=3)
    assert row["prefix"] == 10
    # steps: the prefix (10 accepted + the 7 drawn), 3 tokens drawn alone (no 3-token match
    # yet), then the rest of the draft from its place after them
    assert row["covered"] == 10 + 27 and row["steps"] == 1 + 3 + 1 and row["steps_after"] == 4
    assert row["covered_after"] == 27
    shares = study.totals([row])
    assert shares["realigned_share"] == pytest.approx(27 / 30)
    assert shares["steps_per_token_after"] == pytest.approx(4 / 30)
    # a prefix longer than an engine step's proposals: its drawn tokens are not the draft's
    # realigned ones (the realigned count starts after the first divergence)
    long = list(range(200, 300))
    row = study.replay(long, long[:80] + [7] + long[80:], cap=8)
    assert row["prefix"] == 80 and row["covered"] == 72 + 16
    assert row["covered_after"] == 16 and row["steps_after"] == 3 + 2
    # nothing in common: one step a token
    assert study.replay([1, 2, 3], [4, 5, 6, 7]) == {"tokens": 4, "prefix": 0, "covered": 0,
                                                      "covered_after": 0, "steps": 4,
                                                      "steps_after": 3}


def test_position_keying_draws_what_the_reference_engine_draws(study, tiny_checkpoint):
    path = tiny_checkpoint("llama", vocab_size=96)
    params = SamplingParams(0.8, top_p=0.9)
    prompts = [[5, 9, 11], [3, 4], [17, 2, 8, 30]]
    keys = [sample_key(3, 1, i, 0) for i in range(len(prompts))]
    eos = (0,)
    model = TorchLlama(*load_checkpoint(path))
    ours = study.generate(model, prompts, keys, eos, params, 24, study.keying_factory("position"))
    requests = [RolloutRequest(f"r{i}", p, k, 24, eos_token_ids=eos)
                for i, (p, k) in enumerate(zip(prompts, keys))]
    theirs = [r.token_ids for r in ReferenceEngine(path).generate(requests, params)]
    assert ours == theirs
    assert any(len(r) > 1 for r in ours)
    # the context keying draws other tokens from the same model and keys
    other = study.generate(model, prompts, keys, eos, params, 24,
                           study.keying_factory("context2"))
    assert other != ours


def test_report_has_a_row_per_keying_with_the_pooled_shares(study):
    draft = list(range(100, 140))
    rows = {"position": [study.replay(draft, draft[:10] + [7] + draft[10:], cap=64)] * 3,
            "context2": [study.replay(draft, draft, cap=64)] * 3}
    pairs = [{"keyings": {name: {"rows": r, "longest_rows": r[:1]} for name, r in rows.items()}}]
    table = study.report(pairs, ["position", "context2"]).splitlines()
    assert len(table) == 4
    position = [c.strip() for c in table[2].split("|")]
    assert position[1:4] == ["position", "3 (1)", f"{10 / 41:.3f}"]
    # every resampling of three equal responses gives the same share: a zero-width interval
    assert position[6] == f"{27 / 30:.3f} ({27 / 30:.3f}-{27 / 30:.3f})"


def _prefix_steps_accepted(prefix: int, tokens: int, cap: int) -> int:
    """The draft tokens the aligned engine steps of a prefix accept: cap a step, one drawn."""
    i = accepted = 0
    while i <= prefix and i < tokens:
        gain = min(cap, prefix - i)
        accepted += gain
        i += gain
        i += i < tokens
    return accepted


def test_the_realigned_count_is_what_the_prefix_steps_leave_of_the_covered(study):
    """What the prefix's engine steps accept depends only on its length, the response's and the
    cap, so covered - that = the realigned tokens (how docs/results/keying-study.json's rows got
    their ``covered_after``)."""
    rng = random.Random(0)
    for _ in range(500):
        draft = [rng.randint(0, 5) for _ in range(rng.randint(1, 120))]
        response = draft[:rng.randint(0, len(draft))] + [rng.randint(0, 5)
                                                         for _ in range(rng.randint(1, 60))]
        cap = rng.choice([4, 8, 32])
        row = study.replay(draft, response, cap=cap)
        assert row["covered_after"] == row["covered"] - _prefix_steps_accepted(
            row["prefix"], row["tokens"], cap)
