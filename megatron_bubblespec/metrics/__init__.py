"""Metrics: per-rank step metrics -> step records (one registry) -> JSONL + TensorBoard, progress, summary."""

from megatron_bubblespec.metrics.aggregate import aggregate_step, decode_steps_plain
from megatron_bubblespec.metrics.progress import RunProgress
from megatron_bubblespec.metrics.plots import plot_run
from megatron_bubblespec.metrics.registry import METRICS, run_totals
from megatron_bubblespec.metrics.summary import print_summary, summary_table
from megatron_bubblespec.metrics.writer import MetricsWriter, json_safe, read_metrics, to_json

__all__ = [
    "METRICS",
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
