"""Local launcher: a Python function -> N processes on this machine, each with its rank's environment.

The torchrun-style entry for laptops, CI and tests: every rank gets RANK / WORLD_SIZE / LOCAL_RANK /
MASTER_ADDR / MASTER_PORT, runs ``fn(*args)`` and its return value comes back to the caller in
rank order. A rank that raises ends the whole launch with that rank's traceback; a rank that exits
or is killed ends it with ``RankFailure`` naming the rank (the other ranks are stopped within
``2 * PEER_FAILURE_GRACE_S``, not left waiting in a collective). SIGUSR1 / SIGTERM / SIGINT sent
to the launcher are forwarded to the ranks (preemption: they checkpoint and exit; a rank stuck in
a collective ends itself after its grace period, naming the stage).

Ranks start from multiprocessing's fork server, preloaded with torch, megatron-core and vLLM
(``PRELOAD``, the module ``loop.preload``, named here and imported only by the fork server): a
rank no longer spends its first ~20 s of CPU importing them. With a CUDA device, or with
``BUBBLESPEC_START_METHOD=spawn``, every rank is spawned afresh instead.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import tempfile
import threading
from pathlib import Path

import torch.multiprocessing as mp

FORWARDED_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
START_METHOD_ENV = "BUBBLESPEC_START_METHOD"
PRELOAD = "megatron_bubblespec.loop.preload"
# A rank whose peer died waits in a collective no one else will join, and no checkpoint can
# complete without the dead rank: the survivors get this long to end, as long again after SIGTERM,
# then SIGKILL (torch's default is 30 s after SIGTERM, which a rank reads as preemption: it waits
# for a step boundary that never comes). The last complete checkpoint stands.
PEER_FAILURE_GRACE_S = 1.0


class RankFailure(RuntimeError):
    """A rank exited with a non-zero code or was killed by a signal."""

    def __init__(self, message: str, rank: int, exit_code: int, signal_name: str | None = None):
        super().__init__(message)
        self.rank, self.exit_code, self.signal_name = rank, exit_code, signal_name


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank: int, fn, world_size: int, port: int, outdir: str, env: dict, args: tuple):
    for stop in (signal.SIGUSR1, signal.SIGTERM):   # the fork server ignores them (loop.preload)
        signal.signal(stop, signal.SIG_DFL)
    os.environ.update(env)
    if "VLLM_LOGGING_LEVEL" in env:   # read when vLLM is imported, maybe before this rank began
        logging.getLogger("vllm").setLevel(env["VLLM_LOGGING_LEVEL"])
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    result = fn(*args)
    with open(Path(outdir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)


def launch_local(fn, world_size: int, *args, env: dict | None = None) -> list:
    """Run ``fn(*args)`` in ``world_size`` new processes; return their results by rank.

    ``fn`` must be importable (a module-level function). ``env`` adds environment variables
    (threads per rank default to 1: on a small machine oversubscription costs more than it gives).
    """
    rank_env = {"OMP_NUM_THREADS": "1"}
    rank_env.update(env or {})
    start_resource_tracker_deaf_to_usr1()
    with tempfile.TemporaryDirectory(prefix="bubblespec-launch-") as outdir:
        context = mp.start_processes(_rank_entry, args=(fn, world_size, free_port(), outdir,
                                                        rank_env, args),
                                     nprocs=world_size, join=False,
                                     start_method=_start_method())
        previous = forward_signals([p.pid for p in context.processes])
        try:
            while not context.join(timeout=0.5, grace_period=PEER_FAILURE_GRACE_S):
                pass
        except mp.ProcessExitedException as err:
            how = f"signal {err.signal_name}" if err.signal_name else f"exit code {err.exit_code}"
            raise RankFailure(f"rank {err.error_index} (pid {err.error_pid}) ended with {how}; "
                              "the other ranks were stopped", err.error_index, err.exit_code,
                              err.signal_name) from None
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        results = []
        for rank in range(world_size):
            with open(Path(outdir) / f"rank{rank}.pkl", "rb") as f:
                results.append(pickle.load(f))
    return results


def _start_method() -> str:
    """``forkserver`` preloaded with the ranks' libraries, or ``spawn`` (see the module doc)."""
    import torch

    method = os.environ.get(START_METHOD_ENV) or ("spawn" if torch.cuda.is_available()
                                                   else "forkserver")
    if method not in ("spawn", "forkserver"):
        raise ValueError(f"{START_METHOD_ENV}={method!r}: use spawn or forkserver")
    if method == "forkserver":
        mp.set_forkserver_preload([PRELOAD])
    return method


def start_resource_tracker_deaf_to_usr1() -> None:
    """Start multiprocessing's resource tracker with SIGUSR1 ignored.

    The tracker is in the job's process group, so a SIGUSR1 sent to the whole job reaches it too.
    It ignores only SIGINT and SIGTERM, so SIGUSR1 killed it, and the ranks relaunched it while
    they stopped at the checkpoint. An ignored signal stays ignored across the tracker's exec.
    A tracker already running is kept as it is.
    """
    from multiprocessing import resource_tracker

    if threading.current_thread() is not threading.main_thread():
        resource_tracker.ensure_running()
        return
    previous = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        resource_tracker.ensure_running()
    finally:
        signal.signal(signal.SIGUSR1, previous)


def forward_signals(pids: list[int]) -> dict:
    """Relay preemption signals from this process to the ranks; return the old handlers."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def forward(signum, _frame):
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    return {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
