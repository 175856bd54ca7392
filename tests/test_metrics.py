"""Metrics.

* Aggregation of per-rank dicts: every sum / max / mean rule and every derived ratio, checked
  against hand computations; per-rank bubble keys; the errors a caller can hit.
* JSONL round trip (NaN, inf, None, ints, 0-d tensors) and the TensorBoard event file.
* Summary: value formatting, the table's columns and whole-run row, the 4-panel PNG (with and
  without drafts).
* Progress: one plain line per step off a terminal; the live bar on one.
"""

from __future__ import annotations

import ast
import io
import json
import math
import random
import re
from pathlib import Path

import pytest
import torch
from rich.console import Console

from megatron_bubblespec.metrics import (
    MetricsWriter,
    RunProgress,
    aggregate_step,
    decode_steps_plain,
    json_safe,
    plot_run,
    print_summary,
    read_metrics,
    run_totals,
    summary_table,
    to_json,
)
from megatron_bubblespec.metrics.formatting import count, number, percent, scientific, seconds
from megatron_bubblespec.metrics.plots import plot_decode_breakdown
from megatron_bubblespec.metrics.reduce import bubble_utilization
from megatron_bubblespec.metrics.registry import DERIVED, METRICS, PART, REPORTED, SOURCE, lookup

# Three ranks of one step: rank 1 is the straggler (12 s), rank 2 drafted nothing it could use.
RANKS = [
    {"rollout/time_s": 10.0, "rollout/decode_steps": 100, "rollout/decode_steps_plain": 150,
     "rollout/tokens": 160, "rollout/max_response_len": 40,
     "bubble/idle_s": 2.0, "bubble/drafting_s": 1.5, "bubble/overshoot_s": 0.1,
     "bubble/draftable_s": 2.0, "bubble/engine_steps": 12, "bubble/new_tokens": 40, "bubble/refreshed_drafts": 1,
     "bubble/prefill_tokens": 900,
     "spec/drafted_samples": 4, "spec/drafted_tokens": 80, "spec/accepted_tokens": 50,
     "spec/drafted_tokens_in_response": 70,
     "spec/accepted_prefix_mean": 10.0, "spec/verify_s": 0.5,
     "rollout/engine_steps": 40, "spec/continuation_proposed_tokens": 12,
     "spec/continuation_accepted_tokens": 9,
     "sync/reshard_s": 1.0, "sync/reshard_bytes": 1000, "sync/logprob_abs_diff": 0.01,
     "train/loss": 0.5, "train/reward_mean": 0.25, "train/accuracy": 0.0,
     "train/reward/correct": 0.0, "train/reward/format": 0.25,
     "train/reward_timeouts": 0, "train/reward_s": 1.5, "train/kl": 0.01, "train/grad_norm": 1.0,
     "train/lr": 1e-6, "policy/drift_kl": 0.002, "exact/weight_version": 3,
     "spec/proposal_token_cost": 0.2, "memory/rss_peak_gb": 2.5,
     "policy/draft_kl_half_step": 0.001, "policy/draft_kl_full_step": 0.003},
    {"rollout/time_s": 12.0, "rollout/decode_steps": 120, "rollout/decode_steps_plain": 200,
     "rollout/tokens": 210, "rollout/max_response_len": 64,
     "bubble/idle_s": 0.0, "bubble/drafting_s": 0.0, "bubble/overshoot_s": 0.0,
     "bubble/draftable_s": 0.0, "bubble/engine_steps": 0, "bubble/new_tokens": 0, "bubble/refreshed_drafts": 0,
     "bubble/prefill_tokens": 0,
     "spec/drafted_samples": 6, "spec/drafted_tokens": 120, "spec/accepted_tokens": 30,
     "spec/drafted_tokens_in_response": 120,
     "spec/accepted_prefix_mean": 5.0, "spec/verify_s": 0.7,
     "rollout/engine_steps": 64, "spec/continuation_proposed_tokens": 8,
     "spec/continuation_accepted_tokens": 2,
     "sync/reshard_s": 1.2, "sync/reshard_bytes": 1000, "sync/logprob_abs_diff": 0.02,
     "train/loss": 0.7, "train/reward_mean": 0.75, "train/accuracy": 0.5,
     "train/reward/correct": 0.5, "train/reward/format": 0.25,
     "train/reward_timeouts": 1, "train/reward_s": 2.5, "train/kl": 0.03, "train/grad_norm": 1.0,
     "train/lr": 1e-6, "policy/drift_kl": 0.004, "exact/weight_version": 3,
     "spec/proposal_token_cost": 0.4, "memory/rss_peak_gb": 2.75},
    {"rollout/time_s": 9.0, "rollout/decode_steps": 90, "rollout/decode_steps_plain": 90,
     "rollout/tokens": 100, "rollout/max_response_len": 30,
     "bubble/idle_s": 3.0, "bubble/drafting_s": 3.0, "bubble/overshoot_s": 0.2,
     "bubble/draftable_s": 3.0, "bubble/engine_steps": 20, "bubble/new_tokens": 70, "bubble/refreshed_drafts": 2,
     "bubble/prefill_tokens": 300,
     "spec/drafted_samples": 0, "spec/drafted_tokens": 0, "spec/accepted_tokens": 0,
     "spec/drafted_tokens_in_response": 0,
     "spec/accepted_prefix_mean": None, "spec/verify_s": 0.1,
     "rollout/engine_steps": 30, "spec/continuation_proposed_tokens": 0,
     "spec/continuation_accepted_tokens": 0,
     "sync/reshard_s": 1.1, "sync/reshard_bytes": 1000, "sync/logprob_abs_diff": 0.015,
     "train/loss": 0.6, "train/reward_mean": 0.5, "train/accuracy": 0.25,
     "train/reward/correct": 1.0, "train/reward/format": 0.0,
     "train/reward_timeouts": 0, "train/reward_s": 0.5, "train/kl": 0.02, "train/grad_norm": 1.0,
     "train/lr": 1e-6, "policy/drift_kl": 0.003, "exact/weight_version": 3,
     "memory/rss_peak_gb": 2.25},
]


