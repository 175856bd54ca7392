"""The ablation scripts end to end: study 6 (speculative continuation) on configs/tiny.yaml with a
one-point grid (one source set) and 4 steps, in a subprocess as a user runs it -> results.json,
table.md with the learning-rate and drift columns, plot.png, no token mismatch against the plain
run, and each run's console in its own log; then study 2 (one draft-order variant) under the same
--out reuses that plain run, and a resumed study 6 stopped part-way keeps the run it had; a
SIGTERM to a study checkpoints the run it is running and stops the study."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "ablations" / "06_continuation.py"
BUDGET = ROOT / "scripts" / "ablations" / "02_draft_budget.py"
ENV = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@pytest.mark.slow
def test_continuation_study_writes_table_plot_and_results(tmp_path, monkeypatch, capsys):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--config", "configs/tiny.yaml",
                           "--out", str(tmp_path), "--steps", "4", "--continuation", "",
                           "--sources", "bubble+siblings"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "06_continuation"
    for name in ("results.json", "table.md", "plot.png"):
        assert (out / name).is_file(), name
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    result = json.loads((out / "results.json").read_text())
    assert not result["failed"]
    [run] = result["runs"]
    assert run["overrides"] == ["ablation.speculative_continuation=true",
                                "spec.proposal_sources=[bubble,siblings]"]
    assert run["token_mismatch"] == 0 and run["token_mismatch_samples"] == 0
    assert run["lr"] > 0 and run["policy_drift_kl_mean"] is not None
    assert [r["step"] for r in run["series"]["on"]] == [0, 1, 2, 3]
    assert run["drafted_tokens"] > 0  # step 1 verified drafts made in step 0's bubble

    header = (out / "table.md").read_text().split("\n| variant |")[1].split("\n")[0]
    columns = [c.strip() for c in header.split("|")]
    assert {"lr", "drift KL", "token mismatch", "accept rate", "decode steps on/off, steady",
            "continuation accepted / proposed by source"} <= set(columns)
    # tiny.yaml's bubbles draft steps t+1 and t+2: the steady state is step 3 on
    steady, (on3,), (off3,) = run["steady_state"], run["series"]["on"][3:], run["series"]["off"][3:]
    assert run["steady_from"] == 3 and steady["steps_compared"] == 1
    assert steady["decode_steps_ratio"] == pytest.approx(
        on3["rollout/decode_steps"] / off3["rollout/decode_steps"])

    # Each run's console log is its own (the ranks of every run after the first once wrote to
    # the first run's log: they start from a fork server, with the files it started with).
    for mine, other in ((run["run_on"], run["run_off"]), (run["run_off"], run["run_on"])):
        log = Path(f"{mine}.log").read_text()
        assert f"run directory: {mine} " in log and f"run directory: {other} " not in log

    # Another study of the same seed and steps finds that plain run and runs only its on run.
    proc = subprocess.run([sys.executable, str(BUDGET), "--config", "configs/tiny.yaml",
                           "--out", str(tmp_path), "--steps", "4", "--max-draft-tokens", "",
                           "--draft-chunk", "", "--draft-horizon", "",
                           "--draft-order", "stragglers"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"off run: reusing {run['run_off']}" in proc.stdout
    budget = json.loads((tmp_path / "02_draft_budget" / "results.json").read_text())
    [order] = budget["runs"]
    assert order["run_off"] == run["run_off"] and order["wall_off_s"] == run["wall_off_s"]
    assert "ablation.draft_order=stragglers" in order["overrides"]
    assert order["token_mismatch"] == 0
    assert not list((tmp_path / "02_draft_budget" / "runs").glob("off-*"))

    # A resumed study stopped part-way (here: one new variant fails, the next is interrupted
    # before the kept one is reached) still lists the kept run in its results.json.
    monkeypatch.syspath_prepend(str(ROOT / "scripts" / "ablations"))
    import runner

    def attempt(config, overrides, runs_dir, name):
        if "spec.proposal_sources=[self]" in overrides or "run.steps=5" in overrides:
            raise runner.RunFailed(name, "stopped by the test", "")
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "_attempt", attempt)
    args = runner.parser("").parse_args(["--config", str(ROOT / "configs" / "tiny.yaml"),
                                         "--out", str(tmp_path), "--steps", "4", "--resume"])
    runner.learning_defaults(args)
    variants = [runner.Variant(label, ["ablation.speculative_continuation=true",
                                       f"spec.proposal_sources=[{sources}]"])
                for label, sources in (("continuation from self", "self"),
                                       ("continuation from prompt", "prompt"),
                                       ("continuation from bubble+siblings", "bubble,siblings"))]
    with pytest.raises(KeyboardInterrupt):
        runner.run_study("06_continuation", args, variants)
    resumed = json.loads((out / "results.json").read_text())
    assert [r["label"] for r in resumed["runs"]] == ["continuation from bubble+siblings"]
    assert resumed["runs"][0]["run_on"] == run["run_on"]
    assert [f["label"] for f in resumed["failed"]] == ["continuation from self"]

    # Resumed with another grid (another --seeds list, say), the kept run outside it stays in
    # results.json, after this grid's; resumed with another --steps, no run is kept.
    runner.run_study("06_continuation", args, variants[:1])
    widened = json.loads((out / "results.json").read_text())
    assert [r["label"] for r in widened["runs"]] == ["continuation from bubble+siblings"]
    assert widened["runs"][0]["steady_state"]["decode_steps_ratio"] == pytest.approx(
        run["steady_state"]["decode_steps_ratio"])
    assert "continuation from bubble+siblings: kept from the previous run of the study (not in " \
           "this grid)" in capsys.readouterr().out
    args.steps = 5
    with pytest.raises(SystemExit, match="every run failed"):
        runner.run_study("06_continuation", args, variants[:1])
    assert "none of its runs is kept" in capsys.readouterr().out
    assert json.loads((out / "results.json").read_text())["runs"] == []


def test_an_off_run_of_another_seed_is_not_reused(tmp_path, monkeypatch):
    """``runner.reusable_off_run`` compares the whole run config: a finished plain run of seed 1
    does not stand in for seed 2's, nor a BubbleSpec-on run for a plain one."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts" / "ablations"))
    import runner
    from megatron_bubblespec.config import load_config
    from megatron_bubblespec.config.load import to_yaml

    tiny = str(ROOT / "configs" / "tiny.yaml")
    runs = tmp_path / "study" / "runs"
    for name, overrides in (("off-seed1", ["run.seed=1", "spec.enabled=false"]),
                            ("on-seed2", ["run.seed=2", "spec.enabled=true"])):
        (runs / name).mkdir(parents=True)
        cfg = load_config(tiny, [*overrides, "run.steps=1", f"run.output_dir={runs}",
                                 f"run.name={name}"])
        (runs / name / "config.yaml").write_text(to_yaml(cfg))
        (runs / name / "metrics.jsonl").write_text(json.dumps({"step": 0}) + "\n")
        (runs / name / "rollouts.jsonl").write_text(json.dumps({"step": 0, "responses": {}}) + "\n")
    (runs / "off-seed1.timing.json").write_text(json.dumps(
        {"wall_s": 12.5, "loadavg_before": [1, 1, 1], "loadavg_after": [2, 2, 2]}))
    found = runner.reusable_off_run(tmp_path, tiny,
                                    ["run.seed=1", "run.steps=1", "spec.enabled=false"])
    assert found is not None and found["dir"] == str(runs / "off-seed1")
    assert found["wall_s"] == 12.5 and [r["step"] for r in found["records"]] == [0]
    assert runner.reusable_off_run(tmp_path, tiny,
                                   ["run.seed=2", "run.steps=1", "spec.enabled=false"]) is None


