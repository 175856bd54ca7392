"""Metrics: per-rank step metrics -> step records -> JSONL + TensorBoard, live progress, summary."""

from megatron_bubblespec.metrics.aggregate import aggregate_step, decode_steps_plain
from megatron_bubblespec.metrics.progress import RunProgress
from megatron_bubblespec.metrics.summary import (plot_run, print_summary, run_totals,
                                                 summary_table)
from megatron_bubblespec.metrics.writer import MetricsWriter, read_metrics

__all__ = [
    "MetricsWriter",
    "RunProgress",
    "aggregate_step",
    "decode_steps_plain",
    "plot_run",
    "print_summary",
    "read_metrics",
    "run_totals",
    "summary_table",
]
