"""scripts/length_survey.py's statistics: the bubble of a deal of prompts to ranks, the share of
the length variance that prompt identity explains, the share at the budget."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import load_script


@pytest.fixture(scope="module")
def survey():
    return load_script("length_survey")


def test_bubble_is_the_idle_share_of_the_slowest_rank(survey):
    # two prompts, each rank gets one: rank times 10 and 30 in every deal -> 1 - 20 / 30
    lengths = np.array([[10, 4], [30, 7]])
    assert survey.bubble(lengths, ranks=2, groups=1, deals=50, seed=0) == pytest.approx(1 / 3)
    # equal prompts leave no bubble
    assert survey.bubble(np.full((4, 2), 9), ranks=2, groups=2, deals=50, seed=0) == 0.0


def test_summary_splits_length_variance_by_prompt(survey):
    by_prompt = np.array([[10, 10], [30, 30]])          # all variance between prompts
    within = np.array([[10, 30], [30, 10]])             # all variance within a prompt
    rewards = np.zeros((2, 2))
    a = survey.summary(by_prompt, rewards, budget=30, ranks=[2], groups=1, seed=0)
    b = survey.summary(within, rewards, budget=30, ranks=[2], groups=1, seed=0)
    assert a["prompt_share_of_variance"] == pytest.approx(1.0)
    assert b["prompt_share_of_variance"] == pytest.approx(0.0)
    assert a["at_budget"] == b["at_budget"] == 0.5
    assert a["bubble"]["2"] == pytest.approx(1 / 3) and b["bubble"]["2"] == 0.0


def test_candidates_name_a_known_task(survey):
    assert survey.candidate("arithmetic:1.0:0.9") == ("arithmetic", 1.0, 0.9)
    with pytest.raises(SystemExit, match="unknown task"):
        survey.candidate("math:1.0:1.0")
