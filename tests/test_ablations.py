"""The ablation scripts end to end: study 6 (speculative continuation) on configs/tiny.yaml with a
one-point grid (one source set) and 2 steps, in a subprocess as a user runs it -> results.json,
table.md with the learning-rate and drift columns, plot.png, and no token mismatch against the
plain run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "ablations" / "06_continuation.py"


@pytest.mark.slow
def test_continuation_study_writes_table_plot_and_results(tmp_path):
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--config", "configs/tiny.yaml",
                           "--out", str(tmp_path), "--steps", "2", "--continuation", "", "--sources", "bubble+siblings"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "06_continuation"
    for name in ("results.json", "table.md", "plot.png"):
        assert (out / name).is_file(), name
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    result = json.loads((out / "results.json").read_text())
    assert not result["failed"]
    [run] = result["runs"]
    assert run["overrides"] == ["spec.speculative_continuation=true",
                                "spec.proposal_sources=[bubble,siblings]"]
    assert run["token_mismatch"] == 0 and run["token_mismatch_samples"] == 0
    assert run["lr"] > 0 and run["policy_drift_kl_mean"] is not None
    assert [r["step"] for r in run["series"]["on"]] == [0, 1]
    assert run["drafted_tokens"] > 0  # step 1 verified drafts made in step 0's bubble

    header = (out / "table.md").read_text().split("\n| variant |")[1].split("\n")[0]
    columns = [c.strip() for c in header.split("|")]
    assert {"lr", "drift KL", "token mismatch", "accept rate"} <= set(columns)


def test_continuation_study_refuses_an_unknown_source_before_any_run(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--config", "configs/tiny.yaml",
                           "--out", str(tmp_path), "--sources", "self+elsewhere"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--sources self+elsewhere: unknown ['elsewhere']" in proc.stderr
    assert not (tmp_path / "06_continuation").exists()
