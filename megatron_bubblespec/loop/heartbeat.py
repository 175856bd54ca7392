"""Each rank's (step, stage) -> ``<run>/heartbeat/rank<R>.json``, a stall watchdog, and the
preemption flag that SIGUSR1 / SIGTERM / SIGINT raise.

The heartbeat file is what a dead or hung rank leaves behind: the launcher names the stage it died
in, and the Slurm watchdog reads the files' modification times. The in-process watchdog ends the
rank (exit ``EXIT_STALLED``) with a message naming the rank, step and stage when no stage has
ended for ``stall_timeout_s``. A preemption signal only sets a flag; the loop checks it between
steps, writes a checkpoint and exits with ``EXIT_PREEMPTED`` so the job can be requeued.

A rank blocked inside a collective or an engine start-up never returns to the Python loop, so it
would never see the flag, and a Python signal handler does not even run while the main thread sits
in C++. SIGTERM and SIGINT therefore also start a watcher on a thread of its own (the signal
reaches it through ``signal.set_wakeup_fd``, which the C-level handler writes at once). From then
on a rank counts as making progress while a new stage begins or its main thread works (uses CPU
time, is runnable or waits for the disk; a rank waiting in a collective or a rendezvous sleeps);
about once a second it notes its progress in its heartbeat file, so that a rank waiting for a busy
peer is not taken for a stuck one. The watcher ends the rank with ``128 + signal``, saying where
it was, what is lost and the exit status:

* when for ``grace_s`` (run.signal_grace_s) neither this rank nor any peer made progress (stuck),
  except while the rank writes its checkpoint (a rank that finished its shards waits for the
  others there);
* when ``limit_s`` (run.checkpoint_grace_s) after the signal the rank, although making progress,
  has not finished its step and its checkpoint.

Once the checkpoint is complete, a rank that does not finish shutting down is ended with
``EXIT_PREEMPTED`` instead (nothing is lost). SIGUSR1 (Slurm's advance warning) starts no watcher:
the job has time to reach its checkpoint.
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
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)    # these also start the stop watcher
STEP_STAGES = ("verify", "rollout", "bubble", "learn", "reshard")   # inside a step (loop.step)
FINISHED_STAGES = ("log", "checkpoint")           # the step is done (loop.train)
# The main thread works when it uses this share of a core over a check period, or is runnable (or
# waits for the disk) at two checks in a row, as a starved computing thread is; one waiting in a
# collective or polling a rendezvous sleeps between short wake-ups (a few % of a core).
BUSY = 0.25


class Heartbeat:
    """This rank's progress record, and (if ``stall_timeout_s`` > 0) its no-progress watchdog."""

    def __init__(self, directory: str | Path, rank: int, stall_timeout_s: float = 0.0):
        self.path = Path(directory) / f"rank{rank}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank, self.stall_timeout_s = rank, stall_timeout_s
        self.step, self.stage = -1, "start"
        self.beats = 0                   # stages begun so far (a watcher compares counts)
        self._last, self._beat_time = time.monotonic(), time.time()
        self._progress: float | None = None   # wall time of the last noted progress, once signalled
        self._stop = threading.Event()
        self._write_lock = threading.Lock()
        self.beat(-1, "start")
        if stall_timeout_s > 0:
            threading.Thread(target=self._watch, name="bubblespec-watchdog", daemon=True).start()

    def beat(self, step: int, stage: str) -> None:
        """Record that ``stage`` of ``step`` begins now (atomic rewrite of the file)."""
        self.step, self.stage, self._last, self._beat_time = step, stage, time.monotonic(), \
            time.time()
        self.beats += 1
        self._write()

    def note_progress(self) -> None:
        """Record in the file that this rank is making progress now (its stage unchanged)."""
        self._progress = time.time()
        self._write()

    def _write(self) -> None:
        record = {"rank": self.rank, "pid": os.getpid(), "step": self.step, "stage": self.stage,
                  "time": self._beat_time}
        if self._progress is not None:
            record["progress"] = self._progress
        with self._write_lock:     # the main thread's beats and a watcher's progress notes
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(record))
            os.replace(tmp, self.path)

    def peers_progressing(self, within_s: float) -> list[int]:
        """The other ranks whose heartbeat files show a stage begun or progress noted within the
        last ``within_s`` seconds (ranks of this run, sharing the directory)."""
        now, busy = time.time(), []
        for path in self.path.parent.glob("rank*.json"):
            if path == self.path:
                continue
            try:
                record = json.loads(path.read_text())
                last = max(float(record.get("time", 0)), float(record.get("progress") or 0))
            except (OSError, ValueError, TypeError, AttributeError):
                continue
            if now - last < within_s:
                busy.append(int(record.get("rank", -1)))
        return sorted(busy)

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


