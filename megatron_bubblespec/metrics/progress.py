"""Live progress: (step, step record) per training step -> a rich bar + status line, or log lines.

On a terminal: a progress bar over the run's steps with a one-line status of the last step under it.
Elsewhere (CI logs, Slurm output files): one plain line per step, no control characters.
"""

from __future__ import annotations

import time
from typing import Mapping

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.text import Text

from megatron_bubblespec.metrics.formatting import seconds, value
from megatron_bubblespec.metrics.registry import PROGRESS


def status_line(record: Mapping[str, object], step_s: float) -> str:
    """The registry's progress metrics (reward, bubble ratio, drafted / accepted tokens) and the
    wall time of one step, on one line."""
    shown = [f"{m.short} {m.fmt(value(record, m.name))}" for m in PROGRESS]
    return " | ".join([*shown, f"step {seconds(step_s)}"])


class _BarWithStatus(Progress):
    """A Progress that renders a status line below its bars."""

    status = Text("")

    def get_renderables(self):
        yield self.make_tasks_table(self.tasks)
        yield self.status


class RunProgress:
    """``with RunProgress(total_steps) as progress: ... progress.update(step, record)``.

    Step time is the wall time between consecutive updates (the first one counts from entering).
    """

    def __init__(self, total_steps: int, console: Console | None = None,
                 description: str = "training"):
        self.total_steps = total_steps
        self.console = console or Console()
        self.description = description
        self.done = 0
        self._bar: _BarWithStatus | None = None
        self._last: float | None = None

    def __enter__(self) -> "RunProgress":
        self._last = time.perf_counter()
        if self.console.is_terminal:
            self._bar = _BarWithStatus(
                SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(),
                MofNCompleteColumn(), TextColumn("steps"), TimeElapsedColumn(),
                TextColumn("eta"), TimeRemainingColumn(), console=self.console)
            self._bar.start()
            self._task = self._bar.add_task(self.description, total=self.total_steps)
        return self

    def update(self, step: int, record: Mapping[str, object]) -> None:
        """Show that ``step`` finished with the metrics of its step ``record``."""
        if self._last is None:
            raise RuntimeError("RunProgress.update called outside its `with RunProgress(...)` "
                               "block; enter it before the first step")
        now = time.perf_counter()
        step_s, self._last = now - self._last, now
        self.done += 1
        status = status_line(record, step_s)
        if self._bar is not None:
            self._bar.status = Text(f"step {step}: {status}")
            self._bar.update(self._task, completed=self.done)
        else:
            self.console.print(f"{self.description} step {step} [{self.done}/{self.total_steps}] "
                               f"| {status}", markup=False, highlight=False, soft_wrap=True)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        self._last = None
