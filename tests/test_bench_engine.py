"""Engine micro-benchmark: the engines on the tiny model -> a JSON report of the documented schema.

Tiny sizes (batch 1 and 2, prompt 8, 8 new tokens, one timed run): every number positive, one
prefill step and new_tokens - 1 decode steps per request, the report survives a JSON round trip,
and the CLI wiring parses its options. The keyed vLLM engine against ``plain`` (vLLM's own sampler):
both generate exactly the requested tokens on the same prompts, and the report compares them.
"""

from __future__ import annotations

import argparse
import json
import os

import pytest

pytest.importorskip("vllm")

from megatron_bubblespec.measure.engine_bench import (  # noqa: E402
    SCHEMA_VERSION,
    TINY_CONFIG,
    _vllm_cpu_threads,
    add_bench_engine_parser,
    bench_engine,
    engine_names,
    render_table,
    start_engine,
    write_report,
)
from megatron_bubblespec.measure.engine_timing import prompt_plan, time_run  # noqa: E402
from megatron_bubblespec.sampling import SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow

BATCH_SIZES = [1, 2]
PROMPT_LEN = 8
NEW_TOKENS = 8

ROW_POSITIVE = ("prefill_s", "prefill_tokens_per_s", "decode_step_median_s", "decode_step_p90_s",
                "decode_step_mean_s", "decode_step_min_s", "total_s", "tokens_per_s", "cpu_s",
                "tokens_per_cpu_s")


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


@pytest.fixture(scope="module")
def keyed_vs_plain():
    # at top-p, where plain vLLM's sampler sorts each row and the keyed draw scans
    return bench_engine("vllm,plain", "tiny", BATCH_SIZES, PROMPT_LEN, NEW_TOKENS, 1.0, 2,
                        top_p=0.9)


def test_plain_generates_exactly_the_requested_tokens(tiny_checkpoint):
    path = tiny_checkpoint("llama", seed=0, **TINY_CONFIG)
    engine = start_engine("plain", path, 64)
    assert not engine.keyed
    prompts = [[5, 6, 7], [9] * 11, list(range(3, 40))]
    for new_tokens, params in ((13, SamplingParams(1.0)), (5, SamplingParams(0.7, top_p=0.9)),
                               (2, SamplingParams(0.0))):
        run = time_run(engine, prompts, new_tokens, params, seed=0, tag=f"p{new_tokens}")
        assert run["generated_tokens"] == len(prompts) * new_tokens
        assert run["decode_steps"] == new_tokens - 1 and run["prefill_steps"] == 1
        assert run["prompt_tokens"] == sum(map(len, prompts))


def test_keyed_vs_plain_rows_and_comparison(keyed_vs_plain):
    rows = keyed_vs_plain["rows"]
    assert [(r["engine"], r["batch_size"]) for r in rows] == [
        (engine, b) for engine in ("vllm", "plain") for b in BATCH_SIZES]
    assert set(keyed_vs_plain["engines"]) == {"vllm", "plain"}
    assert keyed_vs_plain["settings"]["top_p"] == 0.9
    draw = keyed_vs_plain["engines"]["vllm"]["keyed_draw"]
    assert draw == "c++" or draw.startswith("torch (")
    assert keyed_vs_plain["engines"]["plain"]["keyed_draw"] is None
    for row in rows:
        assert row["generated_tokens"] == row["batch_size"] * NEW_TOKENS
        assert row["decode_steps"] == NEW_TOKENS - 1 and len(row["runs"]) == 2
        assert len(row["loadavg_1_5_15"]) == 3
    by = {(r["engine"], r["batch_size"]): r for r in rows}
    comparison = keyed_vs_plain["comparison"]
    assert [c["batch_size"] for c in comparison] == BATCH_SIZES
    for c in comparison:
        keyed, plain = by["vllm", c["batch_size"]], by["plain", c["batch_size"]]
        assert c["keyed_over_plain"] == pytest.approx(keyed["tokens_per_s"] / plain["tokens_per_s"])
        paired = sorted(p["total_s"] / k["total_s"] for k, p in zip(keyed["runs"], plain["runs"]))
        assert c["paired_run_ratio_median"] == pytest.approx(sum(paired) / 2)
        assert c["keyed_over_plain_cpu"] == pytest.approx(
            keyed["tokens_per_cpu_s"] / plain["tokens_per_cpu_s"])
        # the same prompts went to both engines
        assert [r["prompt_tokens"] for r in keyed["runs"]] == [r["prompt_tokens"] for r in plain["runs"]]
    from rich.console import Console

    console = Console(record=True, width=160)
    render_table(keyed_vs_plain, console)
    text = console.export_text()
    assert "plain" in text and "keyed/" in text and "top-p 0.9" in text
    assert f"{comparison[0]['keyed_over_plain']:.3f}" in text


def test_report_without_plain_has_no_comparison(report):
    assert report["comparison"] == []


def test_engine_names():
    assert engine_names("both") == ["reference", "vllm"]
    assert engine_names("plain,vllm") == ["vllm", "plain"]
    for bad in ("sglang", "vllm,vllm", "vllm,", ""):
        with pytest.raises(ValueError, match="engine"):
            engine_names(bad)


def test_prompt_plans():
    plan = prompt_plan("random", "tiny", None, 256, [1, 3], 5, 2, seed=0)
    assert [len(runs) for runs in plan.values()] == [3, 3]
    assert all(len(p) == 5 and min(p) >= 3 for runs in plan.values() for run in runs for p in run)
    assert plan[3][1] != plan[3][2]            # fresh prompts per run
    with pytest.raises(ValueError, match="tokenizer"):
        prompt_plan("gsm8k", "tiny", None, 256, [1], 5, 1, seed=0)
    with pytest.raises(ValueError, match="prompts"):
        prompt_plan("books", "tiny", None, 256, [1], 5, 1, seed=0)


def test_gsm8k_prompts_are_chat_template_questions_none_twice():
    from megatron_bubblespec.models.smollm2 import load_tokenizer, smollm2_checkpoint

    plan = prompt_plan("gsm8k", "smollm2", smollm2_checkpoint(), 49152, [2, 3], 0, 1, seed=0)
    prompts = [tuple(p) for runs in plan.values() for run in runs for p in run]
    assert len(prompts) == 2 * 2 + 2 * 3 == len(set(prompts))
    tokenizer = load_tokenizer().tokenizer
    for prompt in prompts:
        text = tokenizer.decode(list(prompt))
        assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
        assert len(prompt) > 30


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
    assert defaults.prompts == "random"
    pair = parser.parse_args(["bench-engine", "--engine", "vllm,plain", "--prompts", "gsm8k"])
    assert (pair.engine, pair.prompts) == ("vllm,plain", "gsm8k")
    with pytest.raises(SystemExit):
        parser.parse_args(["bench-engine", "--prompts", "books"])
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
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with _vllm_cpu_threads(2) as bind:
        assert bind == "0-1" == os.environ["VLLM_CPU_OMP_THREADS_BIND"]
        assert os.environ["OMP_NUM_THREADS"] == "2"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ and "OMP_NUM_THREADS" not in os.environ
    with _vllm_cpu_threads(None) as bind:
        assert bind is None
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    with _vllm_cpu_threads(1) as bind:
        assert bind == "nobind"
