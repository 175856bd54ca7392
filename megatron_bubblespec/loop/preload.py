"""The ranks' heavy imports, done once per launching process: torch, megatron-core, vLLM -> the
fork server's memory -> every locally launched rank, forked from it.

A freshly spawned rank imports torch, megatron-core and vLLM itself: about 20 s of CPU on a
2-core machine, most of a tiny run's time, and four ranks on two cores pay it twice over.
``launch_local`` therefore starts its ranks from multiprocessing's fork server, which imports this
module once, before it forks anything: each rank is a fork of a process that has imported the
libraries and run nothing else (no threads, no process group, no engine, no CUDA).

The imports see the environment a rank sets before it imports them
(``logs.quiet_native_warnings``, ``vllm_engine.prepare_environment``), and what they print goes to
/dev/null (unless ``BUBBLESPEC_VERBOSE`` is set): a rank routes its own output to
``<run>/logs/``. A failed import here only costs time (multiprocessing ignores it; the rank
imports the module itself).

The fork server shares the launcher's process group, so a signal sent to the whole job (Slurm's
SIGUSR1 / SIGTERM before the time limit, ``kill -- -PGID``) reaches it too; it ignores them (its
ranks get the launcher's forwarded signals, and it exits with the launcher). Each rank restores
the default actions first thing (``distributed.launch``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import warnings

from megatron_bubblespec import logs

MODULES = ("torch", "megatron.core", "megatron.core.pipeline_parallel", "megatron.core.optimizer",
           "megatron.core.models.gpt", "vllm", "vllm.v1.engine.llm_engine",
           "vllm.v1.sample.logits_processor")


@contextlib.contextmanager
def _silenced():
    """File descriptors 1 and 2 -> /dev/null, and no Python warnings, for the duration."""
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


def preload() -> None:
    logs.quiet_native_warnings()
    from megatron_bubblespec.rollout.vllm_engine import prepare_environment

    prepare_environment()
    with contextlib.nullcontext() if logs.verbose() else _silenced():
        for name in MODULES:
            __import__(name)


def _in_fork_server() -> bool:
    return sys.argv[:1] == ["-c"] and "multiprocessing.forkserver" in sys.modules


if _in_fork_server():   # the fork server imports this module by name: importing it is the preload
    for stop in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(stop, signal.SIG_IGN)
    preload()