def lost_work(step: int, stage: str, checkpoints: list[tuple[int, Path]]) -> str:
    """What ending a rank in ``stage`` of ``step`` now loses, given the run's complete checkpoints
    ((completed steps, directory), oldest first: ``loop.checkpoint.complete_checkpoints``)."""
    done = step + 1 if stage in FINISHED_STAGES else step     # steps finished (-1: none ran)
    base, name = checkpoints[-1] if checkpoints else (0, None)
    since = (f"since the last complete checkpoint, {name.name}" if name is not None
             else "since the start: there is no complete checkpoint")
    if done > base:
        steps = f"step {base}" if done - base == 1 else f"steps {base}-{done - 1}"
        text = f"Lost: {steps}, finished {since}"
        if stage in STEP_STAGES:
            text += f", and the unfinished step {step}"
    elif stage in STEP_STAGES and step >= 0:
        text = f"Lost: the unfinished step {step} (nothing finished {since.split(':')[0]})"
    else:
        text = "Lost: no finished step (none ran after " + (
            f"{name.name})" if name is not None else "the start)")
    where = f"{name.name}, at step {base}" if name is not None else "step 0"
    return f"{text}. A restart with run.resume=auto begins at {where}."


def exit_status(signum: int) -> str:
    """What the scheduler sees when a rank ends itself after stop signal ``signum``."""
    name = signal.Signals(signum).name
    return (f"Exit status {128 + signum} (128 + {name}): srun, torchrun and Slurm see that status "
            f"(a stop with a complete checkpoint exits {EXIT_PREEMPTED}, which "
            "scripts/slurm/train.sbatch requeues).")


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 10 else f"{s:.0f} s"


class _ThreadClock:
    """CPU seconds used by the thread that created it (the process's, where the platform has
    no per-thread clock), and whether it is working now."""

    def __init__(self):
        try:
            self._clock = time.pthread_getcpuclockid(threading.get_ident())
            time.clock_gettime(self._clock)
        except (AttributeError, OSError):
            self._clock = None
        self._stat = Path(f"/proc/self/task/{threading.get_native_id()}/stat")

    def seconds(self) -> float:
        return time.process_time() if self._clock is None else time.clock_gettime(self._clock)

    def working(self) -> bool:
        """Running or waiting for a core (Linux: state R), as a computing thread is even on an
        overloaded machine, or waiting for the disk (D); a thread blocked in a collective or a
        rendezvous sleeps (S)."""
        try:
            return self._stat.read_text().rsplit(")", 1)[1].split()[0] in ("R", "D")
        except (OSError, IndexError):
            return False


