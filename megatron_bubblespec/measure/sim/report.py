"""Simulation result (calibration, check, prediction grid) -> console tables, simulate.md,
simulate.json and simulate.png."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping, Sequence

from rich import box
from rich.console import Console
from rich.table import Table

from megatron_bubblespec.metrics.formatting import number, percent
from megatron_bubblespec.metrics.writer import to_json

# (label, key, formatter) of the calibration check, in row order.
CHECK_ROWS = (
    ("bubble ratio, off run", "bubble_ratio_off", percent),
    ("bubble ratio, on run", "bubble_ratio_on", percent),
    ("decode steps on / off", "decode_steps_ratio", number),
    ("engine steps on / off", "engine_steps_ratio", number),
    ("draft coverage", "draft_coverage", percent),
    ("throughput on vs off", "throughput_ratio", number),
    ("throughput with verify", "throughput_ratio_with_verify", number),
    ("bubble utilization", "bubble_utilization", percent),
    ("accept rate", "accept_rate", percent),
)
CHECK_MODES = (("replay", "replay"), ("replay_no_jitter", "replay, no noise"),
               ("sampled", "sampled lengths"))
# (header, key, formatter) of the prediction table, in column order.
PREDICTION_COLUMNS = (
    ("bubble off", "bubble_ratio_off", percent),
    ("bubble on", "bubble_ratio_on", percent),
    ("coverage", "draft_coverage", percent),
    ("decode on/off", "decode_steps_ratio", number),
    ("ceiling", "decode_steps_ratio_ceiling", number),
    ("rollout x", "throughput_ratio", number),
    ("+verify x", "throughput_ratio_with_verify", number),
    ("step x", "step_speedup", number),
    ("accept", "accept_rate", percent),
)
# Columns of a prediction made per rollout layout (``--layouts``): before and after the above.
LAYOUT_COLUMNS = (
    ("layout", "layout", str),
    ("rollout TP", "engine_tp", str),
    ("engines / replica", "engines_per_replica", str),
    ("seqs / engine", "samples_per_engine", str),
    ("KV slots", "kv_slots", str),
    ("waves", "waves", str),
)
KV_COLUMN = ("KV demand", "kv_demand", percent)
TIME_COLUMNS = (
    ("rollout s off", "rollout_time_off_s", lambda x: f"{x:,.0f}"),
    ("rollout s on", "rollout_time_on_s", lambda x: f"{x:,.0f}"),
)


def _f(fmt, x) -> str:
    return fmt(math.nan if x is None else float(x))


def _err(x) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{100 * x:+.0f}%"


def _context(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def check_table(check: Mapping) -> tuple[list[str], list[list[str]]]:
    modes = [(key, label) for key, label in CHECK_MODES if key in check]
    header = ["metric", "measured"] + [f"{h}{label}" for _, label in modes for h in ("", "err ")]
    spread = "sampled" in check and "sd" in check["sampled"][CHECK_ROWS[0][1]]
    if spread:
        header.append("sd of one sampled bench")
    rows = []
    for label, key, fmt in CHECK_ROWS:
        any_mode = check[modes[0][0]][key]
        row = [label, _f(fmt, any_mode["measured"])]
        for mode, _ in modes:
            cell = check[mode][key]
            row += [_f(fmt, cell["simulated"]), _err(cell["rel_error"])]
        if spread:
            row.append(_f(fmt, check["sampled"][key]["sd"]))
        rows.append(row)
    return header, rows


def prediction_table(predictions: Sequence[Mapping]) -> tuple[list[str], list[list[str]]]:
    layouts = any("layout" in p for p in predictions)
    before = LAYOUT_COLUMNS if layouts else ()
    after = (KV_COLUMN, *TIME_COLUMNS) if layouts else ()
    header = ([h for h, _, _ in before] + ["ranks", "context"]
              + [h for h, _, _ in PREDICTION_COLUMNS + after])
    rows = [[fmt(p[key]) for _, key, fmt in before] + [str(p["ranks"]), _context(p["context"])]
            + [_f(fmt, p[key]) for _, key, fmt in PREDICTION_COLUMNS + after]
            for p in predictions]
    return header, rows


def _markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _rich_table(title: str, header: list[str], rows: list[list[str]], caption: str) -> Table:
    table = Table(title=title, caption=caption, box=box.SIMPLE_HEAD, pad_edge=False)
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i == 0 else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    return table


CHECK_CAPTION = ("replay: the measured lengths of every rank and step; err: simulated / measured "
                 "- 1; noise: the fitted rank timing noise; sampled lengths: drawn from the fitted "
                 "length model, as many steps as the bench ran; sd: the spread of one such "
                 "simulated bench around the mean")
PREDICTION_CAPTION = ("bubble: idle share of rank rollout time; coverage: drafted share of the "
                      "response tokens; ceiling: 1 - acceptance x coverage, the lowest decode "
                      "on/off exact verification allows with these drafts; rollout x: off / on "
                      "rollout time; +verify x: including the verify forward; step x: whole step "
                      "(train, reshard, overshoot)")
LAYOUT_CAPTION = ("layout: one-per-replica = one engine per replica at rollout TP = TP on the "
                  "first stage, every-gpu = TP x PP x CP / r engines per replica; KV slots: "
                  "sequences of max_model_len an engine's KV cache holds, at most that many run "
                  "at once; waves: ceil(seqs / slots); KV demand: the KV tokens the busiest "
                  "engine's sequences end at, over the tokens its cache holds (below 100 %, vLLM "
                  "would hold them all at once: the waves are the slots' worst case); bubble and "
                  "coverage count engines; rollout s: the slowest engine's rollout (no verify), "
                  "mean over the steps, in the calibrated engine's costs")


def describe(result: Mapping) -> list[str]:
    """The assumptions of the run, one line each."""
    cal, grid = result["calibration"], result["grid"]
    s = grid["setting"]
    return [
        f"calibrated from `{cal['source']['bench']}`"
        + (f" and `{', '.join(cal['source']['engine'])}`" if cal['source']['engine'] else "")
        + f" (engine `{cal['source']['engine_name']}`)",
        *cal["notes"],
        f"grid: {s['samples_per_rank']} samples per rank, prompt {s['prompt_len']} tokens, "
        f"response budget = context - prompt, draft budget {grid['draft_budget']}, "
        f"acceptance per token {s['accept_prob']:.4g}, rank timing noise (log-sd) "
        f"{s['jitter']:.3g}, {s['draft_concurrency']} drafts in flight, chunk {s['draft_chunk']}, "
        + (f"claims paced at {s['draft_prefill_tokens']} prefill tokens per engine step, "
           if s.get('draft_prefill_tokens') else "")
        + (f"continuation k {s['continuation_k']}: accepted tokens per decode step "
           f"{s['continuation_gain_past']:.3g} past a draft's end, "
           + ("re-aligned at the per-token acceptance"
              if s['continuation_gain_diverged'] is None
              else f"{s['continuation_gain_diverged']:.3g}") + " after a divergence"
           if s['continuation_k'] else "no continuation"),
        f"lengths: {grid['lengths']}",
        f"{grid['steps']} steps x {grid['seeds']} seeds per point; cost ratios over steps >= 1",
        *_layout_lines(result),
    ]


def _layout_lines(result: Mapping) -> list[str]:
    """The KV arithmetic of each simulated layout, and the layouts left out."""
    grid = result["grid"]
    if not grid.get("layouts"):
        return []
    r0, alpha = result["calibration"]["costs"]["engine_tp"], grid["setting"]["tp_alpha"]
    lines = [f"layouts of `{grid['model']}` on {grid['gpu_memory_gb']:g} GB GPUs; an engine of "
             f"r GPUs runs in the measured engine's time x ({r0} / r)^{alpha:g} (an assumed TP "
             "scaling, not measured)"]
    for layout in grid["layouts"]:
        c = layout["capacity"]
        lines.append(
            f"{layout['name']}, rollout TP {layout['engine_tp']}, {layout['engines_per_replica']} "
            f"engines per replica: {c['engine_bytes'] / 1e9:.1f} GB per GPU - weights "
            f"{c['weight_bytes'] / 1e9:.2f} - overhead {c['overhead_bytes'] / 1e9:.1f} = KV "
            f"{c['kv_bytes'] / 1e9:.2f} GB at {c['kv_bytes_per_token']:,.0f} B a token = "
            f"{c['tokens']:,} tokens = {layout['kv_slots']} sequences of {c['max_model_len']:,}")
    return lines + list(grid["layout_notes"])


def _caption(result: Mapping) -> str:
    if result["grid"].get("layouts"):
        return PREDICTION_CAPTION + "; " + LAYOUT_CAPTION
    return PREDICTION_CAPTION


def print_result(result: Mapping, console: Console | None = None) -> None:
    if console is None:
        console = Console()
        if not console.is_terminal:    # piped: do not cut the tables at 80 columns
            console = Console(width=160)
    console.print(_rich_table("Calibration check: simulator at the measured setting vs the bench",
                              *check_table(result["check"]), CHECK_CAPTION))
    console.print(_rich_table("Predicted BubbleSpec effect (simulated)",
                              *prediction_table(result["predictions"]), _caption(result)))
    for line in describe(result):
        console.print(f"[dim]{line}[/dim]")


def markdown(result: Mapping) -> str:
    return "\n".join([
        "# BubbleSpec at scale: simulated", "",
        *[f"- {line}" for line in describe(result)], "",
        "## Calibration check", "", CHECK_CAPTION + ".", "",
        _markdown_table(*check_table(result["check"])), "",
        "## Predictions", "", _caption(result) + ".", "",
        _markdown_table(*prediction_table(result["predictions"])), "",
    ])


def _line(p: Mapping) -> tuple:
    return (p["context"], p.get("layout", ""), p.get("engine_tp", 0))


def _line_label(line: tuple) -> str:
    context, layout, tp = line
    return f"{_context(context)} context" + (f", {layout} TP {tp}" if layout else "")


def plot(result: Mapping, path: Path) -> None:
    """Three panels against DP ranks, one line per context (and rollout layout): bubble off,
    decode steps ratio (with its ceiling dashed, where the rows carry it), rollout speedup with
    verify."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import PercentFormatter

    predictions = result["predictions"]
    fig = Figure(figsize=(13, 4))
    FigureCanvasAgg(fig)
    panels = (("bubble ratio, BubbleSpec off", "bubble_ratio_off"),
              ("decode steps on / off (dashed: ceiling)", "decode_steps_ratio"),
              ("rollout speedup incl. verify", "throughput_ratio_with_verify"))
    for i, (title, key) in enumerate(panels):
        ax = fig.add_subplot(1, 3, i + 1)
        for line_key in sorted({_line(p) for p in predictions}):
            mine = [p for p in predictions if _line(p) == line_key]
            points = sorted((p["ranks"], p[key]) for p in mine)
            line, = ax.plot([r for r, _ in points],
                            [v if v is not None else math.nan for _, v in points],
                            marker="o", label=_line_label(line_key))
            if key == "decode_steps_ratio" and all("decode_steps_ratio_ceiling" in p
                                                   for p in predictions):
                ceiling = sorted((p["ranks"], p["decode_steps_ratio_ceiling"]) for p in mine)
                ax.plot([r for r, _ in ceiling], [v for _, v in ceiling], linestyle="--",
                        color=line.get_color(), alpha=0.7)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("data-parallel ranks")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if key == "bubble_ratio_off":
            ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    fig.axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write(result: Mapping, out_dir: str | Path) -> list[Path]:
    """simulate.json, simulate.md and simulate.png under ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "simulate.json", out / "simulate.md", out / "simulate.png"]
    paths[0].write_text(to_json(result, indent=1) + "\n")
    paths[1].write_text(markdown(result))
    plot(result, paths[2])
    return paths
