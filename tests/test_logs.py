"""Known-harmless library warnings, library log records and a rank's native output (file
descriptors 1 and 2) go to the run's log file, the run's own lines and warnings, library errors
and a rank's traceback to the terminal; with the verbose switch everything stays on the terminal.
Each case runs in a fresh interpreter (routing changes process-wide state); the last one checks
the first screen of a real tiny run."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_bubblespec.loop.run_dir import RunDir

from conftest import TINY

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import logging, sys, warnings
    from megatron_bubblespec.logs import route_third_party_output
    print("routed to", route_third_party_output(sys.argv[1]), flush=True)
    warnings.warn_explicit("Apex is not installed. Falling back to Torch Norm", UserWarning,
                           "/venv/site-packages/megatron/core/models/backends.py", 21)
    warnings.warn_explicit("something new in megatron", UserWarning,
                           "/venv/site-packages/megatron/core/other.py", 7)
    warnings.warn("the run's own warning")
    logging.getLogger("vllm.engine").info("vllm start-up chatter")
    logging.getLogger("some.library").warning("a record with no handler of its own")
    logging.getLogger("vllm").error("a vllm error")
""")


def _run(tmp_path, **env):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "RANK": "3", **env})
    assert out.returncode == 0, out.stderr
    return out.stderr


@pytest.mark.slow   # starts a Python process
def test_harmless_library_output_goes_to_the_log_file(tmp_path):
    stderr = _run(tmp_path)
    log = RunDir(tmp_path).rank_log(3).read_text()
    assert "Apex is not installed" in log and "Apex" not in stderr
    assert "vllm start-up chatter" in log and "chatter" not in stderr
    assert "a record with no handler of its own" in log and "no handler" not in stderr
    assert "something new in megatron" in stderr and "something new" not in log
    assert "the run's own warning" in stderr
    assert "a vllm error" in stderr and "a vllm error" in log


@pytest.mark.slow   # starts a Python process
def test_verbose_keeps_everything_on_the_terminal(tmp_path):
    stderr = _run(tmp_path, BUBBLESPEC_VERBOSE="1")
    assert not RunDir(tmp_path).logs.exists()
    for text in ("Apex is not installed", "something new in megatron", "the run's own warning",
                 "a record with no handler of its own", "a vllm error"):
        assert text in stderr, text


# ----------------------------------------------------------------------------- native output

NATIVE = textwrap.dedent("""
    import ctypes, os, sys
    from megatron_bubblespec.logs import route_third_party_output
    route_third_party_output(sys.argv[1])
    os.write(1, b"native line on fd 1\\n")
    os.write(2, b"[W1201 utils.cpp:68] Warning: NUMA binding: a native warning on fd 2\\n")
    libc = ctypes.CDLL(None)
    libc.puts(b"printf from C")
    libc.fflush(None)
    print("the run's own line")
    print("the run's own warning line", file=sys.stderr)
    raise RuntimeError("a rank's crash")
""")


@pytest.mark.slow   # starts a Python process
def test_a_ranks_native_output_goes_to_its_log_and_python_output_to_the_terminal(tmp_path):
    out = subprocess.run([sys.executable, "-c", NATIVE, str(tmp_path)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "RANK": "1"})
    assert out.returncode == 1
    log = RunDir(tmp_path).rank_log(1).read_text()
    for native in ("native line on fd 1", "NUMA binding", "printf from C"):
        assert native in log and native not in out.stdout + out.stderr, native
    assert out.stdout == "the run's own line\n"
    assert "the run's own warning line" in out.stderr
    assert "RuntimeError: a rank's crash" in out.stderr and "Traceback" in out.stderr
    assert "a rank's crash" not in log


@pytest.mark.slow   # starts a Python process
def test_verbose_keeps_native_output_on_the_terminal(tmp_path):
    out = subprocess.run([sys.executable, "-c", NATIVE, str(tmp_path)], capture_output=True,
                         text=True, timeout=120,
                         env={**os.environ, "RANK": "1", "BUBBLESPEC_VERBOSE": "1"})
    assert "NUMA binding" in out.stderr and "printf from C" in out.stdout
    assert not RunDir(tmp_path).logs.exists()