@pytest.mark.slow   # starts a process
def test_continuation_study_refuses_an_unknown_source_before_any_run(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--config", "configs/tiny.yaml",
                           "--out", str(tmp_path), "--sources", "self+elsewhere"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--sources self+elsewhere: unknown ['elsewhere']" in proc.stderr
    assert not (tmp_path / "06_continuation").exists()


@pytest.mark.slow
def test_a_signal_to_the_study_checkpoints_its_run_and_stops_the_study(tmp_path):
    """SIGTERM to a study (a preempted job) reaches the run it is running: the run finishes its
    step, checkpoints and exits 75, and the study stops at once with a message that names
    --resume, rather than going on to the next run or waiting out the run."""
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--config", "configs/tiny.yaml",
                             "--out", str(tmp_path), "--steps", "40", "--continuation", "",
                             "--sources", "self"],
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    runs = tmp_path / "06_continuation" / "runs"
    try:
        deadline = time.monotonic() + 240
        while not any(m.stat().st_size for m in runs.glob("off-*/metrics.jsonl")):
            assert proc.poll() is None and time.monotonic() < deadline, "no step was recorded"
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, stdout[-3000:] + stderr[-3000:]
    [run] = runs.glob("off-*/metrics.jsonl")
    assert f"{run.parent.name}: stopped by a signal (exit code 75;" in stderr
    assert "rerun the study with --resume" in stderr
    steps = [json.loads(line)["step"] for line in run.read_text().splitlines()]
    assert 1 <= len(steps) < 40
    assert (run.parent / "checkpoints" / f"step_{len(steps)}" / "COMPLETE").is_file()
    assert not list(runs.glob("on-*"))  # the study did not go on to the next run
