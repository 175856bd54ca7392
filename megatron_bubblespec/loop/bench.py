"""Config -> paired runs, BubbleSpec on / off (same seeds, prompts) -> ratios -> bench.json/md/png.

``bench(config_path, out_dir, overrides)`` loads the config twice, once with ``spec.enabled=true``
and once with ``spec.enabled=false`` (everything else identical, so both runs see the same seeds,
prompts and sampling keys), trains each as its own run under ``out_dir`` (run names
``<run.name>-on`` and ``<run.name>-off``, BubbleSpec on first) and compares them:

* cost, over the steps >= 1 (the first step has no drafts to verify):
  ``decode_steps_ratio`` = sum on decode steps / sum off decode steps (per request, the paper's
  metric); ``engine_steps_ratio`` = sum on / sum off of the step's engine steps (per step the
  slowest rank's: what its wall time follows, several tokens per request in a continuation step);
  ``rollout_time_ratio`` = on rollout time / off rollout time;
  ``throughput_ratio`` = off rollout time / on rollout time;
  ``throughput_ratio_with_verify`` = off rollout time / (on rollout time + on verify time), since
  verifying the drafts is part of what the on run pays;
  ``verify_overhead_frac`` = on verify time / on rollout time;
* bubble, over all steps (the drafts of step t are made in the bubble of step t - 1):
  ``bubble_ratio_off`` = idle share of the off run's rank rollout time (the bubble there is to use),
  ``bubble_ratio_on``, ``bubble_utilization`` = on drafting time / on idle time of the bubbles
  that could draft (:func:`megatron_bubblespec.metrics.summary.bubble_utilization`: the last step
  has nothing to draft);
* drafts, over all steps: ``accepted_prefix_mean`` (weighted by drafted samples), ``accept_rate``
  (accepted / drafted tokens), ``drafted_tokens``, ``accepted_tokens``, ``draft_len_mean`` (drafted
  tokens / drafted samples), ``draft_coverage`` (drafted tokens / on response tokens, steps >= 1:
  the share of the responses the bubbles drafted; a draft longer than its response counts in
  full), ``accepted_coverage`` ((prefix + continuation accepted tokens) / on response tokens,
  steps >= 1); the ceiling (:mod:`megatron_bubblespec.sim.ceiling`): ``accept_per_token`` (a lower
  bound from the verified prefixes), ``decode_steps_ratio_ceiling`` = 1 - accept_per_token x
  draft_coverage (the lowest decode steps ratio exact verification allows with these drafts) and
  ``decode_steps_ratio_ceiling_full_coverage`` = 1 - accept_per_token (drafts covering every
  response); speculative continuation
  (rollout proposals from the prompt's drafts): ``continuation_proposed_tokens``,
  ``continuation_accepted_tokens``, ``continuation_accept_rate`` (accepted / proposed);
* exactness: ``token_mismatch`` = response token positions that differ between the two runs over
  all steps and samples (a length difference counts its extra tokens, a sample missing from one run
  all of its tokens) and ``token_mismatch_samples`` = samples with any difference; both must be 0;
* training: ``lr`` (the on run's last logged learning rate), ``policy_drift_kl_mean`` (mean over
  the on run's steps of ``policy/drift_kl``), ``reward_mean_on`` / ``reward_mean_off``;
* context: ``machine`` (cpu count, torch version, start and end date, wall time, load average),
  ``config``, ``overrides``, and ``series`` (the full per-step records of both runs, NaN as null).

A ratio whose denominator is 0 or missing is NaN in memory and null in bench.json.
"""

from __future__ import annotations

import argparse
import datetime
import math
import time
from pathlib import Path
from typing import Mapping, Sequence

from megatron_bubblespec.machine import machine_info
from megatron_bubblespec.metrics import to_json
from megatron_bubblespec.metrics.aggregate import ratio
from megatron_bubblespec.metrics.formatting import (count, number, percent, scientific, seconds,
                                                    value)
from megatron_bubblespec.metrics.reduce import finite_values, mean_of, total_of, weighted_mean_of
from megatron_bubblespec.metrics.summary import bubble_utilization, plot_decode_breakdown
from megatron_bubblespec.sim.ceiling import accept_per_token_lower_bound, decode_steps_ratio_ceiling

Record = Mapping[str, object]