def close(a, b):
    return a == pytest.approx(b, rel=1e-12, abs=1e-15)


# --- aggregation -------------------------------------------------------------------------------

def test_aggregate_rules_against_hand_computation():
    rec = aggregate_step(7, RANKS)
    assert rec["step"] == 7
    # sums
    assert rec["rollout/decode_steps"] == 100 + 120 + 90
    assert rec["rollout/decode_steps_plain"] == 150 + 200 + 90
    assert rec["rollout/tokens"] == 160 + 210 + 100
    assert rec["spec/drafted_samples"] == 10
    assert rec["spec/drafted_tokens"] == 200
    assert rec["spec/accepted_tokens"] == 80
    assert rec["sync/reshard_bytes"] == 3000
    assert close(rec["bubble/idle_s"], 5.0)
    assert close(rec["bubble/drafting_s"], 4.5)
    assert close(rec["bubble/overshoot_s"], 0.3)
    # maxima
    assert rec["rollout/time_s"] == 12.0
    assert rec["rollout/max_response_len"] == 64
    assert rec["spec/verify_s"] == 0.7
    assert rec["sync/reshard_s"] == 1.2
    assert rec["sync/logprob_abs_diff"] == 0.02
    # means
    assert close(rec["train/loss"], 0.6)
    assert close(rec["train/reward_mean"], 0.5)
    assert close(rec["train/kl"], 0.02)
    assert close(rec["train/grad_norm"], 1.0)
    assert close(rec["train/lr"], 1e-6)
    assert close(rec["policy/drift_kl"], 0.003)
    assert rec["exact/weight_version"] == 3
    # per-sample mean weighted by drafted samples; rank 2 drafted none and reports None
    assert close(rec["spec/accepted_prefix_mean"], (4 * 10.0 + 6 * 5.0) / 10)
    # derived ratios, from the aggregated sums
    assert close(rec["rollout/tokens_per_s"], 470 / 12)
    assert close(rec["bubble/ratio"], 5.0 / (3 * 12.0))
    assert close(rec["bubble/utilization"], 4.5 / 5.0)
    assert close(rec["spec/accept_rate"], 80 / 200)
    assert close(rec["spec/decode_steps_saved_frac"], 1 - 310 / 440)
    # ... which is not the mean of the per-rank ratios
    assert not close(rec["spec/accept_rate"], (50 / 80 + 30 / 120) / 2)


