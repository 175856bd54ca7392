"""An untrusted Python answer + its test cases -> a separate, limited process -> how many tests pass.

A code task's reward runs the policy's answer, which may loop, crash, eat memory or try to reach
the filesystem, the network or other processes. Each answer runs in its own ``python -I -S``
process (no site, no user paths) in an empty directory, under limits set before the answer is
read: CPU seconds, address space, no file may be written. An audit hook (``sys.addaudithook``,
which the answer cannot remove) refuses every event that opens a file, a socket or a process, or
imports a module; the answer's own ``import`` sees only ``ALLOWED_MODULES``, loaded before the hook.
The parent enforces the wall-clock limit and kills the process group. Whatever happens costs the
sample its reward and nothing else: the outcome is one of ``OUTCOMES``.

This is a guard against a policy's accidents and its reward hacking on one machine, not a
security boundary against an adversary with a kernel exploit; run untrusted code from outside the
training job in a container or a service made for it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

ALLOWED_MODULES = ("math", "itertools", "functools", "collections", "heapq", "bisect", "string",
                   "re", "operator", "fractions", "statistics")
OUTCOMES = ("passed", "failed", "timeout", "crashed", "refused", "invalid")
STDERR_KEPT = 2000      # characters of the answer's stderr kept for the log

# Runs in the child: limits, the allowed modules, the audit hook, then the answer and its tests.
_CHILD = r"""
import json, os, resource, sys
payload = json.loads(sys.stdin.read())
out = os.fdopen(int(sys.argv[1]), "w")
memory = payload["memory_mb"] << 20
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CPU, (payload["cpu_s"], payload["cpu_s"] + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
allowed = {name: __import__(name) for name in payload["allowed"]}
BLOCKED = ("open", "import", "os.", "subprocess.", "socket.", "shutil.", "ctypes.", "pty.",
           "signal.", "sys.settrace", "sys.setprofile", "sys._getframe", "code.", "cpython.",
           "webbrowser.", "urllib.", "ftplib.", "http.", "smtplib.", "glob.", "mmap.", "winreg.")
def audit(event, args):
    if event.startswith(BLOCKED):
        raise PermissionError("sandbox refuses " + event)
def guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level or name.partition(".")[0] not in allowed:
        raise PermissionError("sandbox refuses import " + name)
    return allowed[name.partition(".")[0]]
import builtins
safe = dict(vars(builtins))
safe["__import__"] = guarded_import
for name in ("open", "input", "breakpoint", "exit", "quit", "help"):
    safe.pop(name, None)
namespace = {"__builtins__": safe, "__name__": "answer"}
passed = []
sys.addaudithook(audit)
try:
    exec(compile(payload["code"], "<answer>", "exec"), namespace)
    function = namespace.get(payload["entry"])
    if not callable(function):
        out.write(json.dumps({"outcome": "invalid", "passed": []}))
        out.flush()
        os._exit(0)
    for args, expected in payload["tests"]:
        try:
            passed.append(bool(function(*args) == expected))
        except PermissionError:
            raise
        except Exception:
            passed.append(False)
    outcome = "passed" if all(passed) else "failed"
except PermissionError as error:
    outcome = "refused"
except SyntaxError:
    outcome = "invalid"
out.write(json.dumps({"outcome": outcome, "passed": passed}))
out.flush()
os._exit(0)
"""


@dataclass(frozen=True)
class TestRun:
    outcome: str           # one of OUTCOMES
    passed: int            # tests passed
    total: int
    detail: str = ""       # the end of stderr, or why the run was stopped

    @property
    def share(self) -> float:
        return self.passed / self.total if self.total and self.outcome in ("passed", "failed") \
            else 0.0


def run_tests(code: str, entry: str, tests: list, *, time_limit_s: float = 2.0,
              memory_mb: int = 256) -> TestRun:
    """Run ``code``, call its ``entry`` on each test's arguments and compare with the expected
    value; ``tests``: [[args list, expected], ...] (JSON values)."""
    total = len(tests)
    if time_limit_s <= 0:
        return TestRun("timeout", 0, total, "no time left in the batch")
    payload = json.dumps({"code": code, "entry": entry, "tests": tests, "memory_mb": memory_mb,
                          "cpu_s": max(1, int(time_limit_s) + 1), "allowed": ALLOWED_MODULES})
    read, write = os.pipe()
    with tempfile.TemporaryDirectory(prefix="bubblespec-sandbox-") as cwd:
        try:
            child = subprocess.Popen([sys.executable, "-I", "-S", "-c", _CHILD, str(write)],
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, cwd=cwd, pass_fds=(write,),
                                     env={"PATH": "/usr/bin:/bin"}, start_new_session=True)
        finally:
            os.close(write)
        try:
            _, stderr = child.communicate(payload.encode(), timeout=time_limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.communicate()
            os.close(read)
            return TestRun("timeout", 0, total, f"stopped after {time_limit_s:g} s")
        with os.fdopen(read) as result:
            report = result.read()
    detail = stderr.decode(errors="replace")[-STDERR_KEPT:]
    if not report:
        return TestRun("crashed", 0, total, detail or f"exit status {child.returncode}")
    parsed = json.loads(report)
    return TestRun(parsed["outcome"], sum(parsed["passed"]), total, detail)