# (label, key in the result, formatter) of the summary table in bench.md, in row order.
SUMMARY_ROWS = (
    ("decode steps on / off (steps >= 1)", "decode_steps_ratio", number),
    ("engine steps on / off (steps >= 1)", "engine_steps_ratio", number),
    ("rollout time on / off (steps >= 1)", "rollout_time_ratio", number),
    ("throughput on vs off (off time / on time)", "throughput_ratio", number),
    ("throughput with verify (off / (on + verify))", "throughput_ratio_with_verify", number),
    ("verify time / on rollout time", "verify_overhead_frac", percent),
    ("rollout time on (steps >= 1)", "rollout_time_on_s", seconds),
    ("rollout time off (steps >= 1)", "rollout_time_off_s", seconds),
    ("verify time on (steps >= 1)", "verify_time_on_s", seconds),
    ("decode steps on (steps >= 1)", "decode_steps_on", count),
    ("decode steps off (steps >= 1)", "decode_steps_off", count),
    ("engine steps on (steps >= 1)", "engine_steps_on", count),
    ("engine steps off (steps >= 1)", "engine_steps_off", count),
    ("bubble ratio, off run", "bubble_ratio_off", percent),
    ("bubble ratio, on run", "bubble_ratio_on", percent),
    ("bubble utilization (drafting / idle), on run", "bubble_utilization", percent),
    ("accepted prefix mean (tokens)", "accepted_prefix_mean", number),
    ("accept rate (accepted / drafted tokens)", "accept_rate", percent),
    ("drafted tokens", "drafted_tokens", count),
    ("draft length mean (tokens per drafted sample)", "draft_len_mean", number),
    ("drafted share of the responses (steps >= 1)", "draft_coverage", percent),
    ("accepted share of the responses (steps >= 1)", "accepted_coverage", percent),
    ("per-token acceptance (lower bound, from the prefixes)", "accept_per_token", percent),
    ("decode steps on / off ceiling with these drafts", "decode_steps_ratio_ceiling", number),
    ("decode steps on / off ceiling, drafts covering all", "decode_steps_ratio_ceiling_full_coverage",
     number),
    ("accepted tokens", "accepted_tokens", count),
    ("continuation proposed tokens", "continuation_proposed_tokens", count),
    ("continuation accepted tokens", "continuation_accepted_tokens", count),
    ("continuation accept rate (accepted / proposed)", "continuation_accept_rate", percent),
    ("token mismatch on vs off (tokens)", "token_mismatch", count),
    ("token mismatch on vs off (samples)", "token_mismatch_samples", count),
    ("reward mean, on run", "reward_mean_on", number),
    ("reward mean, off run", "reward_mean_off", number),
    ("learning rate", "lr", scientific),
    ("policy drift KL mean, on run", "policy_drift_kl_mean", scientific),
)

# (header, metric, formatter) of the per-step table in bench.md; each shown for on and off.
STEP_COLUMNS = (
    ("decode steps", "rollout/decode_steps", count),
    ("engine steps", "rollout/engine_steps", count),
    ("rollout", "rollout/time_s", seconds),
    ("verify", "spec/verify_s", seconds),
    ("bubble", "bubble/ratio", percent),
)
# Shown for the on run only.
STEP_COLUMNS_ON = (
    ("util", "bubble/utilization", percent),
    ("accept", "spec/accept_rate", percent),
    ("prefix", "spec/accepted_prefix_mean", number),
    ("drift KL", "policy/drift_kl", scientific),
)


def token_mismatch(on: Sequence[Mapping[int, Sequence[int]]],
                   off: Sequence[Mapping[int, Sequence[int]]]) -> tuple[int, int]:
    """(differing token positions, differing samples) between two runs' per-step rollouts.

    Positions are compared one to one; the tokens past the shorter response count as differing, a
    sample (or step) present in one run only counts all of its tokens.
    """
    tokens = samples = 0
    for step in range(max(len(on), len(off))):
        a = on[step] if step < len(on) else {}
        b = off[step] if step < len(off) else {}
        for index in set(a) | set(b):
            x, y = list(a.get(index, ())), list(b.get(index, ()))
            diff = sum(1 for p, q in zip(x, y) if p != q) + abs(len(x) - len(y))
            if index not in a or index not in b:
                diff = max(diff, 1)  # a missing sample differs even when the other is empty
            if diff:
                tokens += diff
                samples += 1
    return tokens, samples


