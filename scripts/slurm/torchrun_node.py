#!/usr/bin/env python3
"""One node of a Slurm job: torchrun for this node's ranks, with preemption-aware signals and exit.

    srun ... python scripts/slurm/torchrun_node.py [--status-file F] [--pid-file P]
                                                   [--rdzv-host-node K] -- <torchrun args>

In every argument ``%n`` becomes this node's index (SLURM_NODEID) and ``%N`` its Slurm node name
(SLURMD_NODENAME), e.g. ``--log-dir=logs/node%n``. ``--pid-file`` records this process's pid: the
batch script sends its stop signal there, so that it reaches the ranks (through the forwarding
below) but not their helper processes (checkpoint writers, data loaders, engine processes), which
a signal to the whole job step would kill.

``--status-file`` reads ``running`` while this node's torchrun runs, ``signalled <SIG>`` once a
stop signal reached this launcher (alive: a preemption, or srun ending the step after another
node failed), and its exit code at the end. A node whose file still says ``running`` when the job
step has ended was killed or lost: that is how the batch script names a dead node.

``--rdzv-host-node K``: node K hosts the c10d rendezvous store (``--rdzv-conf=is_host=true``
there, ``false`` elsewhere). torchrun guesses the host by comparing the endpoint's name with the
machine's hostname and addresses, which fails where Slurm's node names are not the hostnames
(aliases, FQDNs, several emulated nodes on one machine): no node hosts the store and every node
waits for it until the rendezvous times out.

Plain torchrun is almost right for Slurm, but not quite:
- SIGUSR1 would kill the torchrun agent (it does not handle it), and on SIGTERM torchrun kills its
  workers itself. Here both signals are passed on to this node's ranks (the agent's child
  processes; each rank gets a signal once, when it has a handler for it, so that a rank still
  starting up is not killed by it) and the agent keeps running, so every rank can finish its
  step, write the checkpoint and leave with exit code 75 (EX_TEMPFAIL: "stopped at a
  checkpoint, run me again").
- torchrun tears the other ranks down (SIGTERM, then SIGKILL) as soon as one rank exits non-zero.
  A rank that exits with 75 is not failing, it is done: the other ranks get up to
  TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds to reach exit 75 on their own.
- torchrun turns any failed rank into exit code 1. Here: 0 when all ranks succeeded; when every
  rank that stopped early stopped with 75, the node wrote its checkpoint share, records "75" in
  the status file and exits 0 (so that ``srun --kill-on-bad-exit`` does not kill slower nodes
  that are still writing theirs; the batch script reads the status files); any other failure
  keeps its own exit code (128+N for a signal N), is printed with torchrun's root-cause summary,
  and makes srun end the whole step.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

EXIT_PREEMPTED = 75


def _children() -> list[int]:
    """Direct child processes of this process (torchrun starts its ranks with subprocess)."""
    me = os.getpid()
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == me:
            pids.append(int(d.name))
    return pids


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (its SigCgt mask in /proc)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


class _Forwarder:
    """Pass a stop signal on to each rank once, as soon as that rank handles it: a rank still
    importing (no handler yet) would be killed by it, so it gets the signal a little later."""

    def __init__(self, status_file: str | None = None):
        self.status_file = status_file
        self.pending: set[int] = set()
        self.delivered: set[tuple[int, int]] = set()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def __call__(self, signum, _frame) -> None:
        print(f"[torchrun_node {os.environ.get('SLURM_NODEID', '?')}] got "
              f"{signal.Signals(signum).name}: passing it to the ranks {_children()}",
              file=sys.stderr, flush=True)
        with self.lock:
            self.pending.add(signum)
        if self.status_file and Path(self.status_file).read_text().strip() == "running":
            _write_status(self.status_file, f"signalled {signal.Signals(signum).name}")
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="signal-forwarder", daemon=True)
            self.thread.start()

    def _deliver(self) -> bool:
        """One pass; True when every current rank got every pending signal."""
        children = _children()
        with self.lock:
            pending = set(self.pending)
        done = bool(children)
        for pid in children:
            for sig in pending:
                if (pid, sig) in self.delivered:
                    continue
                if _catches(pid, sig):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
                    self.delivered.add((pid, sig))
                else:
                    done = False
        return done

    def _run(self) -> None:
        while True:
            self._deliver()
            time.sleep(0.2)  # ranks that handle the signal only later, or start later


def _let_checkpointed_ranks_finish() -> None:
    """Patch torchrun's process poll: while every rank that has ended so far ended with exit 75
    and others are still running, keep waiting instead of killing them (bounded by
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT). Any other failure still ends the node at once."""
    try:
        from torch.distributed.elastic.multiprocessing.api import SubprocessContext
    except ImportError:
        return
    if not all(hasattr(SubprocessContext, a) for a in ("_poll", "_capture_process_failures")):
        print("[torchrun_node] this torch's SubprocessContext differs; ranks that stop at a "
              "checkpoint may be torn down by torchrun", file=sys.stderr)
        return
    original = SubprocessContext._poll
    grace_s = float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))
    first_stop: list[float] = []

    def _poll(self):
        done: set[int] = set()
        self._capture_process_failures(done)
        self._running_local_ranks.difference_update(done)
        failures = getattr(self, "_failures", {})
        if (failures and self._running_local_ranks
                and all(f.exitcode == EXIT_PREEMPTED for f in failures.values())):
            if not first_stop:
                first_stop.append(time.monotonic())
            if time.monotonic() - first_stop[0] < grace_s:
                return None
        return original(self)

    SubprocessContext._poll = _poll


def _write_status(path: str | None, code: int | str) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(f"{code}\n")


def main(argv: list[str]) -> int:
    options = {"--status-file": None, "--pid-file": None, "--rdzv-host-node": None}
    while argv and argv[0] in options:
        options[argv[0]], argv = argv[1], argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    node, name = os.environ.get("SLURM_NODEID", "0"), os.environ.get("SLURMD_NODENAME", "local")

    def expand(text: str) -> str:
        return text.replace("%n", node).replace("%N", name)

    argv = [expand(a) for a in argv]
    status_file = expand(options["--status-file"]) if options["--status-file"] else None
    _write_status(status_file, "running")
    forward = _Forwarder(status_file)
    signal.signal(signal.SIGUSR1, forward)
    signal.signal(signal.SIGTERM, forward)
    if options["--pid-file"]:  # where the batch script sends its stop signal
        pid_file = Path(expand(options["--pid-file"]))
        pid_file.parent.mkdir(parents=True, exist_ok=True)
        pid_file.write_text(f"{os.getpid()}\n")
    # torchrun must not install its own SIGTERM handler over ours (it would kill the ranks).
    argv = ["--signals-to-handle", "SIGINT,SIGHUP,SIGQUIT", *argv]
    if options["--rdzv-host-node"] is not None:
        hosts = "true" if options["--rdzv-host-node"] == node else "false"
        argv = [f"--rdzv-conf=is_host={hosts}", *argv]   # a later --rdzv-conf still wins

    _let_checkpointed_ranks_finish()
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
        code = 0
    except ChildFailedError as err:
        codes = {rank: f.exitcode for rank, f in err.failures.items()}
        if all(c == EXIT_PREEMPTED for c in codes.values()):
            print(f"[torchrun_node {os.environ.get('SLURM_NODEID', '?')}] ranks {sorted(codes)} "
                  f"stopped at a checkpoint (exit {EXIT_PREEMPTED})", file=sys.stderr, flush=True)
            _write_status(status_file, EXIT_PREEMPTED)
            return 0
        print(err.format_msg(), file=sys.stderr, flush=True)
        bad = next(c for c in codes.values() if c != EXIT_PREEMPTED)
        code = 128 - bad if bad < 0 else (bad or 1)
    except SignalException as err:
        code = 128 + int(err.sigval)
    _write_status(status_file, code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
