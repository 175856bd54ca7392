"""scripts/gpu_check.py, gpu_env.py and gpu_check.sh without a GPU: the wrapper parses, the
modules import without torch (the set-up with the standard library alone), a given interpreter is
used as it is and a machine without CUDA falls back to .venv, the stages are registered in order
with the time budgets they had, a failing or raising stage is reported and makes the exit status
1, a stage past its limit is stopped, and the summary prints the metrics' tables and then one
table with the total last."""

import dataclasses
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    module_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules["gpu_check"] = module
    module_spec.loader.exec_module(module)
    yield module
    del sys.modules["gpu_check"]


def _ctx(gpu_check, tmp_path, budget_s=290):
    now = time.time()
    return gpu_check.Context(tmp_path, tmp_path / "gpu-metrics.jsonl", now, now + budget_s)


@pytest.mark.slow   # starts a process
def test_the_wrapper_parses():
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")], check=True)


@pytest.mark.slow   # starts a process
def test_the_module_imports_and_formats_without_torch():
    code = ("import sys; sys.modules['torch'] = None; import importlib.util as u; "
            f"s = u.spec_from_file_location('gpu_check', {str(SCRIPT)!r}); "
            "m = u.module_from_spec(s); sys.modules['gpu_check'] = m; s.loader.exec_module(m); "
            "print(m.format_table([m.Row('info', 'ok', 3, 'x')])[1])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["info", "ok", "3", "x"]


def test_stages_in_order_with_their_budgets(gpu_check):
    names = [c.name for c in gpu_check.CHECKS]
    assert names == ["environment", "nvidia-smi", "info", "gpu tests", "vllm", "step", "benchmark"]
    limits = {c.name: c.limit_s for c in gpu_check.CHECKS}
    reserves = dict(zip(names, gpu_check.reserves(gpu_check.CHECKS)))
    # (at most, seconds left for the stages after it): what keeps the check within 290 s
    assert [(limits[n], reserves[n]) for n in ("info", "gpu tests", "step", "benchmark")] == [
        (45, 220), (180, 170), (120, 50), (120, 10)]
    assert all(c.title for c in gpu_check.CHECKS)


def test_a_stage_is_one_registered_function(gpu_check, monkeypatch):
    monkeypatch.setattr(gpu_check, "CHECKS", list(gpu_check.CHECKS))

    @gpu_check.check("new", limit_s=30, need_s=20)
    def new(ctx):
        """a new stage"""
        return gpu_check.OK, "fine"

    assert gpu_check.CHECKS[-1].name == "new" and gpu_check.CHECKS[-1].title == "a new stage"
    assert gpu_check.reserves(gpu_check.CHECKS)[-2] == gpu_check.SUMMARY_S + 20


def test_a_failing_or_raising_stage_is_reported_and_fails_the_run(gpu_check, tmp_path, capsys):
    def fine(ctx):
        """fine"""
        return gpu_check.OK, "all good"

    def skipped(ctx):
        return gpu_check.SKIPPED, "not here"

    def broken(ctx):
        """broken"""
        raise RuntimeError("no device")

    checks = [gpu_check.Check(n, fn, 10, 0, None)
              for n, fn in (("fine", fine), ("skipped", skipped), ("broken", broken))]
    rows = gpu_check.run_checks(checks, _ctx(gpu_check, tmp_path))
    assert [(r.name, r.result, r.detail) for r in rows] == [
        ("fine", "ok", "all good"), ("skipped", "skipped", "not here"),
        ("broken", "FAILED", "RuntimeError: no device")]
    assert "== broken" in capsys.readouterr().out
    assert gpu_check.exit_status(rows) == 1
    assert gpu_check.exit_status(rows[:2]) == 0


def test_a_stage_gets_its_limit_within_the_budget(gpu_check, tmp_path):
    ctx = _ctx(gpu_check, tmp_path, budget_s=100)
    assert dataclasses.replace(ctx, limit_s=45, reserve_s=20).seconds() == 45
    assert dataclasses.replace(ctx, limit_s=180, reserve_s=20).seconds() in (79, 80)
    assert dataclasses.replace(ctx, limit_s=180, reserve_s=170).seconds() == 5


@pytest.mark.slow   # starts a process
def test_a_command_past_its_limit_is_stopped(gpu_check, tmp_path):
    log = tmp_path / "sleep.log"
    t0 = time.time()
    # a 5 s limit: a Python start-up on a loaded 2-core machine can take more than a second
    rc = gpu_check.run_logged([sys.executable, "-c", "print('started', flush=True); "
                               "import time; time.sleep(60)"], 5, log)
    assert rc in gpu_check.TIMED_OUT and time.time() - t0 < 20
    assert log.read_text().strip() == "started"


def test_the_benchmark_detail_gives_keyed_over_plain(gpu_check, tmp_path):
    rows = [{"engine": e, "batch_size": b, "decode_step_median_s": s}
            for e, b, s in (("vllm", 1, 0.004), ("vllm", 8, 0.005), ("plain", 1, 0.0041))]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"settings": {"engines": ["vllm", "plain"]}, "rows": rows,
                                "comparison": [{"batch_size": 1, "keyed_over_plain": 0.981}]}))
    assert gpu_check.bench_detail(path) == (
        "vllm engine (CUDA), tiny model: decode ms p50 b1 4.00, b8 5.00; keyed / plain vLLM "
        "tokens/s b1 0.981")


