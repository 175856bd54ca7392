"""scripts/slurm/train.sbatch on a real Slurm: munged + slurmctld + two slurmd started here
(scripts/slurm/local_cluster.py, all state in a temporary directory, killed afterwards). The two
nodes, bsnode1 and bsnode2, resolve to 127.0.0.2 and 127.0.0.3 (added to /etc/hosts when absent).

Two jobs of configs/tiny.yaml, 1 node x 2 ranks, the same seed, one after the other: a plain one
that must complete, and one with a checkpoint every step that gets the batch script's
preemption signal mid-run (``scancel --signal=USR1 --batch``, what ``#SBATCH --signal=B:USR1@...``
sends), stops at a checkpoint, is requeued by the script, resumes with run.resume=auto and must end
with exactly the plain job's final weights. Then the same run on 2 nodes x 1 rank (``srun -N 2``,
one torchrun per node, c10d rendezvous at the first node's name) must give the plain job's
rollouts token for token, and a 2-node job whose second node is killed mid-run must fail at once
with a message naming that node. Then three quick ones: a config that does not fit the job fails
before anything starts, the no-progress watchdog ends a job and leaves no process behind, and the
ablation array job finds and runs studies by index (``--dry-run``).

Needs root and the Debian packages slurm-wlm + munge (installed with apt-get when missing); skips
with the reason when Slurm cannot be installed or started here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SLURM_DIR = ROOT / "scripts" / "slurm"
STEPS = 3  # the stop signal lands before step 0 ends: stop after it, steps 1-2 in the resumed start
JOB_TIMEOUT_S = 300.0

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _local_cluster():
    module_spec = importlib.util.spec_from_file_location("local_cluster",
                                                         SLURM_DIR / "local_cluster.py")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    lc = _local_cluster()
    if os.geteuid() != 0:
        pytest.skip("a local Slurm needs root (slurmd starts jobs as their user; SlurmUser=root)")
    reason = lc.ensure_installed(install=True)
    if reason:
        pytest.skip(f"no Slurm here: {reason}")
    slurm = lc.LocalSlurm(tmp_path_factory.mktemp("slurm") / "cluster", nodes=2)
    try:
        slurm.start()
    except (lc.SlurmError, OSError, subprocess.SubprocessError) as err:
        slurm.stop()
        pytest.skip(f"cannot start a local Slurm: {err}")
    yield slurm
    slurm.stop()


class Job:
    def __init__(self, cluster, name: str, base: Path, overrides: list[str], nodes: int = 1,
                 after: int | None = None, **env_vars: str):
        self.cluster = cluster
        self.name = name
        self.run_dir = base / "runs" / name
        overrides = [f"run.steps={STEPS}", f"run.output_dir={base / 'runs'}", f"run.name={name}",
                     "logging.progress=false", "logging.plot=false",
                     "logging.tensorboard=false", *overrides]
        env = {k: v for k, v in cluster.env.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                            "CONFIG", "OVERRIDES", "GPUS_PER_NODE", "NPROC", "RUN_DIR", "LOG_DIR",
                            "VENV", "REQUEUE", "RESUME", "EXTRA_TORCHRUN")}
        env.update(CONFIG="configs/tiny.yaml", OVERRIDES=" ".join(overrides), NPROC=str(2 // nodes),
                   PYTHON=sys.executable, MASTER_PORT=str(_free_port()),
                   LOG_DIR=str(base / "logs" / name), WATCHDOG_S="900")
        env.update(env_vars)
        self.output_pattern = base / "logs" / f"{name}-%j.out"
        self.output_pattern.parent.mkdir(parents=True, exist_ok=True)
        order = [f"--dependency=afterany:{after}"] if after else []
        self.id = cluster.sbatch(["--job-name", name, "--output", str(self.output_pattern),
                                  f"--nodes={nodes}", *order, str(SLURM_DIR / "train.sbatch")],
                                 env=env, cwd=ROOT)
        self.output = Path(str(self.output_pattern).replace("%j", str(self.id)))

    def log(self) -> str:
        return self.output.read_text(errors="replace") if self.output.exists() else ""

    def diagnosis(self, info: dict) -> str:
        state = {k: info.get(k) for k in ("JobState", "ExitCode", "Restarts", "Reason")}
        return f"job {self.id} ({self.name}) {state}; its output ({self.output}):\n" + \
            "\n".join(self.log().splitlines()[-60:])

    def wait(self, **kw) -> dict:
        try:
            return self.cluster.wait(self.id, timeout=kw.pop("timeout", JOB_TIMEOUT_S), **kw)
        except TimeoutError as err:
            pytest.fail(f"{err}\n{self.diagnosis(self.cluster.job(self.id))}")

    def steps(self) -> list[int]:
        lines = (self.run_dir / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["step"] for line in lines if line.strip()]

    def rollouts(self) -> list[dict]:
        lines = (self.run_dir / "rollouts.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def final_weights(self) -> dict:
        from safetensors.torch import load_file

        path = self.run_dir / "final" / "model.safetensors"
        assert path.is_file(), f"{path} missing\n{self.diagnosis(self.cluster.job(self.id))}"
        return load_file(str(path))


@pytest.fixture(scope="module")
def jobs(cluster, tmp_path_factory):
    """All jobs are submitted at once; the others start after the plain one (so that the first
    test's wait does not let the requeued one finish unobserved, and no two share the CPUs)."""
    base = tmp_path_factory.mktemp("jobs")
    plain = Job(cluster, "plain", base, [])
    requeued = Job(cluster, "requeued", base, ["run.checkpoint_every=1"], after=plain.id)
    two_nodes = Job(cluster, "two-nodes", base, [], nodes=2, after=plain.id)
    return {"plain": plain, "requeued": requeued, "two-nodes": two_nodes}


def test_train_job_completes(jobs):
    job = jobs["plain"]
    info = job.wait()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", job.diagnosis(info)
    assert info["Restarts"] == "0", job.diagnosis(info)
    assert job.steps() == list(range(STEPS)), job.diagnosis(info)
    log = job.log()
    assert "(start 1)" in log and "training finished" in log, job.diagnosis(info)
    assert (job.run_dir / "final" / "model.safetensors").is_file(), job.diagnosis(info)


def test_requeued_job_resumes_to_the_same_weights(cluster, jobs):
    import torch

    job = jobs["requeued"]
    heartbeats = job.run_dir / "heartbeat"
    def handling_signals(_info) -> bool:
        # Every rank has installed its stop-signal handler (it does so before its "build" beat),
        # and it is still building: the signal lands a whole step or more before the last one.
        beats = [json.loads(p.read_text()) for p in heartbeats.glob("rank*.json")]
        return len(beats) == 2 and all(b["stage"] != "start" for b in beats)

    info = job.wait(until=handling_signals, poll=0.2)
    assert info["JobState"] == "RUNNING", f"the job ended before its ranks started\n" \
        f"{job.diagnosis(info)}"
    # What `#SBATCH --signal=B:USR1@<s>` does before the time limit: signal the batch shell only.
    subprocess.run(["scancel", "--signal=USR1", "--batch", str(job.id)], env=cluster.env,
                   check=True, capture_output=True, timeout=30)
    info = job.wait(until=lambda i: int(i.get("Restarts", "0")) >= 1)
    assert int(info["Restarts"]) >= 1, \
        f"not requeued (did the run finish before the signal?)\n{job.diagnosis(info)}"
    info = job.wait()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", job.diagnosis(info)
    assert info["Restarts"] == "1", job.diagnosis(info)
    log = job.log()
    for needle in ("(start 1)", "got SIGUSR1", "stopped at a checkpoint", "requeueing",
                   "(start 2)", "resumed from", "training finished"):
        assert needle in log, f"{needle!r} not in the job's output\n{job.diagnosis(info)}"
    assert job.steps() == list(range(STEPS)), job.diagnosis(info)

    plain = jobs["plain"]
    plain_info = plain.wait()
    assert plain_info["JobState"] == "COMPLETED", plain.diagnosis(plain_info)
    resumed, reference = job.final_weights(), plain.final_weights()
    assert sorted(resumed) == sorted(reference)
    for name in reference:
        torch.testing.assert_close(resumed[name], reference[name], atol=1e-6, rtol=0,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_two_node_job_gives_the_single_node_rollouts(jobs):
    job = jobs["two-nodes"]
    info = job.wait()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", job.diagnosis(info)
    assert info["NodeList"] == "bsnode[1-2]", job.diagnosis(info)
    log = job.log()
    assert "2 node(s) x 1 rank(s) = 2 ranks" in log and "rendezvous bsnode1:" in log, \
        job.diagnosis(info)
    plain = jobs["plain"]
    plain_info = plain.wait()
    assert plain_info["JobState"] == "COMPLETED", plain.diagnosis(plain_info)
    assert job.rollouts() == plain.rollouts() and len(job.rollouts()) == STEPS


def _job_processes(job_id: int, node: str | None = None) -> list[int]:
    """The live processes of a job (on one node: its SLURMD_NODENAME), Slurm's own aside."""
    markers = [f"SLURM_JOB_ID={job_id}".encode()]
    if node:
        markers.append(f"SLURMD_NODENAME={node}".encode())
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and all(m in (d / "environ").read_bytes().split(b"\0")
                                        for m in markers):
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                if fields[0] != "Z" and (d / "comm").read_text().strip() != "slurmstepd":
                    pids.append(int(d.name))
        except OSError:
            continue
    return pids


def test_a_killed_node_ends_the_job_naming_it(cluster, jobs, tmp_path):
    """Every process of the job on bsnode2 is SIGKILLed once step 0 is logged (what a node
    crash leaves behind): the job must fail at once, not at the watchdog, and say which node."""
    jobs["two-nodes"].wait()                  # both nodes free, and no CPU shared with it
    job = Job(cluster, "node-lost", tmp_path, [], nodes=2)
    info = job.wait(until=lambda _i: job.run_dir.joinpath("metrics.jsonl").is_file(), poll=0.2)
    assert info["JobState"] == "RUNNING", job.diagnosis(info)
    victims = _job_processes(job.id, "bsnode2")
    assert victims, f"no processes of job {job.id} on bsnode2\n{job.diagnosis(info)}"
    killed_at = time.monotonic()
    for pid in victims:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    info = job.wait(timeout=120)
    assert info["JobState"] == "FAILED", job.diagnosis(info)
    assert time.monotonic() - killed_at < 90, job.diagnosis(info)
    assert "lost: bsnode2 (node 1)" in job.log(), job.diagnosis(info)
    assert "lost: bsnode1" not in job.log(), job.diagnosis(info)


def test_a_config_that_does_not_fit_the_job_fails_before_launching(cluster, tmp_path):
    job = Job(cluster, "misfit", tmp_path, [], NPROC="1")
    info = job.wait(timeout=120)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", job.diagnosis(info)
    assert "parallel.world_size=2 in the config, but this job has 1 node(s) x 1 process(es)" \
        in job.log(), job.diagnosis(info)
    assert "rendezvous" not in job.log(), job.diagnosis(info)


def test_watchdog_ends_a_job_without_progress(cluster, tmp_path):
    """No heartbeat within WATCHDOG_S (2 s: the ranks are still importing): the job step is
    killed, the job fails loudly with 124 and leaves no process behind."""
    job = Job(cluster, "stalled", tmp_path, [], WATCHDOG_S="2")
    info = job.wait(timeout=120)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "124:0", job.diagnosis(info)
    assert "WATCHDOG: no heartbeat" in job.log(), job.diagnosis(info)
    deadline = time.monotonic() + 30
    while _job_processes(job.id) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _job_processes(job.id), f"processes of job {job.id} survived it"


def test_ablation_array_runs_each_study_by_index(cluster, tmp_path):
    env = {**cluster.env, "PYTHON": sys.executable, "RESULTS": str(tmp_path / "results"),
           "ABLATION_ARGS": "--dry-run"}
    array = cluster.sbatch(["--array=1,7", "--output", str(tmp_path / "ablation-%A_%a.out"),
                            str(SLURM_DIR / "ablations.sbatch")], env=env, cwd=ROOT)
    for index in (1, 7):
        study = next((ROOT / "scripts" / "ablations").glob(f"0{index}_*.py")).name
        info = cluster.wait(f"{array}_{index}", timeout=120)
        out = tmp_path / f"ablation-{array}_{index}.out"
        log = out.read_text() if out.exists() else "(no output)"
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{log}"
        assert f"array task {index} " in log and study in log and "finished" in log, log
