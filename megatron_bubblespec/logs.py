"""Third-party warnings and log records of a process -> the run's log file (known-harmless ones) or the terminal.

A first run should show the run's own lines, not the libraries' start-up chatter. Per process (the
launcher and every rank), ``route_third_party_output(run_dir)`` sends

* Python warnings listed in ``HARMLESS_WARNINGS`` (Megatron without Transformer Engine / Apex,
  deprecations inside vLLM and Megatron) to ``run_dir/logs/<process>.log``; every other warning,
  the project's own included, still reaches the terminal;
* log records of the libraries (vLLM, Megatron, torch, transformers, and records that reach the
  root logger with no handler) to the same file; ERROR and above also to the terminal;

and ``quiet_native_warnings()`` (before torch is imported, inherited by the ranks) keeps the C++
side's warnings (c10's NUMA and thread notices) off the terminal; those cannot be redirected from
Python and are dropped. ``BUBBLESPEC_VERBOSE=1`` (``bubblespec train --verbose``) turns all of it
off: everything goes to the terminal as the libraries print it.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from pathlib import Path

VERBOSE_ENV = "BUBBLESPEC_VERBOSE"
LOG_DIR = "logs"
# (library, pattern of the message): warnings that say nothing a user must act on.
HARMLESS_WARNINGS = (
    ("megatron", r"Transformer Engine and Apex are not installed"),
    ("megatron", r"Apex is not installed"),
    ("megatron", r"full scope is deprecated"),
    ("vllm", r"`torch\.distributed\.reduce_op` is deprecated"),
    ("torch", r"`torch\.distributed\.reduce_op` is deprecated"),
)
THIRD_PARTY_LOGGERS = ("vllm", "megatron", "torch", "transformers", "accelerate", "gguf")

_routed: Path | None = None


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def quiet_native_warnings() -> None:
    """Unless verbose: c10 (torch's C++ core) logs errors only, in this process and the ranks it
    starts. Takes effect only before torch is first imported."""
    if not verbose():
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def log_file(run_dir: str | Path) -> Path:
    """This process's log file: ``logs/rank<R>.log`` on a rank, ``logs/launcher.log`` else."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))
    return Path(run_dir) / LOG_DIR / (f"rank{rank}.log" if rank is not None else "launcher.log")


def _library(filename: str) -> str | None:
    parts = Path(filename).parts
    return next((lib for lib, _ in HARMLESS_WARNINGS if lib in parts), None)


def harmless(message, filename: str) -> bool:
    """Whether a warning raised in ``filename`` with ``message`` is on the known-harmless list."""
    library, text = _library(filename), str(message)
    return any(lib == library and re.search(pattern, text) for lib, pattern in HARMLESS_WARNINGS)


def route_third_party_output(run_dir: str | Path) -> Path | None:
    """Route this process's third-party warnings and log records (see the module docstring);
    returns the log file, or None when verbose. Calling it again is harmless."""
    global _routed
    if verbose():
        return None
    path = log_file(run_dir)
    if _routed == path:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    stream = open(path, "a", buffering=1, encoding="utf-8")   # lives as long as the process
    terminal_warning = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if harmless(message, filename):
            stream.write(warnings.formatwarning(message, category, filename, lineno, line))
        else:
            terminal_warning(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    to_file = logging.StreamHandler(stream)
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    errors = logging.StreamHandler(sys.stderr)
    errors.setLevel(logging.ERROR)
    for name in (*THIRD_PARTY_LOGGERS, ""):
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):    # libraries' own console handlers
            if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout,
                                                                                  sys.stderr):
                logger.removeHandler(handler)
        logger.addHandler(to_file)
        logger.addHandler(errors)
        logger.propagate = False
    logging.getLogger("vllm").setLevel(logging.INFO)      # its start-up facts, in the file
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")   # vLLM's records reach our handlers
    _routed = path
    return path