def test_junit_counts(gpu_check, tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text('<testsuites><testsuite tests="7" failures="1" errors="0" skipped="2"/>'
                    '</testsuites>')
    assert gpu_check.junit_counts(path) == (4, 1, 0, 2)
    assert gpu_check.junit_counts(tmp_path / "missing.xml") is None


def test_summary_prints_the_metrics_then_one_table_with_the_total_last(gpu_check, tmp_path):
    metrics = [
        {"check": "bf16_vs_fp32_verifier", "spec": "local", "position_agreement": 0.98,
         "accepted_prefix_agreement": 0.94, "request_agreement": 0.9, "max_logit_abs_diff": 0.03},
        {"check": "step_float32", "dtype": "float32", "engine": "vllm", "verify_s": 0.5,
         "accepted_tokens": 40, "drafted_tokens": 48, "spec_vs_plain_mismatched_samples": 0,
         "samples": 8, "gap_before_max": 1e-4, "gap_before_mean": 1e-5, "gap_after_max": 2e-4,
         "on_policy_check": "passed"},
        {"check": "target_logits_float32", "engine": "vllm", "positions": 120,
         "max_logit_abs_diff": 1e-6, "draw_flips": 0, "near_ties": 0},
        {"check": "batch_invariant", "samples": 32, "samples_differing": 0,
         "first_difference": [], "draft_tokens": 900, "accepted_tokens": 610},
    ]
    path = tmp_path / "gpu-metrics.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in metrics))
    rows = [gpu_check.Row("info", "ok", 3, "megatron-core 0.16.1")]
    lines = gpu_check.summary(rows, gpu_check.read_metrics(path), _ctx(gpu_check, tmp_path))
    text = "\n".join(lines)
    assert text.index("on-policy check") < text.index("target logits") < text.index("stage ")
    assert lines[-5].split()[0] == "stage"
    assert lines[-4].split()[:2] == ["info", "ok"]
    assert lines[-3].startswith("numerics") and "positions 0.980" in lines[-3]
    assert lines[-2].startswith("numerics") and "batch-invariant kernels: 0/32" in lines[-2]
    assert lines[-1].startswith("total") and lines[-1].endswith("wall time (limit 290 s)")
    assert "float32   vllm" in text and "passed" in text


def test_unreadable_metrics_do_not_hide_the_table(gpu_check, tmp_path):
    lines = gpu_check.summary([], [{"check": "step_float32"}], _ctx(gpu_check, tmp_path))
    assert any("unreadable" in line for line in lines) and lines[-1].startswith("total")


@pytest.mark.slow   # starts a process
def test_missing_requirements_leaves_torch_to_the_machine():
    out = subprocess.run([sys.executable, str(SCRIPT), "--missing-requirements"],
                         capture_output=True, text=True, check=True)
    assert not any(line.startswith("torch") for line in out.stdout.splitlines())


@pytest.fixture()
def gpu_env(monkeypatch, tmp_path):
    monkeypatch.setenv("GPU_CHECK_OUT", str(tmp_path))
    module_spec = importlib.util.spec_from_file_location("gpu_env", ROOT / "scripts" / "gpu_env.py")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.mark.slow   # starts a process
def test_the_interpreter_set_up_needs_only_the_standard_library():
    code = ("import sys; sys.modules['torch'] = sys.modules['megatron_bubblespec'] = None; "
            "import importlib.util as u; "
            f"s = u.spec_from_file_location('gpu_env', {str(ROOT / 'scripts' / 'gpu_env.py')!r}); "
            "m = u.module_from_spec(s); s.loader.exec_module(m); sys.exit(m.main(['--bogus']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 2 and "unknown argument" in out.stderr


def test_a_given_interpreter_is_used_as_it_is(gpu_env, monkeypatch, capsys):
    monkeypatch.setenv("BUBBLESPEC_PYTHON", "/opt/python/bin/python3")
    assert gpu_env.choose_python(gpu_env.Setup()) == ("/opt/python/bin/python3", True)
    assert "as it is" in capsys.readouterr().out


@pytest.mark.slow
def test_without_cuda_the_check_falls_back_to_the_venv_and_says_the_set_up_failed(gpu_env,
                                                                                  monkeypatch):
    if gpu_env.cuda_venv() or gpu_env.sees_cuda("python3"):
        pytest.skip("this machine has a CUDA torch")
    monkeypatch.delenv("BUBBLESPEC_PYTHON", raising=False)
    monkeypatch.setenv("PYTHON", sys.executable)   # a torch without CUDA
    python, ok = gpu_env.choose_python(gpu_env.Setup())
    assert python == str(ROOT / ".venv" / "bin" / "python") and not ok
