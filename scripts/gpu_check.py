"""The one-GPU check's stages (one registered function each) -> their results -> one short table
printed last; exit status 1 when a stage neither passed nor was skipped.

scripts/gpu_check.sh (through scripts/gpu_env.py) prepares the interpreter and runs this file with
it; every stage then runs in a child process of that interpreter, in the repository root, under a
time limit (SIGTERM to its process group, SIGKILL 10 s later, as ``timeout -k 10``). A stage is a
function taking the Context and returning (result, detail), registered with ``@check(name, limit_s,
need_s)``: at most ``limit_s`` seconds, and ``need_s`` seconds that the stages before it leave for
it; it runs in registration order and gets one row of the table.

    python scripts/gpu_check.py                        the stages and the table
    python scripts/gpu_check.py --dry-run              the stages' limits and commands, the gpu
                                                       tests as collected and why each is skipped
    python scripts/gpu_check.py --missing-requirements pyproject.toml's requirements (torch
                                                       aside) that this interpreter lacks
Environment: GPU_CHECK_OUT (logs, JUnit XML, benchmark JSON, metrics; default runs/gpu-check),
GPU_CHECK_BUDGET_S (the whole check's limit, default 290), GPU_CHECK_START (when it began, epoch
seconds; default now), GPU_CHECK_SETUP (``ok`` or ``FAILED``: how the interpreter's set-up went;
default ok), BUBBLESPEC_GPU_METRICS (the tests' metrics file; default <out>/gpu-metrics.jsonl).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]
STEP_TEST = "tests/test_gpu_step.py"
OK, SKIPPED, FAILED, TIMEOUT, NONE_RAN = "ok", "skipped", "FAILED", "TIMEOUT", "NONE-RAN"
PASSING = (OK, SKIPPED)
TIMED_OUT = (124, 137)      # exit statuses of a stage stopped at its limit (as `timeout` gives)
SUMMARY_S = 10              # seconds kept for the table after the last stage
DEFAULT_BUDGET_S = 290


# ------------------------------------------------------------------------------ registry

@dataclass
class Context:
    """What a stage sees: the output directory, the tests' metrics file, when the check began and
    must end, and the stage's own time limit."""

    out: Path
    metrics: Path
    start: float
    deadline: float
    limit_s: int = 0
    reserve_s: int = 0      # seconds the stages after this one need

    def seconds(self) -> int:
        """This stage's time limit now: at most limit_s, leaving reserve_s, at least 5."""
        return max(5, min(self.limit_s, int(self.deadline - time.time()) - self.reserve_s))


@dataclass(frozen=True)
class Check:
    """A registered stage: its row's name, its function, at most ``limit_s`` seconds, ``need_s``
    seconds the stages before it leave for it, and its command line for --dry-run."""

    name: str
    run: Callable[[Context], tuple[str, str]]
    limit_s: int
    need_s: int
    command: Callable[[Context], list[str]] | None

    @property
    def title(self) -> str:
        return (self.run.__doc__ or self.name).strip().splitlines()[0]


CHECKS: list[Check] = []


def check(name: str, limit_s: int = 0, need_s: int = 0,
          command: Callable[[Context], list[str]] | None = None):
    """Register the decorated function as the next stage (``command``: what --dry-run shows)."""
    def register(fn):
        CHECKS.append(Check(name, fn, limit_s, need_s, command))
        return fn
    return register


def reserves(checks: Sequence[Check]) -> list[int]:
    """Per stage, the seconds to leave for the ones after it: their need_s plus the table's."""
    return [SUMMARY_S + sum(c.need_s for c in checks[i + 1:]) for i in range(len(checks))]


@dataclass
class Row:
    name: str
    result: str
    seconds: int | None
    detail: str


def run_checks(checks: Sequence[Check], ctx: Context) -> list[Row]:
    """Every stage in order; a stage that raises is FAILED with the error. A row's time counts
    from the end of the previous one (the first: from ctx.start, so it includes the set-up)."""
    rows, t0 = [], ctx.start
    for c, reserve in zip(checks, reserves(checks)):
        print(f"\n== {c.title}", flush=True)
        try:
            result, detail = c.run(dataclasses.replace(ctx, limit_s=c.limit_s, reserve_s=reserve))
        except Exception as err:  # a broken stage must not hide the others
            result, detail = FAILED, f"{type(err).__name__}: {err}"
        rows.append(Row(c.name, result, round(time.time() - t0), detail))
        t0 = time.time()
    return rows


