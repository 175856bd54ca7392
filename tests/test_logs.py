"""Known-harmless library warnings and library log records go to the run's log file, the run's own
warnings and library errors to the terminal; with the verbose switch everything stays on the
terminal. Each case runs in a fresh interpreter (routing changes process-wide state)."""

import os
import subprocess
import sys
import textwrap

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


def test_harmless_library_output_goes_to_the_log_file(tmp_path):
    stderr = _run(tmp_path)
    log = (tmp_path / "logs" / "rank3.log").read_text()
    assert "Apex is not installed" in log and "Apex" not in stderr
    assert "vllm start-up chatter" in log and "chatter" not in stderr
    assert "a record with no handler of its own" in log and "no handler" not in stderr
    assert "something new in megatron" in stderr and "something new" not in log
    assert "the run's own warning" in stderr
    assert "a vllm error" in stderr and "a vllm error" in log


def test_verbose_keeps_everything_on_the_terminal(tmp_path):
    stderr = _run(tmp_path, BUBBLESPEC_VERBOSE="1")
    assert not (tmp_path / "logs").exists()
    for text in ("Apex is not installed", "something new in megatron", "the run's own warning",
                 "a record with no handler of its own", "a vllm error"):
        assert text in stderr, text
