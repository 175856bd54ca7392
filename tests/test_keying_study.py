"""scripts/keying_study.py: under each keying it draws what the reference engine draws (the keyings
themselves: tests/test_draw_words.py), and its replay counts what a draft saves."""

from __future__ import annotations

import random

import pytest

from megatron_bubblespec.sampling.draw_words import Keying
from megatron_bubblespec.models.architecture import load_checkpoint
from megatron_bubblespec.rollout.reference import ReferenceEngine
from megatron_bubblespec.rollout.torch_llama import TorchLlama
from megatron_bubblespec.sampling import SamplingParams, sample_key
from megatron_bubblespec.sampling.requests import RolloutRequest

from conftest import load_script


@pytest.fixture(scope="module")
def study():
    return load_script("keying_study")


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


@pytest.mark.parametrize("name", ["position", "context2"])
def test_each_keying_draws_what_the_reference_engine_draws(study, tiny_checkpoint, name):
    path = tiny_checkpoint("llama", vocab_size=96)
    params = SamplingParams(0.8, top_p=0.9, keying=Keying.parse(name))
    prompts = [[5, 9, 11], [3, 4], [17, 2, 8, 30]]
    keys = [sample_key(3, 1, i, 0) for i in range(len(prompts))]
    eos = (0,)
    model = TorchLlama(*load_checkpoint(path))
    ours = study.generate(model, prompts, keys, eos, params, 24, study.keying_factory(name))
    requests = [RolloutRequest(f"r{i}", p, k, 24, eos_token_ids=eos)
                for i, (p, k) in enumerate(zip(prompts, keys))]
    theirs = [r.token_ids for r in ReferenceEngine(path).generate(requests, params)]
    assert ours == theirs
    assert any(len(r) > 1 for r in ours)
    # the other keying draws other tokens from the same model and keys
    other = study.generate(model, prompts, keys, eos, params, 24,
                           study.keying_factory("context2" if name == "position" else "position"))
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
