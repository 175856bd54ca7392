"""Each rank's (step, stage) -> ``<run>/heartbeat/rank<R>.json``, a stall watchdog, and the
preemption flag that SIGUSR1 / SIGTERM / SIGINT raise.

The heartbeat file is what a dead or hung rank leaves behind: the launcher names the stage it died
in, and the Slurm watchdog reads the files' modification times. The in-process watchdog ends the
rank (exit ``EXIT_STALLED``) with a message naming the rank, step and stage when no stage has
ended for ``stall_timeout_s``. A preemption signal only sets a flag; the loop checks it between
steps, writes a checkpoint and exits with ``EXIT_PREEMPTED`` so the job can be requeued.

A rank blocked inside a collective or an engine start-up never returns to the Python loop, so it
would never see the flag, and a Python signal handler does not even run while the main thread sits
in C++. SIGTERM and SIGINT therefore also arm a grace timer on a thread of their own (the signal
reaches it through ``signal.set_wakeup_fd``, which the C-level handler writes at once): if the rank
has not exited ``grace_s`` seconds later, it prints where it was stuck and exits ``128 + signal``.
SIGUSR1 (Slurm's advance warning) arms no timer: the job has time to reach its checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

EXIT_PREEMPTED = 75   # EX_TEMPFAIL: checkpoint written, requeue me
EXIT_STALLED = 70     # the watchdog saw no progress

PREEMPTION_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)    # these also arm the grace timer


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

    def describe(self) -> str:
        """Where this rank is: 'rank R, stage S of step T' (for messages)."""
        return f"rank {self.rank}, stage {self.stage!r} of step {self.step}"

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
    """Set by SIGUSR1 / SIGTERM / SIGINT (Slurm's warning before a time limit or preemption, a
    stop request); SIGTERM / SIGINT also end the rank ``grace_s`` seconds later if it is stuck.

    ``where`` describes the rank's position for the message (e.g. the heartbeat's step and stage).
    """

    def __init__(self, grace_s: float = 0.0, where=lambda: "an unknown stage"):
        self.signal: int | None = None
        self.grace_s, self.where = grace_s, where
        self._previous = {}
        self._wakeup = None
        self._previous_wakeup_fd = -1
        self._stop = threading.Event()

    def install(self) -> "PreemptionFlag":
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in PREEMPTION_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        if self.grace_s > 0:
            reader, writer = socket.socketpair()
            writer.setblocking(False)
            self._wakeup = (reader, writer)
            self._previous_wakeup_fd = signal.set_wakeup_fd(writer.fileno(),
                                                            warn_on_full_buffer=False)
            threading.Thread(target=self._watch, args=(reader,), name="bubblespec-signal-grace",
                             daemon=True).start()
        return self

    def uninstall(self) -> None:
        self._stop.set()
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._previous_wakeup_fd)
            self._wakeup[1].close()   # wakes the watcher: it returns
            self._wakeup = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, _frame) -> None:
        self.signal = signum

    def _watch(self, reader: socket.socket) -> None:
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data or self._stop.is_set():
                return
            stops = [b for b in data if b in STOP_SIGNALS]
            if stops:
                break
        signum = stops[0]
        if self._stop.wait(self.grace_s):
            return   # the rank reached a safe point and is exiting on its own
        name = signal.Signals(signum).name
        print(f"bubblespec: {name} received, but the rank did not reach a safe point within "
              f"{self.grace_s:g} s (run.signal_grace_s): it is stuck in {self.where()}. Ending "
              "it now, without a checkpoint.", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    @property
    def raised(self) -> bool:
        return self.signal is not None