def format_table(rows: Sequence[Row]) -> list[str]:
    lines = [f"{'stage':<12} {'result':<8} {'time_s':>7}  detail"]
    lines += [f"{r.name:<12} {r.result:<8} {r.seconds if r.seconds is not None else '':>7}  "
              f"{r.detail}" for r in rows]
    return lines


def exit_status(rows: Sequence[Row]) -> int:
    return 0 if all(r.result in PASSING for r in rows) else 1


# ------------------------------------------------------------------------------ child processes

def _copy(pipe, log) -> None:
    for line in iter(pipe.readline, b""):
        sys.stdout.buffer.write(line)
        sys.stdout.buffer.flush()
        log.write(line)


def run_logged(cmd: Sequence[str], seconds: int, log: Path) -> int:
    """``cmd`` in its own process group, its output to the console and to ``log``; its exit
    status, or 124 when stopped at ``seconds`` (137 when it had to be killed)."""
    with open(log, "wb") as f:
        proc = subprocess.Popen(list(cmd), cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        copier = threading.Thread(target=_copy, args=(proc.stdout, f), daemon=True)
        copier.start()
        try:
            rc = proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            rc = _stop(proc)
        copier.join(timeout=10)
    return rc


def _stop(proc: subprocess.Popen) -> int:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
        return 124
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return 137
    except ProcessLookupError:
        proc.wait()
        return 124


def probe(name: str, seconds: int) -> str | None:
    """The line ``--probe name`` prints in a child of this interpreter (None: it failed)."""
    try:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--probe", name],
                              cwd=ROOT, capture_output=True, text=True, timeout=seconds)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _probe_torch() -> str:
    import torch

    return (f"{sys.executable}: python {sys.version.split()[0]}, torch {torch.__version__}, "
            f"CUDA {torch.cuda.is_available()}")


def _probe_vllm() -> str:
    try:
        import torch
        import vllm
    except Exception as err:  # ImportError, or a broken CUDA build
        first = str(err).splitlines()[0] if str(err) else ""
        return f"not importable: {type(err).__name__}: {first}"
    return (f"ok {vllm.__version__}" if torch.cuda.is_available() else
            f"importable ({vllm.__version__}) but torch sees no CUDA device")


def _probe_bench_engines() -> str:
    """The benchmark's engines in order: vLLM, keyed against its own sampler, when installed and
    CUDA is there, else only the reference engine (which also runs when vLLM fails)."""
    import importlib.metadata

    import torch

    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return "reference"
    return "vllm,plain reference" if torch.cuda.is_available() else "reference"


PROBES = {"torch": _probe_torch, "vllm": _probe_vllm, "bench-engines": _probe_bench_engines}


def vllm_status(seconds: int) -> str:
    """"ok <version>", or why vLLM cannot run here."""
    return probe("vllm", seconds) or f"the interpreter failed or took over {seconds} s on it"


def bench_engines(seconds: int = 60) -> list[str]:
    return (probe("bench-engines", seconds) or "reference").split()


# ------------------------------------------------------------------------------ stages

def info_command(ctx: Context) -> list[str]:
    return [sys.executable, "-m", "megatron_bubblespec.cli", "info"]


def tests_command(ctx: Context) -> list[str]:
    # --continue-on-collection-errors: a test module whose optional dependency is missing on
    # this machine must not stop the gpu tests from running.
    return [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "tests/", f"--ignore={STEP_TEST}",
            "-p", "no:cacheprovider", "--continue-on-collection-errors",
            f"--junitxml={ctx.out / 'pytest-gpu.xml'}"]


def step_command(ctx: Context) -> list[str]:
    return [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-s", STEP_TEST, "-p",
            "no:cacheprovider"]


def bench_command(ctx: Context, engine: str) -> list[str]:
    return [sys.executable, "-m", "megatron_bubblespec.cli", "bench-engine", "--engine", engine,
            "--model", "tiny", "--batch-sizes", "1,8,32", "--prompt-len", "64",
            "--new-tokens", "32", "--repeats", "3", "--out", str(_bench_path(ctx, engine, "json"))]


