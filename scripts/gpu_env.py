"""Machine -> an interpreter with a CUDA torch and the project's requirements -> scripts/gpu_check.py
run with it (exec). Standard library only: it runs on whatever ``python3`` the GPU machine has.

Interpreter, the first that works:
  BUBBLESPEC_PYTHON=/path/to/python   used as it is, nothing installed
  .venv/ or .cache/gpu-venv/          when its torch sees a CUDA device; missing requirements added
  a new virtualenv, .cache/gpu-venv   (.venv is left to `make setup` and its CPU stack.) If the
                                      machine's python3 has a CUDA torch, the virtualenv sees it
                                      (--system-site-packages) and only the project's dependencies
                                      and test extras are added; otherwise `pip install -e
                                      .[gpu,test]` brings torch, vLLM and Transformer Engine.
  .venv without CUDA                  the check still runs; its gpu tests are skipped.
Settings:
  WHEELHOUSE=DIR       install from DIR only (pip --no-index), for machines without an index;
                       default: ./wheels when it exists
  GPU_CHECK_EXTRAS=1   also install the [gpu] extra into a virtualenv that reuses the machine's
                       torch (off by default: vLLM pins its own torch build, a multi-GB download
                       that would shadow the machine's)
  GPU_CHECK_OUT=DIR    logs, JUnit XML, benchmark JSON and metrics (default runs/gpu-check)
  GPU_CHECK_BUDGET_S   overall time limit in seconds (default 290); set-up steps get their share
How the set-up went reaches gpu_check.py as GPU_CHECK_SETUP (ok | FAILED), its first table row.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ROOT / "scripts" / "gpu_check.py"
GPU_VENV = ".cache/gpu-venv"


class Setup:
    """One set-up of the interpreter: the time left, the wheelhouse and the log it writes."""

    def __init__(self) -> None:
        self.start = time.time()
        self.deadline = self.start + int(os.environ.get("GPU_CHECK_BUDGET_S", 290))
        out = ROOT / os.environ.get("GPU_CHECK_OUT", "runs/gpu-check")
        out.mkdir(parents=True, exist_ok=True)
        self.out = out.resolve()
        self.log = self.out / "environment.log"
        house = os.environ.get("WHEELHOUSE") or (str(ROOT / "wheels")
                                                 if (ROOT / "wheels").is_dir() else "")
        self.wheelhouse = house

    def budget(self, at_most: int, keep: int) -> int:
        """Seconds a set-up step may take: at most ``at_most``, keeping ``keep`` for the stages."""
        return max(5, min(at_most, int(self.deadline - time.time() - keep)))

    def run(self, cmd: list[str], seconds: int) -> bool:
        with open(self.log, "a") as log:
            try:
                return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                      timeout=seconds).returncode == 0
            except (OSError, subprocess.TimeoutExpired) as err:
                log.write(f"{cmd}: {err}\n")
                return False

    def pip_install(self, python: str, seconds: int, *requirements: str) -> bool:
        source = ["--no-index", "--find-links", self.wheelhouse] if self.wheelhouse else []
        return self.run([python, "-m", "pip", "install", "--disable-pip-version-check",
                         "--retries", "1", "--timeout", "20", *source, *requirements], seconds)

    def install_missing(self, python: str) -> bool:
        """Install what ``python`` lacks in one pip call; from a wheelhouse, retry one
        requirement per call so that one absent wheel does not block the others."""
        proc = subprocess.run([python, str(CHECKS), "--missing-requirements"], cwd=ROOT,
                              capture_output=True, text=True)
        if proc.returncode:
            print("could not read the requirements of pyproject.toml with", python,
                  "(needs Python >= 3.11)")
            return False
        missing = [r for r in proc.stdout.splitlines() if r.strip()]
        if not missing:
            return True
        print("installing", " ".join(missing))
        if self.pip_install(python, self.budget(120, 180), *missing):
            return True
        failed = missing
        if self.wheelhouse:
            failed = [r for r in missing if not self.pip_install(python, self.budget(60, 180), r)]
        if failed:
            print(f"could not install: {' '.join(failed)} (see {self.log}; set WHEELHOUSE to a "
                  "directory of wheels on a machine without a package index)")
        return not failed

    def make_venv(self, base: str, *flags: str) -> bool:
        print(f"creating the virtualenv {GPU_VENV} from {base} {' '.join(flags)}".rstrip())
        if self.run([base, "-m", "venv", "--clear", *flags, GPU_VENV], 120):
            return True
        print(f"could not create {GPU_VENV} with '{base} -m venv' (on Debian/Ubuntu: apt-get "
              f"install python3-venv); see {self.log}")
        return False


def sees_cuda(python: str) -> bool:
    code = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"
    return _quiet([python, "-c", code])


def has_torch(python: str) -> bool:
    return _quiet([python, "-c", "import torch"])


def _quiet(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def cuda_venv() -> str | None:
    """The first of .venv, .cache/gpu-venv whose torch sees a CUDA device."""
    for folder in (".venv", GPU_VENV):
        python = ROOT / folder / "bin" / "python"
        if python.is_file() and sees_cuda(str(python)):
            return str(python)
    return None


def choose_python(setup: Setup) -> tuple[str, bool]:
    """(the interpreter, whether its set-up went well), printing what it did."""
    base = os.environ.get("PYTHON", "python3")
    if os.environ.get("BUBBLESPEC_PYTHON"):
        python = os.environ["BUBBLESPEC_PYTHON"]
        print(f"using BUBBLESPEC_PYTHON={python} as it is")
        return python, True
    python = cuda_venv()
    if python:
        return python, setup.install_missing(python)
    venv_python = str(ROOT / GPU_VENV / "bin" / "python")
    if sees_cuda(base):
        if not setup.make_venv(base, "--system-site-packages"):
            return base, False
        ok = setup.install_missing(venv_python)
        if ok and os.environ.get("GPU_CHECK_EXTRAS") == "1":
            print("installing the [gpu] extra (vLLM, Transformer Engine)")
            if not setup.pip_install(venv_python, setup.budget(240, 120), "-e", ".[gpu]"):
                print("the [gpu] extra did not install; vLLM and Transformer Engine checks are "
                      "skipped")
        return venv_python, ok
    local = ROOT / ".venv" / "bin" / "python"
    if local.is_file() and has_torch(str(local)):
        print("no CUDA torch on this machine: using .venv (the gpu tests will be skipped)")
        return str(local), False
    print(f"no torch found: installing the project with its [gpu,test] extras into {GPU_VENV}")
    if not setup.make_venv(base):
        return base, False
    if not setup.pip_install(venv_python, setup.budget(240, 120), "-e", ".[gpu,test]",
                             "transformers"):
        print(f"pip install -e .[gpu,test] failed (see {setup.log}): install a CUDA torch first, "
              "or point BUBBLESPEC_PYTHON at an interpreter that has one")
        return venv_python, False
    if not sees_cuda(venv_python):
        print("the installed torch does not see a CUDA device")
        return venv_python, False
    return venv_python, True


def dry_run_python() -> str:
    """What the real run would use, installing nothing (printed); the interpreter to collect with."""
    if os.environ.get("BUBBLESPEC_PYTHON"):
        python = os.environ["BUBBLESPEC_PYTHON"]
        print(f"interpreter: BUBBLESPEC_PYTHON={python}, used as it is")
        return python
    python = cuda_venv()
    if python:
        print(f"interpreter: {python} (its torch sees CUDA); missing requirements would be "
              "installed")
        return python
    base = os.environ.get("PYTHON", "python3")
    if sees_cuda(base):
        house = os.environ.get("WHEELHOUSE")
        print(f"interpreter: would create {GPU_VENV} from {base} (CUDA torch, "
              "--system-site-packages) and install the missing requirements"
              + (f" from {house} only" if house else ""))
    else:
        print(f"interpreter: no CUDA torch here; the real run would fall back to .venv or install "
              f".[gpu,test] into {GPU_VENV}")
    local = ROOT / ".venv" / "bin" / "python"
    python = str(local) if local.is_file() else base
    print(f"  (this dry run collects with {python})")
    return python


def main(argv: list[str]) -> int:
    if any(a not in ("--dry-run", "-n") for a in argv):
        print(f"gpu_check.sh: unknown argument {argv!r} (use --dry-run or --help)",
              file=sys.stderr)
        return 2
    os.chdir(ROOT)
    setup = Setup()
    os.environ.update(GPU_CHECK_OUT=str(setup.out), GPU_CHECK_START=str(int(setup.start)),
                      BUBBLESPEC_GPU_METRICS=str(setup.out / "gpu-metrics.jsonl"))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT),
                                                           os.environ.get("PYTHONPATH")) if p)
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if argv:
        python = dry_run_python()
        print(flush=True)
        os.execv(python, [python, str(CHECKS), "--dry-run"])
    print("\n== set-up of the interpreter", flush=True)
    python, ok = choose_python(setup)
    os.environ["GPU_CHECK_SETUP"] = "ok" if ok else "FAILED"
    sys.stdout.flush()
    os.execv(python, [python, str(CHECKS)])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
