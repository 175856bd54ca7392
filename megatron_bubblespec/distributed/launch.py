"""Local launcher: a Python function -> N processes on this machine, each with its rank's environment.

The torchrun-style entry for laptops, CI and tests: every rank gets RANK / WORLD_SIZE / LOCAL_RANK /
MASTER_ADDR / MASTER_PORT, runs ``fn(*args)`` and its return value comes back to the caller in
rank order. A rank that raises ends the whole launch with that rank's traceback.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
from pathlib import Path

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank: int, fn, world_size: int, port: int, outdir: str, env: dict, args: tuple):
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    result = fn(*args)
    with open(Path(outdir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)


def launch_local(fn, world_size: int, *args, env: dict | None = None) -> list:
    """Run ``fn(*args)`` in ``world_size`` spawned processes; return their results by rank.

    ``fn`` must be importable (a module-level function). ``env`` adds environment variables
    (threads per rank default to 1: on a small machine oversubscription costs more than it gives).
    """
    rank_env = {"OMP_NUM_THREADS": "1"}
    rank_env.update(env or {})
    with tempfile.TemporaryDirectory(prefix="bubblespec-launch-") as outdir:
        mp.spawn(_rank_entry, args=(fn, world_size, free_port(), outdir, rank_env, args),
                 nprocs=world_size, join=True)
        results = []
        for rank in range(world_size):
            with open(Path(outdir) / f"rank{rank}.pkl", "rb") as f:
                results.append(pickle.load(f))
    return results
