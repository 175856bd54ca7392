"""The paired BubbleSpec on/off benchmark on configs/tiny.yaml (3 steps, 2 gloo ranks): same tokens,
fewer decode steps from the second step on, finite ratios, and bench.json / bench.md / bench.png."""

import argparse
import json
import math
from pathlib import Path

import pytest

from megatron_bubblespec.loop.bench import add_bench_parser, bench, compare, token_mismatch

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"

RATIOS = ("decode_steps_ratio", "rollout_time_ratio", "throughput_ratio",
          "throughput_ratio_with_verify", "verify_overhead_frac", "bubble_ratio_off",
          "bubble_utilization", "accepted_prefix_mean", "accept_rate", "draft_len_mean",
          "draft_coverage", "accepted_coverage")
KEYS = RATIOS + ("token_mismatch", "token_mismatch_samples", "lr", "policy_drift_kl_mean",
                 "machine", "config", "overrides", "series")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    bench(TINY, out, ["run.steps=3", "logging.progress=false", "logging.plot=false",
                      "logging.tensorboard=false"])
    return out, json.loads((out / "bench.json").read_text())


def test_bench_json_has_the_paired_numbers(result):
    out, r = result
    assert set(KEYS) <= set(r)
    assert r["token_mismatch"] == 0 and r["token_mismatch_samples"] == 0
    for key in RATIOS:
        assert r[key] is not None and math.isfinite(r[key]) and r[key] > 0, key
    assert r["decode_steps_ratio"] < 1  # drafts save decode steps from the second step on
    assert r["throughput_ratio"] == pytest.approx(1 / r["rollout_time_ratio"])
    assert r["throughput_ratio_with_verify"] <= r["throughput_ratio"]
    assert r["lr"] > 0 and math.isfinite(r["policy_drift_kl_mean"])
    assert r["machine"]["cpu_count"] >= 1 and r["machine"]["torch"] and r["machine"]["date"]
    assert r["config"] == str(TINY) and "run.steps=3" in r["overrides"]
    for mode in ("on", "off"):
        assert [s["step"] for s in r["series"][mode]] == [0, 1, 2]
        assert (out / f"tiny-{mode}" / "metrics.jsonl").is_file()


def test_bench_writes_markdown_and_plot(result):
    out, r = result
    md = (out / "bench.md").read_text()
    assert "decode steps on / off" in md and "token mismatch" in md and "## Per step" in md
    assert md.count("\n| 2 |") == 1  # one per-step row per step
    assert "bench_decode.png" in md
    for name in ("bench.png", "bench_decode.png"):
        png = out / name
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_token_mismatch_counts_positions_lengths_and_missing_samples():
    same = [{0: [1, 2, 3], 1: [4]}]
    assert token_mismatch(same, same) == (0, 0)
    assert token_mismatch([{0: [1, 2, 3], 1: [4]}], [{0: [1, 9, 3, 5], 1: [4]}]) == (2, 1)
    assert token_mismatch([{0: [1], 1: [2, 3]}], [{0: [1]}]) == (2, 1)
    assert token_mismatch([{0: [1]}, {0: [2]}], [{0: [1]}]) == (1, 1)


def test_ratios_start_at_step_one_and_are_nan_without_data():
    on = [{"step": 0, "rollout/decode_steps": 100, "rollout/time_s": 9.0},
          {"step": 1, "rollout/decode_steps": 60, "rollout/time_s": 2.0, "spec/verify_s": 0.5}]
    off = [{"step": 0, "rollout/decode_steps": 100, "rollout/time_s": 1.0},
           {"step": 1, "rollout/decode_steps": 80, "rollout/time_s": 3.0}]
    r = compare(on, off)
    assert r["decode_steps_ratio"] == pytest.approx(0.75)
    assert r["throughput_ratio"] == pytest.approx(1.5)
    assert r["throughput_ratio_with_verify"] == pytest.approx(3.0 / 2.5)
    assert r["verify_overhead_frac"] == pytest.approx(0.25)
    assert math.isnan(compare(on[:1], off[:1])["decode_steps_ratio"])


def test_bench_parser_wiring():
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "--config", "c.yaml", "--out", "o", "run.steps=2"])
    assert (args.config, args.out, args.overrides) == ("c.yaml", "o", ["run.steps=2"])
    assert args.func.__name__ == "cmd_bench"


def test_draft_length_coverage_and_utilization_of_drafting_bubbles():
    on = [{"step": 0, "rollout/tokens": 50, "bubble/idle_s": 4.0, "bubble/drafting_s": 3.0,
           "rollout/time_s": 5.0},
          {"step": 1, "rollout/tokens": 100, "spec/drafted_tokens": 60, "spec/drafted_samples": 3,
           "spec/accepted_tokens": 30, "spec/continuation_accepted_tokens": 20,
           "bubble/idle_s": 6.0, "bubble/drafting_s": 0.0, "rollout/time_s": 5.0}]
    r = compare(on, on)
    assert r["draft_len_mean"] == pytest.approx(20.0)
    assert r["draft_coverage"] == pytest.approx(0.6)
    assert r["accepted_coverage"] == pytest.approx(0.5)
    assert r["bubble_utilization"] == pytest.approx(0.75)  # the last step's bubble cannot draft
    assert r["accept_per_token"] == pytest.approx(30 / 33)
    assert r["decode_steps_ratio_ceiling"] == pytest.approx(1 - 30 / 33 * 0.6)
    assert r["decode_steps_ratio_ceiling_full_coverage"] == pytest.approx(1 - 30 / 33)
