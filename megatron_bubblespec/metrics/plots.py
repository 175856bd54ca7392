"""Run plots: step records (optionally a plain-run baseline) -> a 4-panel PNG of the run, and a PNG
of where each step's decode steps went."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping, Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator, PercentFormatter

from megatron_bubblespec.metrics.formatting import percent, value
from megatron_bubblespec.metrics.reduce import finite_values
from megatron_bubblespec.metrics.registry import run_totals

Record = Mapping[str, object]


def _series(records: Sequence[Record], key: str) -> tuple[list[float], list[float]]:
    return [value(r, "step") for r in records], [value(r, key) for r in records]


def _no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in this run", transform=ax.transAxes,
            ha="center", va="center", color="grey")


def _legend(*axes) -> None:
    """One legend for ``axes`` (a panel and its twins), on the topmost so nothing hides it."""
    handles, labels = [], []
    for ax in axes:
        h, l = ax.get_legend_handles_labels()
        handles, labels = handles + h, labels + l
    if handles:
        axes[-1].legend(handles, labels, loc="upper left", fontsize=9, framealpha=0.9)


def _headroom(ax, values: Sequence[float], fraction: float = 0.35) -> None:
    """y from 0 with space above the data for the legend."""
    top = max(finite_values(values), default=0.0)
    ax.set_ylim(0, (top or 1.0) * (1 + fraction))


def _run_value(fraction: float, what: str) -> str:
    """' (run: 12.3% <what>)' for a panel title, '' when the run has no such value."""
    return "" if math.isnan(fraction) else f" (run: {percent(fraction)} {what})"


def plot_run(records: Sequence[Record], path_png: str | Path,
             baseline: Sequence[Record] | None = None) -> Path:
    """Write one PNG of four per-step panels: bubble time, acceptance, decode steps, policy drift.

    ``baseline``: the step records of the plain synchronous run (BubbleSpec off) on the same seed;
    its decode steps are drawn next to this run's.
    """
    if not records:
        raise ValueError("plot_run needs at least one step record")
    totals = run_totals(records)
    fig = Figure(figsize=(13, 9), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    (ax_bub, ax_acc), (ax_dec, ax_kl) = fig.subplots(2, 2, sharex=True)
    fig.suptitle(f"BubbleSpec run: {len(records)} steps", fontsize=14, fontweight="bold")
    _bubble_panel(ax_bub, records, totals)
    _acceptance_panel(ax_acc, records, totals)
    _decode_panel(ax_dec, records, totals, baseline)
    _drift_panel(ax_kl, records)
    for ax in (ax_dec, ax_kl):
        ax.set_xlabel("step")
    for ax in (ax_bub, ax_acc, ax_dec, ax_kl):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.tick_params(labelbottom=True)
    path = Path(path_png)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def _bubble_panel(ax, records: Sequence[Record], totals: Mapping[str, float]) -> None:
    steps, idle = _series(records, "bubble/idle_s")
    _, drafting = _series(records, "bubble/drafting_s")
    ax.set_title(f"Bubble time per step (bubble {percent(totals['bubble/ratio'])} of rollout, "
                 f"{percent(totals['bubble/utilization'])} used for drafting)")
    if finite_values(idle):
        ax.bar(steps, idle, width=0.8, color="#f4a261", label="idle at the barrier")
        ax.bar(steps, drafting, width=0.5, color="#2a6f97", label="drafting in the bubble")
    else:
        _no_data(ax, "bubble time")
    _headroom(ax, idle)
    ax.set_ylabel("seconds, summed over ranks")
    _legend(ax)


def _acceptance_panel(ax, records: Sequence[Record], totals: Mapping[str, float]) -> None:
    steps, accept = _series(records, "spec/accept_rate")
    _, prefix = _series(records, "spec/accepted_prefix_mean")
    ax.set_title("Draft acceptance" + _run_value(totals["spec/accept_rate"], "of drafted tokens"))
    ax_prefix = ax.twinx()
    if finite_values(accept) or finite_values(prefix):
        ax.plot(steps, accept, "o-", color="#2a9d8f", label="accept rate (left)")
        ax_prefix.plot(steps, prefix, "s--", color="#6d597a", label="accepted prefix mean (right)")
    else:
        _no_data(ax, "drafts")
    ax.set_ylim(0, 1.4)
    ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_ylabel("accepted / drafted tokens")
    ax_prefix.set_ylabel("accepted prefix per drafted sample (tokens)")
    _headroom(ax_prefix, prefix, 0.45)
    _legend(ax, ax_prefix)


def _decode_panel(ax, records: Sequence[Record], totals: Mapping[str, float],
                  baseline: Sequence[Record] | None) -> None:
    steps, saved = _series(records, "spec/decode_steps_saved_frac")
    ax.set_title("Decode steps saved by drafts"
                 + _run_value(totals["spec/decode_steps_saved_frac"], "saved"))
    ax_steps = ax.twinx()
    if finite_values(saved):
        ax.bar(steps, saved, width=0.6, color="#8ecae6", label="saved fraction (left)")
    else:
        _no_data(ax, "decode-step savings")
    runs = [(records, "this run", "o-", "#023047")]
    if baseline is not None:
        runs.append((baseline, "plain run", "s--", "#9b2226"))
    decode_steps = []
    for run, name, style, color in runs:
        xs, ys = _series(run, "rollout/decode_steps")
        ax_steps.plot(xs, ys, style, color=color, label=f"decode steps, {name} (right)")
        decode_steps += ys
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    _headroom(ax, saved + [0.1])
    ax.set_ylabel("1 - decode steps / plain decode steps")
    ax_steps.set_ylabel("decode steps (engine forward passes)")
    _headroom(ax_steps, decode_steps)
    _legend(ax, ax_steps)


def _drift_panel(ax, records: Sequence[Record]) -> None:
    steps, drift = _series(records, "policy/drift_kl")
    ax.set_title("Policy drift between consecutive steps")
    if finite_values(drift):
        ax.plot(steps, drift, "o-", color="#bc4749",
                label="KL between the policies of steps t-1 and t")
        _headroom(ax, drift)
        _legend(ax)
    else:
        _no_data(ax, "policy drift")
    ax.set_ylabel("mean KL on the rollout tokens")


def plot_decode_breakdown(records: Sequence[Record], path_png: str | Path,
                          baseline: Sequence[Record] | None = None,
                          steady_from: int | None = None) -> Path:
    """Write one PNG: per step, where the response tokens of the run came from, stacked: tokens of
    the verified draft prefix (no decode step), tokens accepted by speculative continuation (several
    per decode step) and decode steps run; ``baseline`` (BubbleSpec off) decode steps as a line.

    ``steady_from``: the first steady-state step; the steps before it (no drafts, or drafts from
    step 0's bubble) are shaded and labelled "transient", the rest "steady state", split by a
    dashed line."""
    if not records:
        raise ValueError("plot_decode_breakdown needs at least one step record")
    steps, prefix = _series(records, "spec/accepted_tokens")
    _, continued = _series(records, "spec/continuation_accepted_tokens")
    _, decoded = _series(records, "rollout/decode_steps")
    prefix, continued, decoded = ([0.0 if math.isnan(x) else x for x in xs]
                                  for xs in (prefix, continued, decoded))
    fig = Figure(figsize=(9, 5), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.set_title("Where the decode steps went, per step")
    ax.bar(steps, decoded, width=0.7, color="#2a6f97", label="decoded (decode steps run)")
    ax.bar(steps, prefix, width=0.7, bottom=decoded, color="#e9c46a",
           label="draft prefix accepted (tokens)")
    ax.bar(steps, continued, width=0.7, bottom=[a + b for a, b in zip(decoded, prefix)],
           color="#2a9d8f", label="continuation accepted (tokens)")
    tops = [a + b + c for a, b, c in zip(decoded, prefix, continued)]
    if baseline:
        base_steps, base = _series(baseline, "rollout/decode_steps")
        ax.plot(base_steps, base, "k_", markersize=28, markeredgewidth=2,
                label="decode steps, BubbleSpec off")
        tops += finite_values(base)
    _headroom(ax, tops)
    if steady_from is not None:
        _mark_regimes(ax, steps, steady_from)
    ax.set_xlabel("step")
    ax.set_ylabel("decode steps / tokens, summed over samples")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    _legend(ax)
    fig.savefig(path_png)
    return Path(path_png)


def _mark_regimes(ax, steps: Sequence[float], steady_from: int) -> None:
    """Shade the transient steps (< ``steady_from``), draw a dashed line where the steady state
    starts, and name each regime just above the panel (clear of the legend)."""
    first, last = min(steps) - 0.5, max(steps) + 0.5
    split = min(max(steady_from - 0.5, first), last)
    ax.set_xlim(first, last)
    above = ax.get_xaxis_transform()   # x in steps, y in panel heights
    if split > first:
        ax.axvspan(first, split, color="grey", alpha=0.15, zorder=0,
                   label=f"transient: steps < {steady_from} (no drafts, or step 0's bubble's)")
        ax.text((first + split) / 2, 1.01, "transient", transform=above, ha="center",
                va="bottom", color="dimgrey", fontsize=9)
    if split < last:
        ax.axvline(split, color="dimgrey", linestyle="--", linewidth=1)
        ax.text((split + last) / 2, 1.01, f"steady state (steps >= {steady_from})",
                transform=above, ha="center", va="bottom", color="dimgrey", fontsize=9)
    ax.set_title(ax.get_title(), pad=18)