def compare(on: Sequence[Record], off: Sequence[Record]) -> dict:
    """The on/off numbers of the module docstring from the two runs' step records."""
    on1 = [r for r in on if value(r, "step") >= 1]
    off1 = [r for r in off if value(r, "step") >= 1]
    dec_on, dec_off = total_of(on1, "rollout/decode_steps"), total_of(off1, "rollout/decode_steps")
    eng_on, eng_off = total_of(on1, "rollout/engine_steps"), total_of(off1, "rollout/engine_steps")
    proposed = total_of(on, "spec/continuation_proposed_tokens")
    continued = total_of(on, "spec/continuation_accepted_tokens")
    t_on, t_off = total_of(on1, "rollout/time_s"), total_of(off1, "rollout/time_s")
    verify = total_of(on1, "spec/verify_s")
    verify_0 = 0.0 if math.isnan(verify) else verify
    tokens_on = total_of(on1, "rollout/tokens")
    continued_1 = total_of(on1, "spec/continuation_accepted_tokens")
    coverage = ratio(total_of(on1, "spec/drafted_tokens"), tokens_on)
    per_token = accept_per_token_lower_bound(total_of(on1, "spec/accepted_tokens"),
                                             total_of(on1, "spec/drafted_samples"))

    def bubble_ratio(records):
        # mean of the step ratios weighted by rollout time = idle / (ranks x total rollout time)
        return weighted_mean_of(records, "bubble/ratio", "rollout/time_s")

    lrs = finite_values(value(r, "train/lr") for r in on)
    return {
        "steps": len(on),
        "steps_compared": len(on1),
        "decode_steps_on": dec_on,
        "decode_steps_off": dec_off,
        "decode_steps_ratio": ratio(dec_on, dec_off),
        "engine_steps_on": eng_on,
        "engine_steps_off": eng_off,
        "engine_steps_ratio": ratio(eng_on, eng_off),
        "rollout_time_on_s": t_on,
        "rollout_time_off_s": t_off,
        "verify_time_on_s": verify,
        "rollout_time_ratio": ratio(t_on, t_off),
        "throughput_ratio": ratio(t_off, t_on),
        "throughput_ratio_with_verify": ratio(t_off, t_on + verify_0),
        "verify_overhead_frac": ratio(verify, t_on),
        "bubble_ratio_off": bubble_ratio(off),
        "bubble_ratio_on": bubble_ratio(on),
        "bubble_utilization": bubble_utilization(on),
        "accepted_prefix_mean": weighted_mean_of(on, "spec/accepted_prefix_mean",
                                               "spec/drafted_samples"),
        "accept_rate": ratio(total_of(on, "spec/accepted_tokens"), total_of(on, "spec/drafted_tokens")),
        "drafted_tokens": total_of(on, "spec/drafted_tokens"),
        "accepted_tokens": total_of(on, "spec/accepted_tokens"),
        "draft_len_mean": ratio(total_of(on, "spec/drafted_tokens"),
                                total_of(on, "spec/drafted_samples")),
        "draft_coverage": coverage,
        "accept_per_token": per_token,
        "decode_steps_ratio_ceiling": decode_steps_ratio_ceiling(per_token, coverage),
        "decode_steps_ratio_ceiling_full_coverage": decode_steps_ratio_ceiling(per_token, 1.0),
        "accepted_coverage": ratio(total_of(on1, "spec/accepted_tokens") + (
            0.0 if math.isnan(continued_1) else continued_1), tokens_on),
        "continuation_proposed_tokens": proposed,
        "continuation_accepted_tokens": continued,
        "continuation_accept_rate": ratio(continued, proposed),
        "reward_mean_on": mean_of(on, "train/reward_mean"),
        "reward_mean_off": mean_of(off, "train/reward_mean"),
        "lr": lrs[-1] if lrs else math.nan,
        "policy_drift_kl_mean": mean_of(on, "policy/drift_kl"),
        "policy_drift_kl_mean_off": mean_of(off, "policy/drift_kl"),
    }


def _fmt(fmt, x) -> str:
    return fmt(math.nan if x is None else float(x))


def markdown_summary(result: Mapping[str, object]) -> str:
    """The summary table of bench.md: one row per number."""
    lines = ["| metric | value |", "|---|---:|"]
    lines += [f"| {label} | {_fmt(fmt, result.get(key))} |" for label, key, fmt in SUMMARY_ROWS]
    return "\n".join(lines)