class PreemptionFlag:
    """Set by SIGUSR1 / SIGTERM / SIGINT (Slurm's warning before a time limit or preemption, a
    stop request); after SIGTERM / SIGINT a watcher ends the rank if it gets stuck, or if it has
    not finished its step and checkpoint ``limit_s`` seconds after the signal (module docstring).

    ``where`` describes the rank's position for the message (the heartbeat's step and stage);
    ``heartbeat`` tells the watcher the rank's stage and beats and where its peers' files are;
    ``lost`` says what ending the rank now would lose (``lost_work``). The loop calls ``saved``
    once the preemption checkpoint is complete.
    """

    def __init__(self, grace_s: float = 0.0, where=lambda: "an unknown stage", *,
                 limit_s: float | None = None, heartbeat: Heartbeat | None = None,
                 lost=lambda: ""):
        self.signal: int | None = None
        self.grace_s, self.where = grace_s, where
        self.limit_s = grace_s if limit_s is None else limit_s
        self.heartbeat, self.lost = heartbeat, lost
        self.checkpoint: Path | None = None
        self._previous = {}
        self._wakeup = None
        self._previous_wakeup_fd = -1
        self._stop = threading.Event()
        self._clock: _ThreadClock | None = None

    def install(self) -> "PreemptionFlag":
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in PREEMPTION_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        if self.grace_s > 0:
            self._clock = _ThreadClock()      # the main thread's: it runs the loop
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

    def saved(self, checkpoint: Path) -> None:
        """The preemption checkpoint is complete: ending the rank from now on loses nothing."""
        self.checkpoint = Path(checkpoint)

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
        self._until_done(stops[0])

    def _until_done(self, signum: int) -> None:
        """After stop signal ``signum``: wait while the rank makes progress; end it when it is
        stuck or the limit has passed (returns if the rank exits on its own first)."""
        period = min(1.0, max(0.05, self.grace_s / 4))
        start = last_progress = time.monotonic()
        beats = self.heartbeat.beats if self.heartbeat else 0
        cpu, at, noted, runnable = self._clock.seconds(), start, start, False
        while not self._stop.wait(period):
            now, used = time.monotonic(), self._clock.seconds()
            runnable, was_runnable = self._clock.working(), runnable
            working = (used - cpu >= BUSY * (now - at) or (runnable and was_runnable)
                       or now - at > 3 * period)   # the watcher got no core itself: cannot tell
            cpu, at = used, now
            if (self.heartbeat and self.heartbeat.beats != beats) or working:
                last_progress = now
                if self.heartbeat:
                    beats = self.heartbeat.beats
                    if now - noted >= min(1.0, self.grace_s / 2):   # for the peers
                        self.heartbeat.note_progress()
                        noted = now
            idle = now - last_progress
            stage = self.heartbeat.stage if self.heartbeat else None
            writing = stage == "checkpoint" and self.checkpoint is None
            stuck = (idle >= self.grace_s and not writing
                     and not (self.heartbeat and self.heartbeat.peers_progressing(self.grace_s)))
            if stuck or now - start >= self.limit_s:
                self._end(signum, now - start, idle, stuck)
                return

    def _end(self, signum: int, since_signal: float, idle: float, stuck: bool) -> None:
        if self._stop.is_set():
            return   # the rank reached a safe point and is exiting on its own
        name = signal.Signals(signum).name
        if self.checkpoint is not None:
            print(f"bubblespec: {name} received {_seconds(since_signal)} ago; checkpoint "
                  f"{self.checkpoint} is complete, but the rank did not finish shutting down "
                  f"({self.where()}). Ending it now with {EXIT_PREEMPTED}; resume with "
                  "run.resume=auto.", file=sys.stderr, flush=True)
            os._exit(EXIT_PREEMPTED)
        if stuck:
            why = (f"{name} received, but the rank did not reach a safe point: no rank made "
                   f"progress for {_seconds(idle)} (run.signal_grace_s={self.grace_s:g}), it is "
                   f"stuck in {self.where()}")
        else:
            why = (f"{name} received {_seconds(since_signal)} ago; the rank was still making "
                   f"progress in {self.where()} (last {_seconds(idle)} ago), but did not finish "
                   f"its step and checkpoint within run.checkpoint_grace_s={self.limit_s:g} s")
        try:
            lost = self.lost()
        except Exception as error:       # the message must still come out
            lost = f"(what is lost is unknown: {type(error).__name__}: {error})"
        print(f"bubblespec: {why}. Ending it now, without a checkpoint. {lost} "
              f"{exit_status(signum)}", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    @property
    def raised(self) -> bool:
        return self.signal is not None
