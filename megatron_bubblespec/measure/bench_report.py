"""Bench result -> bench.md: the summary table (whole run | steady state), the per-step table of
the on, off and plain runs, and the text around them.

Row labels and formats of step metrics come from ``metrics.registry``; the rows of the bench's
own comparisons (ratios of the paired runs) are declared here.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from megatron_bubblespec.metrics.formatting import (count, number, percent, scientific, seconds,
                                                    value)
from megatron_bubblespec.metrics.registry import (BENCH_STEP_COLUMNS, BENCH_STEP_COLUMNS_ON,
                                                  METRICS, PER_SOURCE)
from megatron_bubblespec.speculative.sources import SOURCES

Record = Mapping[str, object]

# (record key, result key, label, formatter) of the continuation's counts, for every proposal
# source: spec/continuation_proposed_tokens/<source> -> continuation_proposed_tokens_<source>.
SOURCE_COUNTS = tuple(
    (key, key.removeprefix("spec/").replace("/", "_"), label, family.fmt)
    for source in SOURCES for family in PER_SOURCE
    for key, label in [family.for_source(source)])


# (label, key in the result, formatter) of the summary table in bench.md, in row order; the keys
# of compare_steps get a steady-state value too.
SUMMARY_ROWS = (
    ("decode steps on / off", "decode_steps_ratio", number),
    ("engine steps on / off", "engine_steps_ratio", number),
    ("rollout time on / off", "rollout_time_ratio", number),
    ("throughput on vs off (off time / on time)", "throughput_ratio", number),
    ("throughput with verify (off / (on + verify + overshoot))", "throughput_ratio_with_verify",
     number),
    ("throughput vs plain vLLM (plain / (on + verify + overshoot))", "throughput_vs_plain", number),
    ("throughput off vs plain vLLM (plain / off: the keyed draw)", "throughput_off_vs_plain",
     number),
    ("verify time / on rollout time", "verify_overhead_frac", percent),
    ("overshoot time / on rollout time", "overshoot_frac", percent),
    ("rollout time on", "rollout_time_on_s", seconds),
    ("rollout time off", "rollout_time_off_s", seconds),
    ("rollout time plain vLLM", "rollout_time_plain_s", seconds),
    ("verify time on", "verify_time_on_s", seconds),
    ("overshoot time on (drafting past the barrier)", "overshoot_time_on_s", seconds),
    ("decode steps on", "decode_steps_on", count),
    ("decode steps off", "decode_steps_off", count),
    ("engine steps on", "engine_steps_on", count),
    ("engine steps off", "engine_steps_off", count),
    ("accepted prefix mean (tokens)", "accepted_prefix_mean", number),
    ("accept rate (accepted / drafted tokens)", "accept_rate", percent),
    ("drafted tokens", "drafted_tokens", count),
    ("draft length mean (tokens per drafted sample)", "draft_len_mean", number),
    ("drafted share of the responses", "draft_coverage", percent),
    ("accepted share of the responses", "accepted_coverage", percent),
    ("per-token acceptance (lower bound, from the prefixes)", "accept_per_token", percent),
    ("decode steps on / off ceiling with these drafts", "decode_steps_ratio_ceiling", number),
    ("decode steps on / off ceiling, drafts covering all", "decode_steps_ratio_ceiling_full_coverage",
     number),
    ("accepted tokens", "accepted_tokens", count),
    ("continuation proposed tokens", "continuation_proposed_tokens", count),
    ("continuation accepted tokens", "continuation_accepted_tokens", count),
    ("continuation accept rate (accepted / proposed)", "continuation_accept_rate", percent),
    *((label, result, fmt) for _, result, label, fmt in SOURCE_COUNTS),
    ("bubble ratio, off run (all steps)", "bubble_ratio_off", percent),
    ("bubble ratio, on run (all steps)", "bubble_ratio_on", percent),
    ("bubble utilization (drafting / idle), on run (all steps)", "bubble_utilization", percent),
    ("token mismatch on vs off (tokens, all steps)", "token_mismatch", count),
    ("token mismatch on vs off (samples, all steps)", "token_mismatch_samples", count),
    ("reward mean, on run", "reward_mean_on", number),
    ("reward mean, off run", "reward_mean_off", number),
    ("reward mean, on run's first 4 steps", "reward_first4_on", number),
    ("reward mean, on run's last 4 steps", "reward_last4_on", number),
    ("token entropy mean (nats), on run", "token_entropy_mean", number),
    ("learning rate", "lr", scientific),
    ("policy drift KL mean, on run", "policy_drift_kl_mean", scientific),
)


def _fmt(fmt, x) -> str:
    return fmt(math.nan if x is None else float(x))


def markdown_summary(result: Mapping[str, object]) -> str:
    """The summary table of bench.md: one row per number, whole run | steady state."""
    steady = result.get("steady_state")
    if not steady:
        lines = ["| metric | whole run (steps >= 1) |", "|---|---:|"]
        lines += [f"| {label} | {_fmt(fmt, result.get(key))} |" for label, key, fmt in SUMMARY_ROWS]
        return "\n".join(lines)
    first = steady["first_step"]
    lines = [f"| metric | whole run (steps >= 1) | steady state (steps >= {first}) |",
             "|---|---:|---:|"]
    for label, key, fmt in SUMMARY_ROWS:
        later = _fmt(fmt, steady.get(key)) if key in steady else ""   # a per-range number
        lines.append(f"| {label} | {_fmt(fmt, result.get(key))} | {later} |")
    return "\n".join(lines)


def markdown_steps(on: Sequence[Record], off: Sequence[Record],
                   plain: Sequence[Record] = ()) -> str:
    """The per-step table of bench.md: on and off side by side (and the plain vLLM replay)."""
    plain_columns = (METRICS["rollout/time_s"],) if plain else ()
    header = ["step"]
    for m in BENCH_STEP_COLUMNS:
        header += [f"{m.short} on", f"{m.short} off"]
    header += [f"{m.short} plain" for m in plain_columns]
    header += [f"{m.short} on" for m in BENCH_STEP_COLUMNS_ON]
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for step in range(max(len(on), len(off))):
        a = on[step] if step < len(on) else {}
        b = off[step] if step < len(off) else {}
        c = plain[step] if step < len(plain) else {}
        row = [str(step)]
        for m in BENCH_STEP_COLUMNS:
            row += [m.fmt(value(a, m.name)), m.fmt(value(b, m.name))]
        row += [m.fmt(value(c, m.name)) for m in plain_columns]
        row += [m.fmt(value(a, m.name)) for m in BENCH_STEP_COLUMNS_ON]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _parting(result: Mapping[str, object]) -> str:
    """The sentence of bench.md on whether the two runs stayed the same."""
    parted, learner = result.get("parted_at_step"), result.get("learner_parted_at_step")
    learner_text = ("" if learner is None else
                    f" The learners parted at step {learner} (their fingerprints differ).")
    if parted is None:
        same = ("the learner's inputs and weights bitwise equal at every step too"
                if learner is None and "exact/state_hash" in (result["series"]["on"] or [{}])[0]
                else "")
        return ("The on and off runs rolled out the same tokens at every step"
                + (f", {same}." if same else ".") + learner_text)
    return (f"**The on and off runs parted at step {parted}**: its tokens differ, so from it on "
            f"the runs do different work; every ratio and sum of the summary is over steps "
            f"< {parted} only (the token mismatch counts all steps)." + learner_text)


def _regimes(result: Mapping[str, object]) -> str:
    """The paragraph of bench.md on the two step ranges and the plain baseline."""
    first = result["steady_state"]["first_step"]
    before = "step 1 takes its" if first == 2 else f"steps 1 .. {first - 1} take their"
    text = (f"Whole run: ratios over steps >= 1 (bubble, token mismatch and training over all "
            f"compared steps). Steady state: steps >= {first}; before it, {before} drafts (if any) "
            f"from step 0's bubble (ablation.draft_lookahead + spec.draft_horizon - 1 = {first - 1}), "
            f"the bubble of a step rolled out without drafts.")
    if not result["steady_state"]["steps_compared"]:
        text += (f" This run has no steady-state step: run more than {first} steps "
                 "(run.steps) for one.")
    if result["series"].get("plain"):
        text += (" Plain vLLM: the off run's samples replayed with vLLM's own sampler (no keyed "
                 "draw, no drafts), each exactly as many tokens as in the off run, initial "
                 "checkpoint, every engine's batch run at once in its own process (sharing the "
                 "machine as the run's engines do), the slowest per step.")
    else:
        text += " Plain vLLM replay skipped (--no-plain): its numbers are empty."
    return text


def _load_average(values) -> str:
    """1, 5 and 15 minute load averages as the pages quote them ('' where none was read)."""
    return " ".join(f"{x:.2f}" for x in values or ())


def _run_times(runs: Mapping[str, dict | None]) -> list[str]:
    """A line of each run's own start, end and load average at its end (what it shared the
    machine with), where the run recorded them."""
    known = [(mode, r) for mode, r in runs.items() if r]
    if not known:
        return []
    return ["runs: " + "; ".join(
        f"{mode} {r['started']} to {r['ended']}, load average at its end "
        f"{_load_average(r['loadavg_1_5_15']) or 'unknown'}"
        for mode, r in known) + "."]


def markdown(result: Mapping[str, object]) -> str:
    m = result["machine"]
    over = " ".join(result["overrides"]) or "(none)"
    series = result["series"]
    return "\n".join([
        f"# BubbleSpec on vs off: {result['name']}",
        "",
        f"config `{result['config']}`, overrides `{over}`; {result['steps']} steps per run.",
        f"machine: {m['cpus_usable']} of {m['cpu_count']} CPUs, torch {m['torch']}, "
        f"{m['cuda'] or 'no GPU'}, {m['started']} to {m['date']} ({m['wall_s']:.0f} s), "
        f"load average at the end "
        f"{_load_average(m['loadavg_1_5_15'])}"
        + (f"; runs kept from an earlier bench (--resume): {', '.join(m['reused'])}."
           if m.get("reused") else "."),
        *_run_times(m.get("runs") or {}),
        "",
        _regimes(result),
        "",
        _parting(result),
        "",
        markdown_summary(result),
        "",
        "## Per step",
        "",
        markdown_steps(series["on"], series["off"], series.get("plain", ())),
        "",
        "## Where the decode steps went (on run; line: decode steps of the off run)",
        "",
        "![decode steps per step](bench_decode.png)",
        "",
    ])
