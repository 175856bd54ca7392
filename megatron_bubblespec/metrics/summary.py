"""Run summary: step records -> a rich table (one row per step, a whole-run row) on the console."""

from __future__ import annotations

from typing import Mapping, Sequence

from rich import box
from rich.console import Console
from rich.table import Table

from megatron_bubblespec.metrics.formatting import value
from megatron_bubblespec.metrics.registry import SUMMARY_COLUMNS, engine_key, run_totals

Record = Mapping[str, object]


def slowest_engine(record: Record) -> str:
    """The engine the step waited for: the largest per-engine rollout time (``rank{e}/...``)."""
    engines = int(record.get("rollout/engines") or 0)
    times = {e: record[engine_key(e, "rollout/time_s")] for e in range(engines)
             if record.get(engine_key(e, "rollout/time_s")) is not None}
    return str(max(times, key=times.get)) if times else "-"


def summary_table(records: Sequence[Record]) -> Table:
    """One row per step and a last row of whole-run values (``metrics.registry.run_totals``)."""
    engines = max((int(r.get("rollout/engines") or 0) for r in records), default=0)
    where = f", {engines} rollout engines" if engines else ""
    table = Table(title=f"BubbleSpec run summary ({len(records)} steps{where})",
                  caption="drafts / accept tok: drafted / accepted tokens; bubble: idle share of "
                          "engine rollout time; util: drafting share of the bubble",
                  box=box.SIMPLE_HEAD, padding=0, show_edge=False)
    table.add_column("step", justify="right", style="bold", no_wrap=True)
    for metric in SUMMARY_COLUMNS:
        table.add_column(metric.header, justify="right", no_wrap=True)
    for r in records:
        table.add_row(str(r.get("step", "?")),
                      *(m.fmt(value(r, m.name)) for m in SUMMARY_COLUMNS))
    totals = run_totals(records)
    table.add_section()
    table.add_row("all", *(m.fmt(totals[m.name]) for m in SUMMARY_COLUMNS), style="bold")
    return table


def print_summary(records: Sequence[Record], console: Console | None = None) -> None:
    """Print :func:`summary_table` of ``records`` to ``console`` (a new stdout Console if None),
    then, with several engines, the engine each step waited for."""
    console = console or Console()
    console.print(summary_table(records))
    if any((r.get("rollout/engines") or 0) > 1 for r in records):
        console.print("slowest engine by step (what the step waited for): " + ", ".join(
            f"{r.get('step', '?')}: {slowest_engine(r)}" for r in records))
