"""scripts/fork_study.py: a draft's margins are the gaps between the keyed draw's two best scores, a
fork drafted from a prefix continues as the whole response would, and the replay proposes from
the forks."""

from __future__ import annotations

import pytest

from megatron_bubblespec.models.architecture import load_checkpoint
from megatron_bubblespec.rollout.torch_llama import TorchLlama
from megatron_bubblespec.sampling import SamplingParams, sample_key
from megatron_bubblespec.sampling.draw_words import Keying
from megatron_bubblespec.sampling.keyed import perturbed_scores

from conftest import load_script


@pytest.fixture(scope="module")
def forks():
    return load_script("fork_study")


@pytest.mark.parametrize("name", ["position", "context2"])
def test_margins_and_forks_are_the_keyed_draws(forks, tiny_checkpoint, name):
    study = forks.study
    path = tiny_checkpoint("llama", vocab_size=96)
    params = SamplingParams(0.8, top_p=0.9, keying=Keying.parse(name))
    prompts = [[5, 9, 11], [3, 4], [17, 2, 8, 30]]
    keys = [sample_key(3, 1, i, 0) for i in range(len(prompts))]
    model, keying = TorchLlama(*load_checkpoint(path)), study.keying_factory(name)
    plain = study.generate(model, prompts, keys, (0,), params, 24, keying)
    runners_up = [[] for _ in prompts]
    drafts = study.generate(model, prompts, keys, (0,), params, 24, keying, runners_up=runners_up)
    assert drafts == plain   # recording the runners-up changes no draw
    for prompt, key, draft, seconds in zip(prompts, keys, drafts, runners_up):
        assert len(seconds) == len(draft)
        # each margin is the drawn token's score less the runner-up's, both the keyed scores
        words = Keying.parse(name).words(prompt, [], draft)
        for q, (second, gap) in enumerate(seconds):
            logits = model_logits(model, prompt + draft[:q])
            scores = perturbed_scores(logits, [key], [words[q]], params)[0]
            assert second != draft[q] and gap >= 0
            assert gap == pytest.approx(float(scores[draft[q]] - scores[second]), abs=1e-4)
            assert float(scores[second]) == pytest.approx(
                float(scores.masked_fill(_one_hot(draft[q], scores), float("-inf")).max()),
                abs=1e-4)
    # a draft resumed from its own prefix draws the same tokens: a fork's words are those the
    # response would use there
    cut = [len(d) // 2 for d in drafts]
    resumed = study.generate(model, prompts, keys, (0,), params, 24, keying,
                             prefixes=[d[:c] for d, c in zip(drafts, cut)])
    assert resumed == drafts
    # a fork: the runner-up at the smallest margin, then what the policy draws after it
    s = max(range(len(drafts)), key=lambda i: len(drafts[i]))
    q = forks.lowest_margins([m for _, m in runners_up[s]][:-1], 1)[0]
    start = forks.fork_prefixes(drafts[s], runners_up[s], [q])[0]
    fork = study.generate(model, [prompts[s]], [keys[s]], (0,), params, 24, keying,
                          prefixes=[start])[0]
    assert fork[:q + 1] == start and fork[q] != drafts[s][q]
    # a budget per row: each response stops at its own, or at EOS before it
    capped = study.generate(model, prompts, keys, (0,), params, [4, 24, 9], keying)
    assert [len(c) for c in capped] == [min(len(d), b) for d, b in zip(drafts, [4, 24, 9])]
    assert all(c == d[:len(c)] for c, d in zip(capped, drafts))


def model_logits(model: TorchLlama, tokens: list[int]):
    import torch

    slot = torch.tensor([model.cache.acquire()])
    try:
        row = torch.tensor([tokens])
        logits = model.forward(row, slot, torch.zeros(1, dtype=torch.int64),
                               torch.tensor([len(tokens)]))
        return logits[:, -1]
    finally:
        model.cache.release(int(slot))


def _one_hot(token: int, scores):
    import torch

    mask = torch.zeros_like(scores, dtype=torch.bool)
    mask[token] = True
    return mask


def test_the_replay_proposes_from_a_fork_after_the_response_takes_its_token(forks):
    study = forks.study
    draft = list(range(100, 160))
    fork = draft[:20] + [7] + list(range(300, 339))
    response = fork[:]
    events: list = []
    alone = study.replay(draft, response, cap=8, min_match=3, divergences=events)
    assert events[0] == (0, 20, 7)   # it left the draft at place 20, drawing 7
    with_fork = study.replay(draft, response, cap=8, min_match=3, forks=[fork])
    # 8 + 8 + 2 draft tokens accepted in 3 steps, then a step a token
    assert alone["covered"] == 18 and alone["steps"] == 3 + 39
    # past place 20 the fork proposes as the draft did: 8 a step and a drawn token, 35 in 5 steps
    assert with_fork["covered"] == 18 + 35 and with_fork["steps"] == 3 + 5
    # a fork the response never takes changes nothing
    assert study.replay(draft, response, cap=8, min_match=3,
                        forks=[draft[:30] + [9] * 10]) == alone


def test_lowest_margins_and_their_rank(forks):
    margins = [0.5, 0.1, 2.0, 0.1, 0.05, 3.0]
    assert forks.lowest_margins(margins, 3) == [1, 3, 4]
    assert forks.margin_rank(margins, 4) == 0.0
    assert forks.margin_rank(margins, 5) == pytest.approx(5 / 6)
    assert forks.fork_prefixes([10, 11, 12], [(20, 0.1), (21, 0.2), (22, 0.3)], [0, 2]) == [
        [20], [10, 11, 22]]


def test_the_report_counts_divergences_at_low_margins_and_the_forks_steps(forks):
    def steps(n):
        return {"steps": n}

    pair = {"before": 2, "after": 3, "rows_differ": 0,
            "margins": [[0.5, 0.01, 3.0, 0.2, 1.0], [2.0, 0.3, 0.1, 4.0]],
            "divergences": [
                {"sample": 0, "place": 1, "margin": 0.01, "rank": 0.0, "runner_up": True,
                 "first": True},
                {"sample": 0, "place": 3, "margin": 0.2, "rank": 0.2, "runner_up": False,
                 "first": False},
                {"sample": 1, "place": 0, "margin": 2.0, "rank": 0.5, "runner_up": True,
                 "first": True}],
            "samples": [{"sample": 0, "tokens": 50, "fork_tokens": 30, "none": steps(40),
                         "forks": steps(31), "bound": steps(20), "longest": True},
                        {"sample": 1, "tokens": 20, "fork_tokens": 10, "none": steps(18),
                         "forks": steps(18), "bound": steps(12), "longest": False}]}
    total = forks.summary([pair], 1)
    assert total["divergences"] == 3 and total["first_divergences"] == 2
    # sample 0 left its draft at its lowest margin, sample 1 at its second highest
    assert total["first_at_lowest_margins"] == 0.5
    assert total["runner_up_share"] == pytest.approx(2 / 3)
    assert total["steps"] == {"none": 58, "forks": 49, "bound": 32}
    assert total["straggler_steps"] == {"none": 40, "forks": 31, "bound": 20}
    table = forks.report({"pairs": [pair], "forks": 1})
    assert "| 2 -> 3 | 3 (2) | 0.0% |" in table and "| all | 3 (2) |" in table
    assert total["runner_up_share_first"] == 1.0 and total["margin_median_at_first"] == pytest.approx(1.005)
    assert "| with a fork at each of its 1 lowest margins | 49 | 31 |" in table