def markdown_steps(on: Sequence[Record], off: Sequence[Record]) -> str:
    """The per-step table of bench.md: on and off side by side."""
    header = ["step"]
    for name, _, _ in STEP_COLUMNS:
        header += [f"{name} on", f"{name} off"]
    header += [f"{name} on" for name, _, _ in STEP_COLUMNS_ON]
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for step in range(max(len(on), len(off))):
        a = on[step] if step < len(on) else {}
        b = off[step] if step < len(off) else {}
        row = [str(step)]
        for _, key, fmt in STEP_COLUMNS:
            row += [fmt(value(a, key)), fmt(value(b, key))]
        row += [fmt(value(a, key)) for _, key, fmt in STEP_COLUMNS_ON]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def markdown(result: Mapping[str, object]) -> str:
    m = result["machine"]
    over = " ".join(result["overrides"]) or "(none)"
    return "\n".join([
        f"# BubbleSpec on vs off: {result['name']}",
        "",
        f"config `{result['config']}`, overrides `{over}`; {result['steps']} steps per run, "
        f"ratios over steps >= 1 (bubble, drafts and drift over all steps).",
        f"machine: {m['cpus_usable']} of {m['cpu_count']} CPUs, torch {m['torch']}, "
        f"{m['cuda'] or 'no GPU'}, {m['started']} to {m['date']} ({m['wall_s']:.0f} s), "
        f"load average at the end "
        f"{' '.join(f'{x:.2f}' for x in m['loadavg_1_5_15'] or ())}.",
        "",
        markdown_summary(result),
        "",
        "## Per step",
        "",
        markdown_steps(result["series"]["on"], result["series"]["off"]),
        "",
        "## Where the decode steps went (on run; line: decode steps of the off run)",
        "",
        "![decode steps per step](bench_decode.png)",
        "",
    ])


def bench(config_path: str | Path, out_dir: str | Path, overrides: Sequence[str] = ()) -> dict:
    """Run the paired on/off runs of ``config_path`` under ``out_dir`` and write the bench files."""
    from megatron_bubblespec.config import load_config
    from megatron_bubblespec.loop.train import train
    from megatron_bubblespec.metrics import plot_run

    out = Path(out_dir)
    overrides = list(overrides)
    name = load_config(config_path, overrides).run.name  # validates before any run starts
    started, t0 = datetime.datetime.now().astimezone(), time.perf_counter()
    runs = {}
    for mode, enabled in (("on", "true"), ("off", "false")):
        cfg = load_config(config_path, [*overrides, f"run.output_dir={out}",
                                        f"run.name={name}-{mode}", f"spec.enabled={enabled}"])
        runs[mode] = train(cfg)
    on, off = runs["on"]["records"], runs["off"]["records"]
    mismatch, mismatch_samples = token_mismatch(runs["on"]["rollouts"], runs["off"]["rollouts"])
    result = {
        "name": name,
        "config": str(config_path),
        "overrides": overrides,
        "runs": {"on": str(out / f"{name}-on"), "off": str(out / f"{name}-off")},
        **compare(on, off),
        "token_mismatch": mismatch,
        "token_mismatch_samples": mismatch_samples,
        "machine": {**machine_info(), "started": started.isoformat(timespec="seconds"),
                    "wall_s": time.perf_counter() - t0},
        "series": {"on": list(on), "off": list(off)},
    }
    out.mkdir(parents=True, exist_ok=True)
    text = to_json(result, indent=1)
    (out / "bench.json").write_text(text + "\n")
    (out / "bench.md").write_text(markdown(result))
    plot_run(on, out / "bench.png", baseline=off)
    plot_decode_breakdown(on, out / "bench_decode.png", baseline=off)
    return result


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``bench`` on a ``parser.add_subparsers()`` object."""
    parser = subparsers.add_parser("bench", help=cmd_bench.__doc__,
                                   description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML config (see configs/)")
    parser.add_argument("--out", required=True, help="directory for the two runs and bench.*")
    parser.add_argument("overrides", nargs="*",
                        help="dotted overrides for both runs, e.g. run.steps=3")
    parser.set_defaults(func=cmd_bench)
    return parser


def cmd_bench(args) -> int:
    """Run a config with BubbleSpec on and off (paired runs) and compare: bench.json, .md, .png."""
    import sys

    from megatron_bubblespec.config import ConfigError

    try:
        result = bench(args.config, args.out, args.overrides)
    except ConfigError as err:
        print(f"bubblespec bench: config error: {err}", file=sys.stderr)
        return 2
    print(markdown_summary(result))
    print(f"bench files: {Path(args.out) / 'bench.json'}, bench.md, bench.png, bench_decode.png")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_bubblespec.loop.bench")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(argv if argv is not None else __import__("sys").argv[1:])])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