def test_aggregate_keeps_bubble_metrics_per_rank():
    rec = aggregate_step(0, RANKS)
    assert close(rec["rank0/bubble/idle_s"], 2.0)
    assert close(rec["rank0/bubble/drafting_s"], 1.5)
    assert close(rec["rank0/bubble/overshoot_s"], 0.1)
    assert close(rec["rank0/bubble/ratio"], 2.0 / 12.0)
    assert close(rec["rank0/bubble/utilization"], 1.5 / 2.0)
    assert rec["rank1/bubble/ratio"] == 0.0
    assert math.isnan(rec["rank1/bubble/utilization"])  # the straggler had no bubble to use
    assert close(rec["rank2/bubble/ratio"], 3.0 / 12.0)
    assert close(rec["rank2/bubble/utilization"], 1.0)
    assert rec["rank2/bubble/new_tokens"] == 70 and rec["rank0/bubble/prefill_tokens"] == 900
    assert rec["bubble/engine_steps"] == 32 and rec["bubble/new_tokens"] == 110
    assert rec["bubble/refreshed_drafts"] == 3 and rec["rank2/bubble/refreshed_drafts"] == 2
    # the aggregate ratio is the mean of the per-rank ratios (same wall time for all ranks)
    assert close(rec["bubble/ratio"], sum(rec[f"rank{r}/bubble/ratio"] for r in range(3)) / 3)
    assert not any(k.startswith("rank3/") for k in rec)


def test_every_engine_metric_and_every_derived_one_reaches_the_record():
    rec = aggregate_step(0, RANKS)
    expected = {name for name, m in METRICS.items()
                if (m.reduce in REPORTED and not m.family) or m.reduce == DERIVED}
    assert expected <= set(rec), sorted(expected - set(rec))
    assert rec["memory/rss_peak_gb"] == 2.75 and rec["rank2/memory/rss_peak_gb"] == 2.25
    # a reward part is a mean over the engines, the timeouts a sum, the stage's time the longest
    assert close(rec["train/reward/correct"], 0.5) and close(rec["train/reward/format"], 1 / 6)
    assert rec["train/reward_timeouts"] == 1 and rec["train/reward_s"] == 2.5
    # measured per engine at start-up (ablation.measure_proposal_cost); an engine without one is left out
    assert close(rec["spec/proposal_token_cost"], 0.3)
    # measured by the learner (ablation.measure_draft_weights): one rank's, as reported
    assert close(rec["policy/draft_kl_full_step"], 0.003)


def test_continuation_counts_are_kept_per_source_and_unknown_keys_are_refused():
    ranks = [{**RANKS[0], "spec/continuation_proposed_tokens/realign": 3},
             {**RANKS[1], "spec/continuation_proposed_tokens/realign": 4,
              "spec/continuation_accepted_tokens/siblings": 2}, RANKS[2]]
    rec = aggregate_step(0, ranks)
    assert rec["spec/continuation_proposed_tokens/realign"] == 7
    assert rec["spec/continuation_accepted_tokens/siblings"] == 2
    keys = list(rec)   # after the other sums, in key order
    assert keys.index("sync/reshard_bytes") < keys.index(
        "spec/continuation_accepted_tokens/siblings") < keys.index(
        "spec/continuation_proposed_tokens/realign") < keys.index("rollout/time_s")
    with pytest.raises(ValueError, match=r"cannot aggregate \['spec/made_up'\].*registry"):
        aggregate_step(0, [{**RANKS[0], "spec/made_up": 1}])
    with pytest.raises(ValueError, match="computed from the aggregated sums"):
        aggregate_step(0, [{**RANKS[0], "spec/accept_rate": 0.5}])
    with pytest.raises(ValueError, match="cannot aggregate"):   # the trainer's own, not an engine's
        aggregate_step(0, [{**RANKS[0], "train/pg_loss": 0.5}])