def _bench_path(ctx: Context, engine: str, suffix: str) -> Path:
    return ctx.out / f"bench-{engine.replace(',', '-')}.{suffix}"


@check("environment")
def environment(ctx: Context) -> tuple[str, str]:
    """environment: the interpreter, its torch and CUDA"""
    detail = probe("torch", 120) or f"{sys.executable}: torch does not import"
    print(detail)
    return os.environ.get("GPU_CHECK_SETUP", OK), detail


@check("nvidia-smi", limit_s=20, command=lambda ctx: ["nvidia-smi", "-L"])
def nvidia_smi(ctx: Context) -> tuple[str, str]:
    """nvidia-smi -L"""
    try:
        proc = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                              timeout=ctx.seconds())
    except (OSError, subprocess.TimeoutExpired) as err:
        print(err)
        return FAILED, "nvidia-smi missing or failing"
    text = (proc.stdout + proc.stderr).strip()
    print(text)
    if proc.returncode != 0:
        return FAILED, "nvidia-smi missing or failing"
    return OK, text.splitlines()[0] if text else ""


@check("info", limit_s=45, command=info_command)
def info(ctx: Context) -> tuple[str, str]:
    """bubblespec info"""
    log = ctx.out / "info.log"
    if run_logged(info_command(ctx), ctx.seconds(), log) != 0:
        return FAILED, "see the output above"
    versions = []
    for line in log.read_text(errors="replace").splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[0] in ("megatron-core", "vllm", "transformer-engine"):
            versions.append(f"{fields[0]} {'-' if fields[1] == 'not' else fields[1]}")
    return OK, ", ".join(versions)


