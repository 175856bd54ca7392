"""A study's result (``runner.run_study``) -> <out>/<study>/table.md (the variant table, means over
seeds, failed runs, the study's per-step sections) and plot.png (the study's panels); ``finish``
writes both and the final results.json.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from megatron_bubblespec.speculative.sources import SOURCES
from megatron_bubblespec.metrics.formatting import (MISSING, count, number, percent, scientific,
                                                     seconds, value)
from megatron_bubblespec.metrics.reduce import mean_of
from runner import QUIET, write_json

Summary = Mapping[str, object]


@dataclass(frozen=True)
class Column:
    header: str
    key: str
    fmt: Callable[[float], str]

    def cell(self, summary: Summary) -> str:
        x = lookup(summary, self.key)
        return self.fmt(math.nan if x is None else float(x))


def lookup(summary: Summary, key: str):
    """``summary[key]``, where a dotted key reads a nested block (``steady_state.x``); None when
    missing."""
    for part in key.split("."):
        if not isinstance(summary, Mapping):
            return None
        summary = summary.get(part)
    return summary


@dataclass(frozen=True)
class SourcesColumn:
    """Continuation tokens accepted / proposed, per proposal source that proposed any."""

    header: str = "continuation accepted / proposed by source"

    def cell(self, summary: Summary) -> str:
        parts = []
        for source in SOURCES:
            proposed = value(summary, f"continuation_proposed_tokens_{source}")
            if proposed > 0:
                accepted = value(summary, f"continuation_accepted_tokens_{source}")
                parts.append(f"{source} {count(accepted)} / {count(proposed)}")
        return ", ".join(parts) or MISSING


def _reward_cell(summary: Summary) -> str:
    return (f"{number(value(summary, 'reward_first_on'))} → "
            f"{number(value(summary, 'reward_last_on'))}")


ACCEPT = (Column("accept rate", "accept_rate", percent),
          Column("accepted prefix", "accepted_prefix_mean", number))
SPEED = (Column("decode steps on/off", "decode_steps_ratio", number),
         Column("decode steps saved (own tokens)", "decode_steps_saved_frac", percent),
         Column("throughput on vs off", "throughput_ratio", number),
         Column("incl. verify", "throughput_ratio_with_verify", number),
         Column("verify / rollout", "verify_overhead_frac", percent))
# The same ratios over the steady state (steps >= H + 1, after what step 0's bubble drafted).
STEADY = (Column("decode steps on/off, steady", "steady_state.decode_steps_ratio", number),
          Column("engine steps on/off, steady", "steady_state.engine_steps_ratio", number),
          Column("incl. verify, steady", "steady_state.throughput_ratio_with_verify", number))
BUBBLE = (Column("bubble (off run)", "bubble_ratio_off", percent),
          Column("bubble used", "bubble_utilization", percent))
EXACT = (Column("token mismatch", "token_mismatch", count),)
TRAINING = (Column("lr", "lr", scientific),
            Column("drift KL", "policy_drift_kl_mean", scientific))
TIME = (Column("wall on", "wall_on_s", seconds), Column("wall off", "wall_off_s", seconds))
DEFAULT_COLUMNS = ACCEPT + SPEED + STEADY + BUBBLE + EXACT + TRAINING
# Optional columns: the engine-step ratio and the share of the responses drafted / accepted
# (steps >= 1), and the proposals of speculative continuation.
ENGINE = (Column("engine steps on/off", "engine_steps_ratio", number),)
COVERAGE = (Column("drafted share", "draft_coverage", percent),
            Column("accepted share", "accepted_coverage", percent))
CONTINUATION = (Column("continuation proposed", "continuation_proposed_tokens", count),
                Column("continuation accepted", "continuation_accepted_tokens", count),
                Column("continuation accept rate", "continuation_accept_rate", percent))


def _load_cell(summary: Summary) -> str:
    """1-minute load average at the start and the end of the on run, then of the off run."""
    def one(pair) -> str:
        try:
            return "→".join(f"{float(x[0]):.1f}" for x in pair)
        except (TypeError, IndexError, ValueError):
            return MISSING
    if "loadavg_on" not in summary:
        return MISSING
    return f"{one(summary['loadavg_on'])} / {one(summary['loadavg_off'])}"


def markdown_table(runs: Sequence[Summary], columns: Sequence[Column] = DEFAULT_COLUMNS) -> str:
    """One row per variant: label, overrides, the columns, reward first → last quarter, times."""
    header = ["variant", "overrides", *(c.header for c in columns), "reward first → last (on)",
              *(c.header for c in TIME), "load 1 min on / off"]
    lines = ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (len(header) - 2)]
    for s in runs:
        over = " ".join(f"`{o}`" for o in s["overrides"]) or MISSING
        row = [str(s["label"]), over, *(c.cell(s) for c in columns), _reward_cell(s),
               *(c.cell(s) for c in TIME), _load_cell(s)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def per_step_table(runs: Sequence[Summary], key: str, fmt=number, off: bool = True) -> str:
    """``key`` per step: one column per variant's on run, then one per distinct off run."""
    cols = [(str(s["label"]), s["series"]["on"]) for s in runs]
    if off:
        cols += _distinct_offs(runs)
    steps = max(len(series) for _, series in cols)
    lines = ["| step | " + " | ".join(name for name, _ in cols) + " |",
             "|---:|" + "---:|" * len(cols)]
    for t in range(steps):
        row = [fmt(value(series[t], key)) if t < len(series) else MISSING for _, series in cols]
        lines.append(f"| {t} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def _mean_series(serieses: Sequence[Sequence[Mapping]]) -> list[dict]:
    """Step by step, the mean of every metric over several runs' step records (NaN skipped)."""
    return [{key: mean_of([series[t] for series in serieses], key) for key in serieses[0][t]}
            for t in range(min(len(series) for series in serieses))]


def seed_means(runs: Sequence[Summary]) -> list[dict]:
    """One summary per variant group (a variant repeated over --seeds): the mean of every number
    and of the per-step series over its runs (NaN skipped), its overrides without run.seed."""
    groups: dict[str, list[Summary]] = {}
    for s in runs:
        groups.setdefault(str(s.get("group", s["label"])), []).append(s)
    means = []
    for label, members in groups.items():
        mean = {"label": f"{label} (mean of {len(members)})" if len(members) > 1 else label,
                "overrides": [o for o in members[0]["overrides"] if not o.startswith("run.seed=")]}
        for key, x in members[0].items():
            if isinstance(x, (int, float)) and not isinstance(x, bool):
                mean[key] = mean_of(members, key)
            elif key == "steady_state" and all(isinstance(m.get(key), Mapping) for m in members):
                mean[key] = {k: mean_of([m[key] for m in members], k) for k, y in x.items()
                             if isinstance(y, (int, float)) and not isinstance(y, bool)}
        mean["series"] = {mode: _mean_series([m["series"][mode] for m in members])
                          for mode in ("on", "off")}
        mean["run_off"] = " ".join(sorted({m["run_off"] for m in members}))
        means.append(mean)
    return means


def header_lines(result: Mapping, title: str) -> list[str]:
    m = result["machine"]
    load = " ".join(f"{x:.2f}" for x in m.get("loadavg_1_5_15") or ())
    base = " ".join(f"`{o}`" for o in result["base_overrides"] if o not in QUIET) or "(none)"
    return [
        f"# {title}",
        "",
        f"config `{result['config']}`, overrides for every run {base}. "
        "Ratios compare each variant's BubbleSpec run with its plain synchronous run (same seeds "
        "and prompts) over steps >= 1; acceptance, bubble and drift over all steps; drift KL = "
        "mean per-step KL between consecutive policies (on run); token mismatch = response "
        "tokens that differ from the plain run (0 for an exact rule); reward = mean of the first "
        "and of the last quarter of the steps.",
        f"machine: {m['cpus_usable']} of {m['cpu_count']} CPUs (shared), torch {m['torch']}, "
        f"{m['cuda'] or 'no GPU'}; {m['started']} to {m['date']} ({m['wall_s']:.0f} s), load "
        f"average at the end {load}.",
        "",
    ]


def write_table(result: Mapping, title: str, columns: Sequence[Column] = DEFAULT_COLUMNS,
                extra: Sequence[str] = ()) -> Path:
    """<out>/<study>/table.md: header, the variant table, then the study's extra sections."""
    failed = [f"- {f['label']} (`{' '.join(f['overrides'])}`): run {f['run']} failed: "
              f"{f['error']} (log `{f['log']}`)" for f in result.get("failed", ())]
    failed = ["## Failed runs", "", *failed, ""] if failed else []
    means = seed_means(result["runs"])
    means = (["## Mean over seeds", "", markdown_table(means, columns), ""]
             if len(means) < len(result["runs"]) else [])
    text = "\n".join([*header_lines(result, title), markdown_table(result["runs"], columns),
                      "", *means, *failed, *extra, ""])
    path = Path(result["out"]) / "table.md"
    path.write_text(text)
    return path


# ---------------------------------------------------------------------------------------------
# plot

Panel = Callable[[object, Sequence[Summary]], None]


def bars(key: str, title: str, fmt=number) -> Panel:
    """A panel: one bar per variant for ``key``, its value written on the bar."""
    def draw(ax, runs):
        labels = [str(s["label"]) for s in runs]
        ys = [value(s, key) for s in runs]
        xs = range(len(runs))
        ax.bar(xs, [0 if math.isnan(y) else y for y in ys], color="#2a6f97")
        for x, y in zip(xs, ys):
            ax.annotate(fmt(y), (x, 0 if math.isnan(y) else y), ha="center", va="bottom",
                        fontsize=8)
        ax.set_xticks(list(xs), labels, rotation=20, ha="right", fontsize=8)
        top = max([y for y in ys if math.isfinite(y)], default=0.0)
        ax.set_ylim(min(0.0, *[y for y in ys if math.isfinite(y)]), (top or 1.0) * 1.15)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    return draw


def curves(metric: str, title: str, off: bool = True) -> Panel:
    """A panel: ``metric`` per step, one line per variant's on run (dashed: the off runs)."""
    def draw(ax, runs):
        for s in runs:
            series = s["series"]["on"]
            ax.plot([value(r, "step") for r in series], [value(r, metric) for r in series], "o-",
                    ms=3, label=str(s["label"]))
        if off:
            for i, (name, series) in enumerate(_distinct_offs(runs)):
                ax.plot([value(r, "step") for r in series], [value(r, metric) for r in series],
                        "--", color="grey", alpha=0.6 + 0.4 * (i == 0), label=name)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return draw


def scatter(x: str, y: str, title: str, xlabel: str, ylabel: str, logx: bool = False) -> Panel:
    """A panel: one labelled point per variant at (summary[x], summary[y])."""
    def draw(ax, runs):
        for s in runs:
            px, py = value(s, x), value(s, y)
            if math.isfinite(px) and math.isfinite(py):
                ax.plot(px, py, "o", ms=7)
                ax.annotate(str(s["label"]), (px, py), textcoords="offset points", xytext=(5, 5),
                            fontsize=8)
        if logx:
            ax.set_xscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    return draw


def _distinct_offs(runs: Sequence[Summary]) -> list[tuple[str, list]]:
    seen: dict[str, tuple[str, list]] = {}
    for s in runs:
        seen.setdefault(s["run_off"], (f"off: {s['label']}", s["series"]["off"]))
    if len(seen) == 1:
        return [("plain synchronous (off)", next(iter(seen.values()))[1])]
    return list(seen.values())


def write_plot(result: Mapping, title: str, panels: Sequence[Panel], ncols: int = 3) -> Path:
    """<out>/<study>/plot.png: the panels on a grid."""
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(5 * ncols, 3.8 * nrows), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    runs = seed_means(result["runs"])
    if len(runs) < len(result["runs"]):
        title = f"{title}, mean over seeds"
    else:
        runs = result["runs"]
    for ax, panel in zip(axes, panels):
        panel(ax, runs)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(f"{title} ({result['config']})", fontsize=13, fontweight="bold")
    path = Path(result["out"]) / "plot.png"
    fig.savefig(path)
    return path


STANDARD_PANELS = (
    bars("accept_rate", "accept rate (accepted / drafted tokens)", percent),
    bars("decode_steps_ratio", "decode steps on / off (steps >= 1)"),
    bars("throughput_ratio_with_verify", "throughput on vs off, incl. verify"),
    bars("policy_drift_kl_mean", "policy drift KL (mean per step)", scientific),
    bars("token_mismatch", "token mismatch vs off run (tokens)", count),
    curves("spec/accept_rate", "accept rate per step", off=False),
)


def finish(result: dict, title: str, columns: Sequence[Column] = DEFAULT_COLUMNS,
           panels: Sequence[Panel] = STANDARD_PANELS, extra: Sequence[str] = ()) -> None:
    """Write results.json, table.md and plot.png of a finished study and print the table."""
    write_json(Path(result["out"]) / "results.json", result)
    table = write_table(result, title, columns, extra)
    plot = write_plot(result, title, panels)
    print(markdown_table(result["runs"], columns))
    print(f"{result['study']}: {Path(result['out']) / 'results.json'}, {table}, {plot}")