# Metric keys look like "<room>/<name>" or "<room>/<name>/<part>", the room one of the registry's.
ROOMS = "|".join(sorted({name.split("/")[0] for name in METRICS}))
KEY_SHAPE = re.compile(rf"^({ROOMS})/[a-z_{{}}]+(/[a-z_{{}}]+)?$")
PRODUCERS = ("loop", "speculative", "train", "rollout")   # the packages that emit step metrics


def _emitted_keys(path) -> set[str]:
    """The metric keys a module's source writes: string constants of the key shape, and
    f-strings of that shape (each placeholder read as ``{x}``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    parts = {id(p) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr)
             for p in node.values}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(p.value if isinstance(p, ast.Constant) else "{x}" for p in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in parts:
            text = node.value
        else:
            continue
        if KEY_SHAPE.match(text):
            found.add(text)
    return found


def _known(key: str) -> bool:
    if "{x}" not in key:
        return lookup(key) is not None
    # f"spec/continuation_{kind}_tokens/{source}", f"train/reward/{part}": every spelling must
    # be a family's
    families = [m for m in METRICS.values() if SOURCE in m.name or PART in m.name]
    pattern = re.compile("^" + re.escape(key).replace(r"\{x\}", "[a-z_]+") + "$")
    return any(pattern.match(m.name.replace(SOURCE, "any").replace(PART, "any"))
               for m in families)


def test_every_metric_the_producers_emit_is_registered():
    root = Path(__file__).resolve().parents[1] / "megatron_bubblespec"
    emitted = {}
    for package in PRODUCERS:
        for path in sorted((root / package).rglob("*.py")):
            for key in _emitted_keys(path):
                emitted.setdefault(key, []).append(str(path.relative_to(root)))
    unknown = {k: where for k, where in sorted(emitted.items()) if not _known(k)}
    assert not unknown, (f"metrics emitted but not declared in megatron_bubblespec/metrics/"
                         f"registry.py (add a Metric for each): {unknown}")
    # the scan sees the producers' keys, literal and per source
    assert {"rollout/time_s", "bubble/idle_s", "train/pg_loss", "sync/reshard_s",
            "spec/continuation_{x}_tokens/{x}"} <= set(emitted)


def test_every_metric_the_readers_name_is_registered():
    """The bench, its reports, the simulator, the plots and the ablation scripts read records by
    key: a misspelt key would read nothing, so every key they name must be declared too."""
    root = Path(__file__).resolve().parents[1]
    named = {}
    for folder in ("megatron_bubblespec/measure", "megatron_bubblespec/metrics", "scripts"):
        for path in sorted((root / folder).rglob("*.py")):
            for key in _emitted_keys(path):
                named.setdefault(key, []).append(str(path.relative_to(root)))
    unknown = {k: where for k, where in sorted(named.items()) if not _known(k)}
    assert not unknown, f"metric keys read but not declared in the registry: {unknown}"
    assert {"rollout/decode_steps", "rollout/engine_steps", "policy/drift_kl"} <= set(named)


def test_the_emitted_key_scan_sees_an_unregistered_metric(tmp_path):
    source = tmp_path / "m.py"
    source.write_text('m = {"rollout/time_s": 1, "rollout/new_thing": 2, f"spec/x_{k}/{s}": 3,\n'
                      '     "path/to/file": 4, f"bubblespec/{x}": 5}\n')
    emitted = _emitted_keys(source)
    assert emitted == {"rollout/time_s", "rollout/new_thing", "spec/x_{x}/{x}"}
    assert [k for k in sorted(emitted) if not _known(k)] == ["rollout/new_thing", "spec/x_{x}/{x}"]


def test_aggregate_without_drafts_reports_no_spec_ratios():
    plain = [{k: v for k, v in r.items() if not k.startswith("spec/")} for r in RANKS]
    rec = aggregate_step(1, plain)
    assert not any(k.startswith("spec/accept") or k.startswith("spec/drafted") for k in rec)
    # decode steps saved is still defined: it compares with the no-draft estimate
    assert close(rec["spec/decode_steps_saved_frac"], 1 - 310 / 440)


def test_zero_denominators_give_nan():
    rec = aggregate_step(0, [{"rollout/time_s": 1.0, "bubble/idle_s": 0.0, "bubble/drafting_s": 0.0,
                              "spec/drafted_tokens": 0, "spec/accepted_tokens": 0,
                              "rollout/decode_steps": 0, "rollout/decode_steps_plain": 0}])
    for key in ("bubble/utilization", "spec/accept_rate", "spec/decode_steps_saved_frac"):
        assert math.isnan(rec[key]), key
    assert rec["bubble/ratio"] == 0.0


def test_decode_steps_plain():
    assert decode_steps_plain([1, 5, 0, 10]) == 0 + 4 + 0 + 9
    assert decode_steps_plain([]) == 0


@pytest.mark.parametrize("ranks, match", [
    ([], "no rank metrics"),
    ([{"exact/weight_version": 3}, {"exact/weight_version": 4}], "disagree on exact/weight"),
    ([{"rollout/tokenz": 3}], "rollout/tokenz"),
    ([{"spec/accept_rate": 0.5}], "computed from the aggregated sums"),
    ([{"spec/accepted_prefix_mean": 2.0}], "must also report spec/drafted_samples"),
])
def test_aggregate_errors(ranks, match):
    with pytest.raises(ValueError, match=match):
        aggregate_step(5, ranks)


# --- writer ------------------------------------------------------------------------------------

def test_jsonl_round_trip_with_nan_and_none(tmp_path):
    records = [
        {"step": 0, "train/loss": 0.25, "rollout/tokens": 12, "spec/accept_rate": math.nan,
         "train/kl": None, "bubble/ratio": torch.tensor(0.5), "train/grad_norm": math.inf},
        {"step": 1, "train/loss": -1.5, "exact/weight_version": 1, "spec/drafted_tokens": True},
    ]
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.write(records[0])
        assert len(read_metrics(tmp_path)) == 1  # flushed per step, readable while running
        writer.write(records[1])
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])  # strict JSON: null, never NaN / Infinity literals
    assert first["spec/accept_rate"] is None and first["train/kl"] is None
    assert first["train/grad_norm"] is None
    back = read_metrics(tmp_path)
    assert back[0]["step"] == 0 and isinstance(back[0]["step"], int)
    assert back[0]["train/loss"] == 0.25
    assert back[0]["rollout/tokens"] == 12 and isinstance(back[0]["rollout/tokens"], int)
    assert back[0]["bubble/ratio"] == 0.5
    for key in ("spec/accept_rate", "train/kl", "train/grad_norm"):
        assert math.isnan(back[0][key]), key
    assert back[1] == {"step": 1, "train/loss": -1.5, "exact/weight_version": 1,
                       "spec/drafted_tokens": 1}
    assert not (tmp_path / "tensorboard").exists()


def test_writer_appends_and_rejects_non_numbers(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.write({"step": 0, "train/loss": 1.0})
        with pytest.raises(TypeError, match="'train/note'"):
            writer.write({"step": 1, "train/note": "hello"})
        with pytest.raises(ValueError, match="integer 'step'"):
            writer.write({"train/loss": 1.0})
    with MetricsWriter(tmp_path, tensorboard=False) as writer:  # a resumed run appends
        writer.write({"step": 1, "train/loss": 0.5})
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        read_metrics(tmp_path / "elsewhere")


def test_tensorboard_event_file(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsWriter(tmp_path) as writer:
        for step in range(3):
            rec = aggregate_step(step, RANKS)
            rec["spec/accept_rate"] = math.nan if step == 1 else rec["spec/accept_rate"]
            writer.write(rec)
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"bubble/ratio", "spec/accept_rate", "rank2/bubble/idle_s"} <= set(tags)
    assert [e.step for e in acc.Scalars("bubble/ratio")] == [0, 1, 2]
    assert [e.step for e in acc.Scalars("spec/accept_rate")] == [0, 2]  # NaN is not logged
    assert acc.Scalars("bubble/ratio")[0].value == pytest.approx(5.0 / 36.0)


# --- summary -----------------------------------------------------------------------------------

def synthetic_run(n_steps: int, drafts: bool = True, seed: int = 0) -> list[dict]:
    """Step records of a 4-rank run with a long-tailed straggler, through aggregate_step."""
    rng = random.Random(seed)
    records = []
    for step in range(n_steps):
        times = [rng.uniform(6, 10) for _ in range(3)] + [rng.uniform(12, 18)]
        wall = max(times)
        ranks = []
        for t in times:
            plain = rng.randint(800, 1200)
            rank = {"rollout/time_s": t, "rollout/tokens": plain + 32,
                    "rollout/decode_steps_plain": plain, "rollout/max_response_len": 256,
                    "bubble/idle_s": wall - t, "bubble/drafting_s": 0.0, "bubble/overshoot_s": 0.0,
                    "train/loss": 0.5 - 0.02 * step + rng.gauss(0, 0.02),
                    "train/reward_mean": min(1.0, 0.2 + 0.05 * step + rng.gauss(0, 0.03)),
                    "policy/drift_kl": 1e-3 * (1 + rng.random()), "exact/weight_version": step}
            if drafts and step > 0:
                drafted = rng.randint(300, 600)
                accepted = int(drafted * rng.uniform(0.4, 0.8))
                rank.update({"bubble/drafting_s": 0.9 * (wall - t),
                             "bubble/overshoot_s": 0.05 if wall > t else 0.0,
                             "spec/drafted_samples": 8, "spec/drafted_tokens": drafted,
                             "spec/accepted_tokens": accepted,
                             "spec/accepted_prefix_mean": accepted / 8, "spec/verify_s": 0.4})
            rank["rollout/decode_steps"] = plain - rank.get("spec/accepted_tokens", 0)
            ranks.append(rank)
        records.append(aggregate_step(step, ranks))
    return records


def test_summary_table_renders_columns_and_totals():
    records = synthetic_run(4)
    console = Console(record=True, width=80, file=io.StringIO())
    print_summary(records, console=console)
    text = console.export_text()
    header = "\n".join(text.splitlines()[1:3])
    for word in ("step", "reward", "loss", "rollout", "decode", "steps", "drafts", "accept", "tok",
                 "rate", "saved", "bubble", "util", "drift", "KL"):
        assert word in header, word
    rows = [line for line in text.splitlines() if "%" in line and line.split()[0].isdigit()]
    assert [int(row.split()[0]) for row in rows] == [r["step"] for r in records]
    totals = run_totals(records)
    all_row = next(line for line in text.splitlines() if line.split()[:1] == ["all"])
    assert f"{100 * totals['spec/accept_rate']:.1f}%" in all_row
    assert f"{round(totals['rollout/decode_steps']):,}" in all_row
    assert close(totals["spec/accept_rate"],
                 sum(r.get("spec/accepted_tokens", 0) for r in records)
                 / sum(r.get("spec/drafted_tokens", 0) for r in records))
    assert summary_table(records).row_count == len(records) + 1


def test_formatting_of_missing_and_non_finite_values():
    assert [f(math.nan) for f in (number, count, percent, seconds, scientific)] == ["-"] * 5
    assert count(math.inf) == "inf" and percent(-math.inf) == "-inf"
    assert number(0.41234) == "0.412" and number(2e-5) == "2.0e-05"
    assert scientific(0.0015) == "1.5e-3" and count(12521.0) == "12,521"
    assert percent(0.2354) == "23.5%" and seconds(3.14159) == "3.14s"


def test_plot_run_writes_a_readable_png(tmp_path):
    records, baseline = synthetic_run(8), synthetic_run(8, drafts=False)
    for r, b in zip(records, baseline):  # the plain run decodes every token
        b["rollout/decode_steps"] = r["rollout/decode_steps_plain"]
    path = plot_run(records, tmp_path / "plots" / "run.png", baseline=baseline)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000


def test_plot_run_without_drafts(tmp_path):
    path = plot_run(synthetic_run(3, drafts=False), tmp_path / "plain.png")
    assert path.stat().st_size > 10_000
    with pytest.raises(ValueError, match="at least one step"):
        plot_run([], tmp_path / "empty.png")


# --- progress ----------------------------------------------------------------------------------

def test_progress_prints_one_line_per_step_off_terminal():
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=80)
    records = synthetic_run(3)
    with RunProgress(len(records), console=console) as progress:
        for r in records:
            progress.update(r["step"], r)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert "\x1b" not in out.getvalue()
    for i, (line, r) in enumerate(zip(lines, records)):
        assert line.startswith(f"training step {r['step']} [{i + 1}/3] | reward ")
        assert f"bubble {100 * r['bubble/ratio']:.1f}%" in line
        assert " | step " in line and line.endswith("s")
    assert "drafts tok - | accept tok -" in lines[0]  # step 0 has no drafts yet
    assert f"drafts tok {records[1]['spec/drafted_tokens']:,}" in lines[1]


def test_progress_live_bar_on_terminal():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    records = synthetic_run(2)
    with RunProgress(2, console=console) as progress:
        for r in records:
            progress.update(r["step"], r)
    text = out.getvalue()
    assert "2/2" in text and "reward" in text and "step 1:" in text
    with pytest.raises(RuntimeError, match="outside its"):
        progress.update(2, records[-1])


def test_to_json_writes_non_finite_numbers_as_null(tmp_path):
    value = {"nan": math.nan, "inf": [math.inf, -math.inf], "tensor": torch.tensor(2.5),
             "nested": ({"x": torch.tensor(float("nan"))},), 3: "three"}
    text = to_json(value)
    assert json.loads(text) == {"nan": None, "inf": [None, None], "tensor": 2.5,
                                "nested": [{"x": None}], "3": "three"}
    (tmp_path / "metrics.jsonl").write_text(to_json({"step": 0, "loss": math.nan}) + "\n")
    assert math.isnan(read_metrics(tmp_path)[0]["loss"])


def test_machine_info_names_the_cpus_and_the_stack():
    from megatron_bubblespec.machine import machine_info

    info = machine_info()
    assert info["cpu_count"] >= info["cpus_usable"] >= 1
    assert info["torch"] == torch.__version__ and json.loads(to_json(info)) == json_safe(info)


def test_engine_steps_and_continuation_counts():
    rec = aggregate_step(0, RANKS)
    assert rec["rollout/engine_steps"] == 64 and rec["rollout/engine_steps_sum"] == 134
    # the step waits for the drafting engine that ran longest past the barrier
    assert rec["bubble/overshoot_wall_s"] == pytest.approx(0.2)
    assert rec["bubble/overshoot_s"] == pytest.approx(0.3)
    assert [rec[f"rank{r}/rollout/engine_steps"] for r in range(3)] == [40, 64, 30]
    assert rec["spec/continuation_proposed_tokens"] == 20
    assert rec["spec/continuation_accept_rate"] == pytest.approx(11 / 20)


def test_an_engines_drafts_count_within_their_responses():
    """spec/drafted_tokens_in_response: a draft that runs on past its response's end counts up
    to the response's length (the bench's drafted share and its ceiling use it)."""
    from megatron_bubblespec.loop.step_metrics import EngineRollout, engine_metrics
    from megatron_bubblespec.sampling.requests import RolloutResult

    results = [RolloutResult(str(i), [7] * n, [0.0] * n, n, "eos") for i, n in enumerate((5, 9, 4))]
    metrics = engine_metrics(EngineRollout(results, 1.0, 9), [8, 3, 0], [5, 3, 0], 0.0, [], {},
                             0, {})
    assert metrics["spec/drafted_tokens"] == 11 and metrics["spec/drafted_tokens_in_response"] == 8
    assert aggregate_step(0, RANKS)["spec/drafted_tokens_in_response"] == 190


def test_utilization_counts_only_bubbles_that_could_draft():
    """At the run's last step a rank waits with nothing to draft (bubble/draftable_s = 0): that
    bubble is left out of the utilization instead of counting as unused."""
    drafting = {"rollout/time_s": 10.0, "bubble/idle_s": 4.0, "bubble/drafting_s": 3.0,
                "bubble/draftable_s": 4.0}
    last = {"rollout/time_s": 10.0, "bubble/idle_s": 5.0, "bubble/drafting_s": 0.0,
            "bubble/draftable_s": 0.0}
    straggler = {"rollout/time_s": 10.0, "bubble/idle_s": 0.0, "bubble/drafting_s": 0.0,
                 "bubble/draftable_s": 0.0}
    rec = aggregate_step(4, [drafting, straggler])
    assert close(rec["bubble/utilization"], 3.0 / 4.0) and close(rec["rank0/bubble/draftable_s"], 4.0)
    final = aggregate_step(5, [last, straggler])
    assert math.isnan(final["bubble/utilization"]) and close(final["bubble/ratio"], 5.0 / 20.0)
    assert close(bubble_utilization([rec, final]), 3.0 / 4.0)
    assert close(run_totals([rec, final])["bubble/utilization"], 3.0 / 4.0)
    # records written before draftable_s existed: the last step's idle time is left out
    old = [{k: v for k, v in r.items() if "draftable" not in k} for r in (rec, final)]
    assert close(bubble_utilization(old), 3.0 / 4.0)


def test_decode_breakdown_plot(tmp_path):
    on = [{"step": s, "rollout/decode_steps": 100 - 20 * s, "spec/accepted_tokens": 10 * s,
           "spec/continuation_accepted_tokens": 5 * s} for s in range(3)]
    off = [{"step": s, "rollout/decode_steps": 100} for s in range(3)]
    png = plot_decode_breakdown(on, tmp_path / "d.png", baseline=off)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError):
        plot_decode_breakdown([], tmp_path / "e.png")


def test_summary_names_the_slowest_engine_of_each_step():
    from io import StringIO

    from rich.console import Console

    from megatron_bubblespec.metrics.summary import print_summary, slowest_engine

    records = [aggregate_step(s, [{"rollout/time_s": t0, "rollout/tokens": 4},
                                  {"rollout/time_s": t1, "rollout/tokens": 4}])
               for s, (t0, t1) in enumerate([(1.0, 3.0), (2.5, 0.5)])]
    assert records[0]["rollout/engines"] == 2
    assert [slowest_engine(r) for r in records] == ["1", "0"]
    out = StringIO()
    print_summary(records, Console(file=out, width=100))
    assert "slowest engine by step (what the step waited for): 0: 1, 1: 0" in out.getvalue()
    assert "2 rollout engines" in out.getvalue()