def junit_counts(path: Path) -> tuple[int, int, int, int] | None:
    """(passed, failed, errors, skipped) of a JUnit XML report; None when it is unreadable."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    n = {k: sum(int(s.get(k, 0)) for s in suites)
         for k in ("tests", "failures", "errors", "skipped")}
    return (n["tests"] - n["failures"] - n["errors"] - n["skipped"], n["failures"], n["errors"],
            n["skipped"])


@check("gpu tests", limit_s=180, need_s=50, command=tests_command)
def gpu_tests(ctx: Context) -> tuple[str, str]:
    """pytest -m gpu tests/: keyed sampler on CUDA, Megatron verifier over NCCL, bf16 numerics"""
    junit = ctx.out / "pytest-gpu.xml"
    junit.unlink(missing_ok=True)
    rc = run_logged(tests_command(ctx), ctx.seconds(), ctx.out / "pytest-gpu.log")
    counts = junit_counts(junit)
    text = ("{} passed, {} failed, {} errors, {} skipped".format(*counts) if counts
            else "no JUnit report")
    if rc in TIMED_OUT:
        return TIMEOUT, text
    if rc != 0:
        return FAILED, f"{text} (pytest exit {rc})"
    if not counts or counts[0] == 0:     # all skipped: torch saw no CUDA device
        return NONE_RAN, text
    return OK, text


@check("vllm", limit_s=60)
def vllm(ctx: Context) -> tuple[str, str]:
    """vLLM: importable, with a CUDA device?"""
    status = vllm_status(ctx.limit_s)   # not cut by the budget: the import takes what it takes
    print(f"vllm: {status}")
    if status.startswith("ok "):
        return OK, f"vllm {status.removeprefix('ok ')}"
    return SKIPPED, f"{status}; the step uses the reference engine"


@check("step", limit_s=120, need_s=120, command=step_command)
def step(ctx: Context) -> tuple[str, str]:
    """one BubbleSpec step per dtype (tests/test_gpu_step.py)"""
    log = ctx.out / "step.log"
    rc = run_logged(step_command(ctx), ctx.seconds(), log)
    lines = log.read_text(errors="replace").splitlines()
    tail = lines[-1] if lines else ""
    if rc in TIMED_OUT:
        return TIMEOUT, f"see {log}"
    if rc != 0:
        return FAILED, tail
    if "passed" not in tail:             # all skipped: torch saw no CUDA device
        return NONE_RAN, tail
    return OK, tail


def bench_detail(path: Path) -> str:
    report = json.loads(path.read_text())
    engine = report["settings"]["engines"][0]
    where = "CUDA" if engine == "vllm" else "CPU torch"
    decode = ", ".join(f"b{r['batch_size']} {r['decode_step_median_s'] * 1e3:.2f}"
                       for r in report["rows"] if r["engine"] == engine)
    keyed = ", ".join(f"b{c['batch_size']} {c['keyed_over_plain']:.3f}"
                      for c in report.get("comparison", []))
    return (f"{engine} engine ({where}), tiny model: decode ms p50 {decode}"
            + (f"; keyed / plain vLLM tokens/s {keyed}" if keyed else ""))


@check("benchmark", limit_s=120, need_s=40,
       command=lambda ctx: bench_command(ctx, bench_engines()[0]))
def benchmark(ctx: Context) -> tuple[str, str]:
    """bubblespec bench-engine: vLLM on CUDA, keyed against plain, when it is there, else (or
    when it fails) reference"""
    detail = "no engine finished"
    for engine in bench_engines():
        print(f"-- bubblespec bench-engine --engine {engine}", flush=True)
        report, log = _bench_path(ctx, engine, "json"), _bench_path(ctx, engine, "log")
        report.unlink(missing_ok=True)
        rc = run_logged(bench_command(ctx, engine), ctx.seconds(), log)
        if rc == 0 and report.is_file() and report.stat().st_size:
            try:
                return OK, bench_detail(report)
            except (OSError, ValueError, KeyError, IndexError, TypeError):
                return OK, f"{engine}: unreadable report {report}"
        detail = f"{engine} engine failed or timed out (see {log})"
    return FAILED, detail


# ------------------------------------------------------------------------------ summary

def read_metrics(path: Path) -> list[dict]:
    """The JSON lines the gpu tests appended (none when the file is missing or cut)."""
    rows = []
    try:
        for line in path.read_text().splitlines():
            if line.strip():
                rows.append(json.loads(line))
    except (OSError, ValueError):
        pass
    return rows


def numerics_rows(metrics: Sequence[dict]) -> list[Row]:
    return [Row("numerics", "", None,
                f"bf16 vs fp32 verifier ({m['spec']} spec): positions "
                f"{m['position_agreement']:.3f}, accepted prefix "
                f"{m['accepted_prefix_agreement']:.3f}, requests {m['request_agreement']:.3f}, "
                f"max |dlogit| {m['max_logit_abs_diff']:.3g}")
            for m in metrics if m.get("check") == "bf16_vs_fp32_verifier"] + [
        Row("numerics", "", None,
            f"bf16 drafts verified in vLLM, {m['check'].replace('_', '-')} kernels: "
            f"{m['samples_differing']}/{m['samples']} samples differ from plain decoding "
            f"(first at {m['first_difference'][:4]}), accepted {m['accepted_tokens']}/"
            f"{m['draft_tokens']} draft tokens")
        for m in metrics if m.get("check") in ("batch_invariant", "batch_variant")]


def step_tables(metrics: Sequence[dict]) -> list[str]:
    """The whole-step metrics (tests/test_gpu_step.py): one line per dtype, then the target
    logits of the verifier against the plain context."""
    steps = [m for m in metrics if m.get("check", "").startswith("step_")]
    logits = {m["check"].removeprefix("target_logits_"): m for m in metrics
              if m.get("check", "").startswith("target_logits_")}
    lines = []
    if steps:
        lines += ["", f"{'step':9} {'engine':16} {'verify_s':>8} {'accepted':>8} "
                  f"{'spec!=plain':>11} {'gap max':>9} {'gap mean':>9} {'after max':>9}  "
                  "on-policy check"]
    for m in steps:
        lines.append(f"{m['dtype']:9} {m['engine']:16} {m['verify_s']:8.2f} "
                     f"{m['accepted_tokens']:>4}/{m['drafted_tokens']:<4}"
                     f"{m['spec_vs_plain_mismatched_samples']:>5}/{m['samples']:<5} "
                     f"{m['gap_before_max']:9.2e} {m['gap_before_mean']:9.2e} "
                     f"{m['gap_after_max']:9.2e}  {m['on_policy_check']}")
    if logits:
        lines += ["", f"{'target logits, verifier vs plain context':42} {'positions':>9} "
                  f"{'max |d|':>9} {'draw flips':>10} {'near ties':>9}"]
    for dtype, m in logits.items():
        lines.append(f"{dtype + ' (' + m['engine'] + ')':42} {m['positions']:>9} "
                     f"{m['max_logit_abs_diff']:9.2e} {m['draw_flips']:>10} {m['near_ties']:>9}")
    return lines


def summary(rows: Sequence[Row], metrics: Sequence[dict], ctx: Context) -> list[str]:
    """The metrics' tables, then the stages' table with the numerics and the total last."""
    lines = [f"\n== gpu check summary (details in {ctx.out})"]
    try:
        lines += step_tables(metrics)
        extra = numerics_rows(metrics)
    except (KeyError, TypeError, ValueError) as err:
        lines.append(f"(the metrics in {ctx.metrics} are unreadable: {err!r})")
        extra = []
    total = Row("total", "", round(time.time() - ctx.start),
                f"wall time (limit {round(ctx.deadline - ctx.start)} s)")
    return lines + [""] + format_table([*rows, *extra, total])


# ------------------------------------------------------------------------------ dry run

def dry_run(ctx: Context) -> int:
    """Run nothing: the stages' limits and commands, and the gpu tests as pytest collects them
    here, with why each would be skipped on this machine."""
    print(f"stages, each under a time limit (seconds at most; all within "
          f"GPU_CHECK_BUDGET_S={round(ctx.deadline - ctx.start)}):")
    for c in CHECKS:
        what = shlex.join(c.command(ctx)) if c.command else c.title
        print(f"  {c.name:<12} {c.limit_s or '':>4}  {what}")
    print(f"  vLLM: {vllm_status(60)}")
    print("\nthe gpu tests as collected here, and why each is skipped on this machine:")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-rs", "tests/",
                           "-p", "no:cacheprovider", "--continue-on-collection-errors"],
                          cwd=ROOT, capture_output=True, text=True)
    wanted = re.compile(r"(::| SKIPPED|^SKIPPED|^ERROR|^E  |[0-9]+ (passed|skipped|deselected|"
                        r"error))")
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if wanted.search(line)]
    print("\n".join(lines[-60:]))
    if proc.returncode not in (0, 5):
        print(f"pytest exit {proc.returncode}: the real run would report these errors")
        return 1
    return 0


# ------------------------------------------------------------------------------ requirements

def missing_requirements() -> list[str]:
    """pyproject.toml's dependencies and test extra (torch aside), plus transformers (it writes
    the tiny test checkpoints) and psutil, tqdm (megatron-core uses them), that this interpreter
    does not satisfy."""
    import importlib.metadata as md
    import tomllib

    try:
        from packaging.requirements import Requirement
    except ImportError:
        from pip._vendor.packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["test"] + [
        "transformers", "psutil", "tqdm"]
    missing = []
    for text in wanted:
        req = Requirement(text)
        if req.name == "torch":
            continue
        try:
            ok = req.specifier.contains(md.version(req.name), prereleases=True)
        except md.PackageNotFoundError:
            ok = False
        if not ok:
            missing.append(text)
    return missing


# ------------------------------------------------------------------------------ main

def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", "-n", action="store_true",
                      help="run nothing: limits, commands, the gpu tests as collected")
    mode.add_argument("--missing-requirements", action="store_true",
                      help="print the requirements this interpreter lacks, one a line")
    mode.add_argument("--probe", choices=sorted(PROBES), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.probe:
        print(PROBES[args.probe]())
        return 0
    if args.missing_requirements:
        print("\n".join(missing_requirements()))
        return 0
    out = (ROOT / os.environ.get("GPU_CHECK_OUT", "runs/gpu-check")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    budget_s = int(os.environ.get("GPU_CHECK_BUDGET_S", DEFAULT_BUDGET_S))
    start = float(os.environ.get("GPU_CHECK_START", time.time()))
    # the gpu tests append their metrics there
    metrics = os.environ.setdefault("BUBBLESPEC_GPU_METRICS", str(out / "gpu-metrics.jsonl"))
    ctx = Context(out, Path(metrics), start, start + budget_s)
    if args.dry_run:
        return dry_run(ctx)
    ctx.metrics.unlink(missing_ok=True)
    rows = run_checks(CHECKS, ctx)
    print("\n".join(summary(rows, read_metrics(ctx.metrics), ctx)), flush=True)
    return exit_status(rows)


if __name__ == "__main__":
    sys.exit(main())
