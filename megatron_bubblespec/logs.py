"""Third-party warnings, log records and native output of a process -> the run's log file or (the ones that matter) the terminal.

A first run should show the run's own lines, not the libraries' start-up chatter. Per process (the
launcher and every rank), ``route_third_party_output(run_dir)`` sends

* Python warnings listed in ``HARMLESS_WARNINGS`` (Megatron without Transformer Engine / Apex,
  deprecations inside vLLM and Megatron) to ``run_dir/logs/<process>.log``; every other warning,
  the project's own included, still reaches the terminal;
* log records of the libraries (vLLM, Megatron, torch, transformers, and records that reach the
  root logger with no handler) to the same file; ERROR and above also to the terminal;
* on a rank, everything written to file descriptors 1 and 2 below Python (``route_native_output``:
  the C++ side's warnings such as c10's ``[W... utils.cpp] Warning: NUMA binding``, a C library's
  printf) to the same file, while the Python streams ``sys.stdout`` / ``sys.stderr`` (the run's
  own lines, its progress display, a Python traceback) keep the terminal through copies of the
  original descriptors;
* transformers' and the hub's progress bars nowhere (they are off).

The launcher's own descriptors stay on the terminal (its ranks inherit them as theirs);
``quiet_native_warnings()`` (``bubblespec train``, before torch is imported; the ranks inherit it)
lowers c10's log level to errors there and in the ranks, unless the user set
``TORCH_CPP_LOG_LEVEL`` (then the ranks' c10 output lands in their log files).
``BUBBLESPEC_VERBOSE=1`` (``bubblespec train --verbose``) turns all of it off: everything goes to
the terminal as the libraries print it.
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
    """Unless verbose: c10 (torch's C++ core) logs errors only and the hub's progress bars are
    off, in this process and the ranks it starts. Takes effect only before torch (and the hub)
    are first imported."""
    if not verbose():
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _rank() -> str | None:
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID"))


def log_file(run_dir: str | Path) -> Path:
    """This process's log file: ``logs/rank<R>.log`` on a rank, ``logs/launcher.log`` else."""
    rank = _rank()
    return Path(run_dir) / LOG_DIR / (f"rank{rank}.log" if rank is not None else "launcher.log")


def _terminal_stream(stream, fd: int):
    """A new text stream on a copy of ``fd`` in place of ``stream`` (the Python object on it), or
    ``stream`` itself when it does not write to ``fd`` (a test's capture, a redirected object)."""
    try:
        if stream is None or stream.fileno() != fd:
            return stream
    except (AttributeError, OSError, ValueError):
        return stream
    stream.flush()
    return open(os.dup(fd), "w", buffering=1, encoding=stream.encoding,
                errors=stream.errors or "strict")


def route_native_output(path: str | Path) -> None:
    """File descriptors 1 and 2 -> ``path`` (appended), for everything written below Python; the
    Python objects ``sys.stdout`` / ``sys.stderr`` move to copies of the original descriptors, so
    what Python code prints (and a Python traceback) still reaches the terminal. Call it once,
    before the libraries start threads that write to the descriptors (on a rank: first thing)."""
    sys.stdout = _terminal_stream(sys.stdout, 1)
    sys.stderr = _terminal_stream(sys.stderr, 2)
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(target, 1)
        os.dup2(target, 2)
    finally:
        os.close(target)


def tail(path: str | Path, lines: int = 8) -> list[str]:
    """The last ``lines`` lines of a log file (for a failure message), [] if there is none."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()][-lines:]


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
    if _rank() is not None:    # the launcher's descriptors are its ranks' terminal: left alone
        route_native_output(path)
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
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")   # read when the hub is imported
    if "transformers.utils.logging" in sys.modules:        # imported already: its own switch
        sys.modules["transformers.utils.logging"].disable_progress_bar()
    _routed = path
    return path