def rank_that_crashes(run_dir: str) -> None:
    """A launched rank: routes its output, writes natively, then rank 1 fails (raise / exit)."""
    from megatron_bubblespec.logs import route_third_party_output

    import time

    route_third_party_output(run_dir)
    rank = int(os.environ["RANK"])
    os.write(2, f"[W native] rank {rank} chatter\n".encode())
    if rank == 1:
        while not RunDir(run_dir).rank_log(0).is_file():   # rank 0 is routed too
            time.sleep(0.05)
        if os.environ["HOW"] == "raise":
            raise ValueError("rank 1 hit a bug")
        os.write(2, b"terminate called after throwing an instance of 'c10::Error'\n")
        os._exit(134)
    time.sleep(60)     # rank 0 waits: the launcher must stop it


LAUNCH = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[2])
    from test_logs import rank_that_crashes
    from megatron_bubblespec.distributed.launch import launch_local
    launch_local(rank_that_crashes, 2, sys.argv[1])
""")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["raise", "exit"])
def test_the_launcher_still_reports_a_failed_rank(tmp_path, how):
    out = subprocess.run([sys.executable, "-c", LAUNCH, str(tmp_path), str(Path(__file__).parent)],
                         capture_output=True, text=True, timeout=240,
                         # freshly spawned ranks: these import no library worth a preloaded
                         # fork server (the failure report is the same for both start methods)
                         env={**os.environ, "HOW": how, "BUBBLESPEC_VERBOSE": "",
                              "BUBBLESPEC_START_METHOD": "spawn"})
    assert out.returncode != 0
    if how == "raise":
        assert "ValueError: rank 1 hit a bug" in out.stderr and "Traceback" in out.stderr, \
            out.stderr[-3000:]
    else:
        assert "RankFailure: rank 1" in out.stderr and "exit code 134" in out.stderr, \
            out.stderr[-3000:]
        assert "terminate called" in RunDir(tmp_path).rank_log(1).read_text()
    assert "chatter" not in out.stderr
    assert "rank 0 chatter" in RunDir(tmp_path).rank_log(0).read_text()


# ----------------------------------------------------------------------------- a real run

FIRST_SCREEN = 40
NOISE = re.compile(r"NUMA binding|UserWarning|FutureWarning|DeprecationWarning|\[W\d|"
                   r"\[rank\d+\]:\[W|Writing model shards")


@pytest.fixture(scope="module")
def tiny_train(tmp_path_factory):
    """`bubblespec train` on configs/tiny.yaml (1 step), with c10's warnings switched on (as
    `bubblespec bench` and torchrun leave them): (exit code, its terminal lines, run dir)."""
    out_dir = tmp_path_factory.mktemp("first-screen")
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "WARNING"}
    env.pop("BUBBLESPEC_VERBOSE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_bubblespec.cli", "train", "--config", str(TINY),
         f"run.output_dir={out_dir}", "run.name=first", "run.steps=1", "logging.plot=false",
         "logging.tensorboard=false"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600,
        env=env)
    return proc.returncode, proc.stdout.splitlines(), RunDir(out_dir / "first")


@pytest.mark.slow
def test_the_first_screen_of_a_run_holds_only_the_runs_own_lines(tiny_train):
    code, lines, run = tiny_train
    assert code == 0, "\n".join(lines[-40:])
    noise = [line for line in lines[:FIRST_SCREEN] if NOISE.search(line)]
    assert not noise, "\n".join(noise)
    assert any("BubbleSpec run summary" in line for line in lines)
    logs = "".join(p.read_text() for p in run.logs.glob("rank*.log"))
    assert "NUMA binding" in logs, "c10's native warnings should be in the ranks' logs"
    assert "UserWarning" in logs and "vllm" in logs
