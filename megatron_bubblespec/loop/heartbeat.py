"""Each rank's (step, stage) -> ``<run>/heartbeat/rank<R>.json``, a stall watchdog, and the
preemption flag that SIGUSR1 / SIGTERM raise.

The heartbeat file is what a dead or hung rank leaves behind: the launcher names the stage it died
in, and the Slurm watchdog reads the files' modification times. The in-process watchdog ends the
rank (exit ``EXIT_STALLED``) with a message naming the rank, step and stage when no stage has
ended for ``stall_timeout_s``. A preemption signal only sets a flag; the loop checks it between
steps, writes a checkpoint and exits with ``EXIT_PREEMPTED`` so the job can be requeued.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

EXIT_PREEMPTED = 75   # EX_TEMPFAIL: checkpoint written, requeue me
EXIT_STALLED = 70     # the watchdog saw no progress

PREEMPTION_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class Heartbeat:
    """This rank's progress record, and (if ``stall_timeout_s`` > 0) its no-progress watchdog."""

    def __init__(self, directory: str | Path, rank: int, stall_timeout_s: float = 0.0):
        self.path = Path(directory) / f"rank{rank}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank, self.stall_timeout_s = rank, stall_timeout_s
        self.step, self.stage = -1, "start"
        self._last = time.monotonic()
        self._stop = threading.Event()
        self.beat(-1, "start")
        if stall_timeout_s > 0:
            threading.Thread(target=self._watch, name="bubblespec-watchdog", daemon=True).start()

    def beat(self, step: int, stage: str) -> None:
        """Record that ``stage`` of ``step`` begins now (atomic rewrite of the file)."""
        self.step, self.stage, self._last = step, stage, time.monotonic()
        record = {"rank": self.rank, "pid": os.getpid(), "step": step, "stage": stage,
                  "time": time.time()}
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.path)

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        period = min(5.0, max(0.1, self.stall_timeout_s / 10))
        while not self._stop.wait(period):
            idle = time.monotonic() - self._last
            if idle > self.stall_timeout_s:
                print(f"bubblespec: rank {self.rank} made no progress for {idle:.0f} s "
                      f"(run.stall_timeout_s={self.stall_timeout_s:g}) in stage {self.stage!r} of "
                      f"step {self.step}; a peer rank is probably dead or hung. Ending the job.",
                      file=sys.stderr, flush=True)
                os._exit(EXIT_STALLED)


def read_heartbeat(directory: str | Path, rank: int) -> dict | None:
    """Rank ``rank``'s last heartbeat record, or None."""
    try:
        return json.loads((Path(directory) / f"rank{rank}.json").read_text())
    except (OSError, ValueError):
        return None


class PreemptionFlag:
    """Set by SIGUSR1 / SIGTERM (Slurm's warning before a time limit or preemption)."""

    def __init__(self):
        self.signal: int | None = None
        self._previous = {}

    def install(self) -> "PreemptionFlag":
        if threading.current_thread() is threading.main_thread():
            for sig in PREEMPTION_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, _frame) -> None:
        self.signal = signum

    @property
    def raised(self) -> bool:
        return self.signal is not None
