"""Rank 0's record of a run: each step's outputs -> its step record and responses -> the run
directory (metrics.jsonl, rollouts.jsonl, TensorBoard) and the progress display; at the end the
summary table and the plot."""

from __future__ import annotations

from typing import Sequence

from megatron_bubblespec.config import Config
from megatron_bubblespec.loop.run_dir import RunDir
from megatron_bubblespec.metrics import RunProgress, aggregate_step, plot_run, print_summary


class RunLog:
    """Opened at the run's start step: writes the config, keeps the records and rollouts of the
    steps before it (a resumed run) and cuts the files back to them."""

    def __init__(self, cfg: Config, run: RunDir, start_step: int):
        self.cfg, self.run = cfg, run
        run.write_config(cfg)
        self.records, self.rollouts = run.restart_at(start_step)
        self.writer = run.metrics_writer(tensorboard=cfg.logging.tensorboard)
        self.progress = RunProgress(cfg.run.steps) if cfg.logging.progress else None
        if self.progress:
            self.progress.__enter__()

    def log_step(self, step: int, outputs: Sequence) -> dict:
        """The step's engine outputs (``loop.step.gather_step``) -> its record, written."""
        record = aggregate_step(step, [o.rank_metrics for o in outputs])
        record.update(outputs[0].global_metrics)
        self.records.append(record)
        self.writer.write(record)
        responses = {g: t for o in outputs for g, t in o.rollouts.items()}
        self.rollouts.append(responses)
        self.run.append_rollouts(step, responses)
        if self.progress:
            self.progress.update(step, record)
        return record

    def close(self) -> None:
        if self.progress:
            self.progress.__exit__(None, None, None)
        self.writer.close()

    def summarize(self) -> None:
        """The summary table (and the plot) of the finished run."""
        print_summary(self.records)
        if self.cfg.logging.plot:
            plot_run(self.records, self.run.plot)
        print(f"run directory: {self.run.path} (metrics.jsonl, rollouts.jsonl, final/, "
              "tensorboard/, bubblespec.png)")
