"""Engine micro-benchmark: both engines on the tiny model -> a JSON report of the documented schema.

Tiny sizes (batch 1 and 2, prompt 8, 8 new tokens, one timed run): every number positive, one
prefill step and new_tokens - 1 decode steps per request, the report survives a JSON round trip,
and the CLI wiring parses its options.
"""

from __future__ import annotations

import argparse
import json
import os

import pytest

pytest.importorskip("vllm")

from megatron_bubblespec.rollout.bench import (  # noqa: E402
    SCHEMA_VERSION,
    _vllm_cpu_threads,
    add_bench_engine_parser,
    bench_engine,
    render_table,
    write_report,
)

pytestmark = pytest.mark.slow

BATCH_SIZES = [1, 2]
PROMPT_LEN = 8
NEW_TOKENS = 8

ROW_POSITIVE = ("prefill_s", "prefill_tokens_per_s", "decode_step_median_s", "decode_step_p90_s",
                "decode_step_mean_s", "decode_step_min_s", "total_s", "tokens_per_s")


@pytest.fixture(scope="module")
def report():
    return bench_engine("both", "tiny", BATCH_SIZES, PROMPT_LEN, NEW_TOKENS, 1.0, 1)


def test_top_level_schema(report, tmp_path):
    assert report["version"] == SCHEMA_VERSION
    machine = report["machine"]
    assert machine["cpu_count"] >= 1 and machine["torch"] and machine["torch_threads"] >= 1
    assert len(machine["loadavg_1_5_15"]) == 3 and len(machine["loadavg_1_5_15_end"]) == 3
    model = report["model"]
    assert model["name"] == "tiny-llama" and model["params"] > 0 and model["vocab_size"] == 256
    settings = report["settings"]
    assert settings["batch_sizes"] == BATCH_SIZES and settings["new_tokens"] == NEW_TOKENS
    assert settings["prompt_len"] == PROMPT_LEN and settings["dtype"] == "float32"
    assert set(report["engines"]) == {"reference", "vllm"}
    for info in report["engines"].values():
        assert info["dtype"] == "float32" and info["init_s"] > 0 and info["torch_threads"] >= 1
    path = write_report(report, tmp_path / "bench" / "engine.json")
    assert json.loads(path.read_text()) == report


def test_rows(report):
    rows = report["rows"]
    assert [(r["engine"], r["batch_size"]) for r in rows] == [
        (engine, b) for engine in ("reference", "vllm") for b in BATCH_SIZES]
    for row in rows:
        for name in ROW_POSITIVE:
            assert row[name] > 0, (row["engine"], row["batch_size"], name)
        assert row["decode_step_p90_s"] >= row["decode_step_median_s"] >= row["decode_step_min_s"]
        assert row["decode_steps"] == NEW_TOKENS - 1
        assert row["prefill_engine_steps"] == 1 and row["engine_steps"] == NEW_TOKENS
        assert row["generated_tokens"] == row["batch_size"] * NEW_TOKENS
        assert row["prefill_tokens"] == row["batch_size"] * PROMPT_LEN
        assert row["decode_step_samples"] == row["repeats"] * (NEW_TOKENS - 1)
        assert row["tokens_per_s"] == pytest.approx(row["generated_tokens"] / row["total_s"])
        (run,) = row["runs"]
        assert len(run["decode_step_s"]) == NEW_TOKENS - 1 and min(run["decode_step_s"]) > 0
        assert run["total_s"] >= run["prefill_s"] + sum(run["decode_step_s"])


def test_table_renders(report):
    from rich.console import Console

    console = Console(record=True, width=120)
    render_table(report, console)
    text = console.export_text()
    assert "tiny-llama" in text and "reference" in text and "vllm" in text


def test_cli_wiring():
    parser = argparse.ArgumentParser(prog="bubblespec")
    add_bench_engine_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench-engine", "--engine", "vllm", "--model", "smollm2",
                              "--batch-sizes", "1,4,8", "--prompt-len", "64", "--new-tokens",
                              "32", "--temperature", "0.7", "--repeats", "2", "--out", "x.json"])
    assert (args.engine, args.model, args.batch_sizes, args.prompt_len, args.new_tokens,
            args.temperature, args.repeats, args.out) == (
        "vllm", "smollm2", [1, 4, 8], 64, 32, 0.7, 2, "x.json")
    assert args.func.__name__ == "cmd_bench_engine"
    defaults = parser.parse_args(["bench-engine"])
    assert defaults.engine == "both" and defaults.batch_sizes == [1, 2, 4, 8]
    with pytest.raises(SystemExit):
        parser.parse_args(["bench-engine", "--batch-sizes", "1,0"])
    with pytest.raises(SystemExit):
        parser.parse_args(["bench-engine", "--engine", "sglang"])


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="engine"):
        bench_engine("sglang", "tiny", [1], 4, 4, 1.0, 1)
    with pytest.raises(ValueError, match="new_tokens"):
        bench_engine("reference", "tiny", [1], 4, 1, 1.0, 1)


def test_vllm_cpu_binding_follows_threads(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    with _vllm_cpu_threads(2) as bind:
        assert bind == "0-1" == os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    with _vllm_cpu_threads(None) as bind:
        assert bind is None
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    with _vllm_cpu_threads(1) as bind:
        assert bind == "nobind"
