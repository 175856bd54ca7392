"""Metrics: per-rank step metrics -> step records -> JSONL + TensorBoard, live progress, summary."""

from megatron_bubblespec.metrics.aggregate import aggregate_step, decode_steps_plain
from megatron_bubblespec.metrics.progress import RunProgress
from megatron_bubblespec.metrics.summary import (plot_run, print_summary, run_totals,
                                                 summary_table)
from megatron_bubblespec.metrics.writer import MetricsWriter, json_safe, read_metrics, to_json

__all__ = [
    "MetricsWriter",
    "RunProgress",
    "aggregate_step",
    "decode_steps_plain",
    "json_safe",
    "plot_run",
    "print_summary",
    "read_metrics",
    "run_totals",
    "summary_table",
    "to_json",
]
