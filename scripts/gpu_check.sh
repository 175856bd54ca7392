#!/usr/bin/env bash
# One-GPU check of the CUDA code paths in about five minutes: environment, `nvidia-smi -L`,
# `bubblespec info`, the tests marked `gpu` (keyed sampler on CUDA, Megatron verifier over NCCL,
# bfloat16 numerics), one whole BubbleSpec step per dtype (tests/test_gpu_step.py: verification,
# vLLM rollout with speculative continuation, GRPO step in float32 and bfloat16, reshard, the
# on-policy check, and spec-vs-plain target logits per key and position), a short engine
# benchmark, and a summary table printed last.
#
#   scripts/gpu_check.sh              (from anywhere; it runs in the repository root)
#   scripts/gpu_check.sh --dry-run    installs and runs nothing: which interpreter, the exact
#                                     commands and time limits of every stage, the gpu tests as
#                                     collected and why each would be skipped here
#   scripts/gpu_check.sh --help
#
# vLLM does not fit on every test machine (no package index, a 336 MB wheel): without an
# importable vllm, the step runs with the reference engine and the summary says vLLM was skipped
# and why; everything else still runs.
#
# Interpreter, the first that works:
#   BUBBLESPEC_PYTHON=/path/to/python   used as it is, nothing installed
#   .venv/ or .cache/gpu-venv/          when its torch sees a CUDA device
#   a new virtualenv, .cache/gpu-venv   (.venv is left to `make setup` and its CPU stack.) If the
#                                       machine's python3 has a CUDA torch, the virtualenv sees it
#                                       (--system-site-packages) and only the project's
#                                       dependencies and test extras are added; otherwise
#                                       `pip install -e .[gpu,test]` brings torch, vLLM and
#                                       Transformer Engine.
# Settings:
#   WHEELHOUSE=DIR       install from DIR only (pip --no-index), for machines without an index;
#                        default: ./wheels when it exists
#   GPU_CHECK_EXTRAS=1   also install the [gpu] extra into a virtualenv that reuses the machine's
#                        torch (off by default: vLLM pins its own torch build, a multi-GB download
#                        that would shadow the machine's)
#   GPU_CHECK_OUT=DIR    logs, JUnit XML, benchmark JSON and metrics (default runs/gpu-check)
#   GPU_CHECK_BUDGET_S   overall time limit in seconds (default 290)
# Every stage runs under `timeout`; a failing stage is recorded and the next one still runs.
# Exit status: 0 when every stage passed, 1 otherwise.

set -uo pipefail

DRY_RUN=0
for arg in "$@"; do
    case "$arg" in
        --dry-run|-n) DRY_RUN=1 ;;
        --help|-h) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$arg' (use --dry-run or --help)" >&2; exit 2 ;;
    esac
done

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1
OUT=${GPU_CHECK_OUT:-runs/gpu-check}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
START=$(date +%s)
DEADLINE=$((START + ${GPU_CHECK_BUDGET_S:-290}))
WHEELHOUSE=${WHEELHOUSE:-}
if [[ -z $WHEELHOUSE && -d wheels ]]; then
    WHEELHOUSE=$ROOT/wheels
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export BUBBLESPEC_GPU_METRICS=$OUT/gpu-metrics.jsonl
export TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-1}
export VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-0}
rm -f "$BUBBLESPEC_GPU_METRICS"

NAMES=() RESULTS=() SECONDS_TAKEN=() DETAILS=()
FAILED=0

say() { printf '\n== %s\n' "$*"; }

record() {  # stage result seconds detail
    NAMES+=("$1") RESULTS+=("$2") SECONDS_TAKEN+=("$3") DETAILS+=("$4")
    [[ $2 == ok || $2 == skipped ]] || FAILED=1
}

# Seconds a stage may take: at most $1, leaving $2 seconds for the stages after it.
budget() {
    local left=$((DEADLINE - $(date +%s) - $2))
    ((left < $1)) || left=$1
    ((left > 5)) || left=5
    echo "$left"
}

# ------------------------------------------------------------------------------ stages

# The commands of the stages, as run (and as --dry-run prints them); PY is set by then.
STEP_TEST=tests/test_gpu_step.py
info_cmd() { CMD=("$PY" -m megatron_bubblespec.cli info); }
tests_cmd() {
    CMD=("$PY" -m pytest -m gpu -q tests/ --ignore="$STEP_TEST" -p no:cacheprovider
         --continue-on-collection-errors --junitxml="$OUT/pytest-gpu.xml")
}
step_cmd() { CMD=("$PY" -m pytest -m gpu -q -s "$STEP_TEST" -p no:cacheprovider); }
bench_cmd() {  # engine
    CMD=("$PY" -m megatron_bubblespec.cli bench-engine --engine "$1" --model tiny
         --batch-sizes 1,8 --prompt-len 64 --new-tokens 32 --repeats 3 --out "$OUT/bench-$1.json")
}
vllm_status() {  # "ok <version>" or the reason vLLM cannot run here
    "$PY" - <<'PY' 2>/dev/null || echo "the interpreter does not run"
import sys
try:
    import torch
    import vllm
except Exception as err:            # ImportError, or a broken CUDA build
    print(f"not importable: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
    sys.exit(0)
print(f"ok {vllm.__version__}" if torch.cuda.is_available() else
      f"importable ({vllm.__version__}) but torch sees no CUDA device")
PY
}

dry_run() {
    PY=${BUBBLESPEC_PYTHON:-}
    if [[ -n $PY ]]; then
        echo "interpreter: BUBBLESPEC_PYTHON=$PY, used as it is"
    else
        PY=$(cuda_venv_python)
        [[ -n $PY ]] && echo "interpreter: $PY (its torch sees CUDA); missing requirements" \
            "would be installed"
    fi
    if [[ -z $PY ]]; then
        if torch_cuda "${PYTHON:-python3}"; then
            echo "interpreter: would create .cache/gpu-venv from ${PYTHON:-python3} (CUDA torch," \
                 "--system-site-packages) and install the missing requirements" \
                 "${WHEELHOUSE:+from $WHEELHOUSE only}"
        else
            echo "interpreter: no CUDA torch here; the real run would fall back to .venv or install" \
                 ".[gpu,test] into .cache/gpu-venv"
        fi
        PY=$ROOT/.venv/bin/python
        [[ -x $PY ]] || PY=${PYTHON:-python3}
        echo "  (this dry run collects with $PY)"
    fi
    local budget_s=${GPU_CHECK_BUDGET_S:-290} engine=reference vllm
    vllm=$(vllm_status)
    [[ $vllm == ok* ]] && engine=vllm
    echo
    echo "stages, each under 'timeout' (seconds at most; all within GPU_CHECK_BUDGET_S=$budget_s):"
    printf '  %-12s %4s  %s\n' nvidia-smi 20 "nvidia-smi -L"
    info_cmd; printf '  %-12s %4s  %s\n' info 45 "${CMD[*]}"
    tests_cmd; printf '  %-12s %4s  %s\n' "gpu tests" 180 "${CMD[*]}"
    step_cmd; printf '  %-12s %4s  %s\n' "step" 120 "${CMD[*]}"
    bench_cmd "$engine"; printf '  %-12s %4s  %s\n' benchmark 120 "${CMD[*]}"
    echo "  vLLM: $vllm${engine:+ -> step and benchmark use the $engine engine}"
    echo
    echo "the gpu tests as collected here, and why each is skipped on this machine:"
    "$PY" -m pytest -m gpu -v -rs tests/ -p no:cacheprovider --continue-on-collection-errors \
        2>&1 | grep -E '(::| SKIPPED|^SKIPPED|^ERROR|^E  |[0-9]+ (passed|skipped|deselected|error))' \
        | tail -60
    local rc=${PIPESTATUS[0]}
    ((rc == 0 || rc == 5)) || echo "pytest exit $rc: the real run would report these errors"
    return $((rc == 0 || rc == 5 ? 0 : 1))
}

# ------------------------------------------------------------------------------ environment

torch_cuda() {  # exit 0 when $1 imports a torch that sees a CUDA device
    "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1
}

cuda_venv_python() {  # the first of .venv, .cache/gpu-venv whose torch sees a CUDA device
    local dir
    for dir in .venv .cache/gpu-venv; do
        if [[ -x $dir/bin/python ]] && torch_cuda "$dir/bin/python"; then
            echo "$ROOT/$dir/bin/python"
            return
        fi
    done
}

has_torch() {
    "$1" -c 'import torch' >/dev/null 2>&1
}

pip_install() {  # python timeout_s args... (the wheelhouse, when set, is the only source)
    local py=$1 limit=$2
    shift 2
    local source=()
    if [[ -n $WHEELHOUSE ]]; then
        source=(--no-index --find-links "$WHEELHOUSE")
    fi
    timeout "$limit" "$py" -m pip install --disable-pip-version-check --retries 1 --timeout 20 \
        "${source[@]}" "$@" >>"$OUT/environment.log" 2>&1
}

missing_requirements() {  # the project's requirements (torch aside) that $1 does not satisfy
    "$1" - <<'PY'
import importlib.metadata as md
import tomllib

try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
# transformers writes the tiny test checkpoints; psutil and tqdm serve megatron-core.
wanted = project["dependencies"] + project["optional-dependencies"]["test"] + [
    "transformers", "psutil", "tqdm"]
for text in wanted:
    req = Requirement(text)
    if req.name == "torch":
        continue
    try:
        ok = req.specifier.contains(md.version(req.name), prereleases=True)
    except md.PackageNotFoundError:
        ok = False
    if not ok:
        print(text)
PY
}

# Install what $1 lacks in one pip call; from a wheelhouse, retry one requirement per call so
# that one absent wheel does not block the others.
install_missing() {
    local py=$1 missing req reqs=() failed=()
    if ! missing=$(missing_requirements "$py" 2>>"$OUT/environment.log"); then
        echo "could not read the requirements of pyproject.toml with $py (needs Python >= 3.11)"
        return 1
    fi
    while read -r req; do
        [[ -n $req ]] && reqs+=("$req")
    done <<<"$missing"
    ((${#reqs[@]})) || return 0
    echo "installing ${reqs[*]}"
    pip_install "$py" "$(budget 120 180)" "${reqs[@]}" && return 0
    if [[ -n $WHEELHOUSE ]]; then
        for req in "${reqs[@]}"; do
            pip_install "$py" "$(budget 60 180)" "$req" || failed+=("$req")
        done
    else
        failed=("${reqs[@]}")
    fi
    if ((${#failed[@]})); then
        echo "could not install: ${failed[*]} (see $OUT/environment.log; set WHEELHOUSE to a" \
             "directory of wheels on a machine without a package index)"
        return 1
    fi
}

make_venv() {  # dir base_python [--system-site-packages]
    local dir=$1 base=$2
    shift 2
    echo "creating the virtualenv $dir from $base $*"
    "$base" -m venv --clear "$@" "$dir" >>"$OUT/environment.log" 2>&1 || {
        echo "could not create $dir with '$base -m venv' (on Debian/Ubuntu: apt-get install" \
             "python3-venv); see $OUT/environment.log"
        return 1
    }
}

choose_python() {  # sets PY; prints what it did
    local base=${PYTHON:-python3} dir
    if [[ -n ${BUBBLESPEC_PYTHON:-} ]]; then
        PY=$BUBBLESPEC_PYTHON
        echo "using BUBBLESPEC_PYTHON=$PY as it is"
        return 0
    fi
    PY=$(cuda_venv_python)
    if [[ -n $PY ]]; then
        install_missing "$PY"
        return
    fi
    dir=.cache/gpu-venv
    if torch_cuda "$base"; then
        make_venv "$dir" "$base" --system-site-packages || { PY=$base; return 1; }
        PY=$ROOT/$dir/bin/python
        install_missing "$PY" || return 1
        if [[ ${GPU_CHECK_EXTRAS:-0} == 1 ]]; then
            echo "installing the [gpu] extra (vLLM, Transformer Engine)"
            pip_install "$PY" "$(budget 240 120)" -e ".[gpu]" ||
                echo "the [gpu] extra did not install; vLLM and Transformer Engine checks are skipped"
        fi
        return 0
    fi
    if [[ -x .venv/bin/python ]] && has_torch .venv/bin/python; then
        PY=$ROOT/.venv/bin/python
        echo "no CUDA torch on this machine: using .venv (the gpu tests will be skipped)"
        return 1
    fi
    echo "no torch found: installing the project with its [gpu,test] extras into $dir"
    make_venv "$dir" "$base" || { PY=$base; return 1; }
    PY=$ROOT/$dir/bin/python
    if ! pip_install "$PY" "$(budget 240 120)" -e ".[gpu,test]" transformers; then
        echo "pip install -e .[gpu,test] failed (see $OUT/environment.log): install a CUDA torch" \
             "first, or point BUBBLESPEC_PYTHON at an interpreter that has one"
        return 1
    fi
    torch_cuda "$PY" || { echo "the installed torch does not see a CUDA device"; return 1; }
}

if ((DRY_RUN)); then
    dry_run
    exit $?
fi

say "environment"
t0=$(date +%s)
PY=python3
if choose_python; then env_result=ok; else env_result=FAILED; fi
env_detail=$("$PY" -c 'import sys, torch; print(f"{sys.executable}: python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.cuda.is_available()}")' 2>/dev/null) ||
    env_detail="$PY: torch does not import"
echo "$env_detail"
record environment "$env_result" $(($(date +%s) - t0)) "$env_detail"

# ------------------------------------------------------------------------------ device and stack

say "nvidia-smi -L"
t0=$(date +%s)
if smi=$(timeout 20 nvidia-smi -L 2>&1); then
    echo "$smi"
    record nvidia-smi ok $(($(date +%s) - t0)) "$(head -1 <<<"$smi")"
else
    echo "$smi"
    record nvidia-smi FAILED $(($(date +%s) - t0)) "nvidia-smi missing or failing"
fi

say "bubblespec info"
t0=$(date +%s)
info_cmd
if timeout "$(budget 45 220)" "${CMD[@]}" | tee "$OUT/info.log"; then
    record info ok $(($(date +%s) - t0)) "$(awk '$1 ~ /^(megatron-core|vllm|transformer-engine)$/ {
        v = ($2 == "not") ? "-" : $2; printf "%s%s %s", sep, $1, v; sep = ", " }' "$OUT/info.log")"
else
    record info FAILED $(($(date +%s) - t0)) "see the output above"
fi

# ------------------------------------------------------------------------------ tests

say "pytest -m gpu tests/"
t0=$(date +%s)
junit=$OUT/pytest-gpu.xml
rm -f "$junit"
# --continue-on-collection-errors: a test module whose optional dependency is missing on this
# machine must not stop the gpu tests from running.
tests_cmd
timeout -k 10 "$(budget 180 170)" "${CMD[@]}" 2>&1 | tee "$OUT/pytest-gpu.log"
test_rc=${PIPESTATUS[0]}
read -r passed failed errors skipped < <("$PY" - "$junit" <<'PY' 2>/dev/null
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
print(n["tests"] - n["failures"] - n["errors"] - n["skipped"], n["failures"], n["errors"],
      n["skipped"])
PY
)
if [[ -n ${passed:-} ]]; then
    counts="$passed passed, $failed failed, $errors errors, $skipped skipped"
else
    counts="no JUnit report"
fi
if ((test_rc == 124 || test_rc == 137)); then
    record "gpu tests" TIMEOUT $(($(date +%s) - t0)) "$counts"
elif ((test_rc != 0)); then
    record "gpu tests" FAILED $(($(date +%s) - t0)) "$counts (pytest exit $test_rc)"
elif ((${passed:-0} == 0)); then   # all skipped: torch saw no CUDA device
    record "gpu tests" NONE-RAN $(($(date +%s) - t0)) "$counts"
else
    record "gpu tests" ok $(($(date +%s) - t0)) "$counts"
fi

# ------------------------------------------------------------------------------ one whole step

say "vLLM"
vllm=$(vllm_status)
echo "vllm: $vllm"
if [[ $vllm == ok* ]]; then
    record vllm ok 0 "vllm ${vllm#ok }"
else
    record vllm skipped 0 "$vllm; the step uses the reference engine"
fi

say "one BubbleSpec step per dtype ($STEP_TEST)"
t0=$(date +%s)
step_cmd
timeout -k 10 "$(budget 120 50)" "${CMD[@]}" 2>&1 | tee "$OUT/step.log"
step_rc=${PIPESTATUS[0]}
step_tail=$(tail -1 "$OUT/step.log")
if ((step_rc == 124 || step_rc == 137)); then
    record step TIMEOUT $(($(date +%s) - t0)) "see $OUT/step.log"
elif ((step_rc != 0)); then
    record step FAILED $(($(date +%s) - t0)) "$step_tail"
elif [[ $step_tail != *passed* ]]; then   # all skipped: torch saw no CUDA device
    record step NONE-RAN $(($(date +%s) - t0)) "$step_tail"
else
    record step ok $(($(date +%s) - t0)) "$step_tail"
fi

# ------------------------------------------------------------------------------ benchmark

engines=(reference)
if "$PY" -c 'import importlib.metadata as m, sys, torch; m.version("vllm"); sys.exit(0 if torch.cuda.is_available() else 1)' \
    >/dev/null 2>&1; then
    engines=(vllm reference)   # the reference engine only if vLLM fails
fi
bench_result=FAILED bench_detail="no engine finished"
t0=$(date +%s)
for engine in "${engines[@]}"; do
    say "bubblespec bench-engine --engine $engine"
    json=$OUT/bench-$engine.json
    rm -f "$json"
    bench_cmd "$engine"
    if timeout -k 10 "$(budget 120 10)" "${CMD[@]}" 2>&1 | tee "$OUT/bench-$engine.log" &&
        [[ -s $json ]]; then
        bench_detail=$("$PY" - "$json" <<'PY' 2>/dev/null
import json
import sys

report = json.load(open(sys.argv[1]))
engine = report["settings"]["engines"][0]
where = "CUDA" if engine == "vllm" else "CPU torch"
decode = ", ".join(f"b{r['batch_size']} {r['decode_step_median_s'] * 1e3:.2f}"
                   for r in report["rows"])
print(f"{engine} engine ({where}), tiny model: decode ms p50 {decode}")
PY
) || bench_detail="$engine: unreadable report $json"
        bench_result=ok
        break
    fi
    bench_detail="$engine engine failed or timed out (see $OUT/bench-$engine.log)"
done
record benchmark "$bench_result" $(($(date +%s) - t0)) "$bench_detail"

# ------------------------------------------------------------------------------ summary

bf16=$("$PY" - "$BUBBLESPEC_GPU_METRICS" <<'PY' 2>/dev/null
import json
import sys

for line in open(sys.argv[1]):
    m = json.loads(line)
    if m["check"] == "bf16_vs_fp32_verifier":
        print(f"bf16 vs fp32 verifier ({m['spec']} spec): positions "
              f"{m['position_agreement']:.3f}, accepted prefix {m['accepted_prefix_agreement']:.3f}, "
              f"requests {m['request_agreement']:.3f}, max |dlogit| {m['max_logit_abs_diff']:.3g}")
PY
) || bf16=""

total=$(($(date +%s) - START))
say "gpu check summary (details in $OUT)"
printf '%-12s %-8s %7s  %s\n' stage result time_s detail
for i in "${!NAMES[@]}"; do
    printf '%-12s %-8s %7s  %s\n' "${NAMES[$i]}" "${RESULTS[$i]}" "${SECONDS_TAKEN[$i]}" "${DETAILS[$i]}"
done
[[ -n $bf16 ]] && printf '%-12s %-8s %7s  %s\n' numerics "" "" "$bf16"
"$PY" - "$BUBBLESPEC_GPU_METRICS" <<'PY' 2>/dev/null
import json
import sys

rows = [json.loads(line) for line in open(sys.argv[1])]
steps = [m for m in rows if m["check"].startswith("step_")]
logits = {m["check"].removeprefix("target_logits_"): m for m in rows
          if m["check"].startswith("target_logits_")}
if steps:
    print(f"\n{'step':9} {'engine':16} {'verify_s':>8} {'accepted':>8} {'spec!=plain':>11} "
          f"{'gap max':>9} {'gap mean':>9} {'after max':>9}  on-policy check")
for m in steps:
    print(f"{m['dtype']:9} {m['engine']:16} {m['verify_s']:8.2f} "
          f"{m['accepted_tokens']:>4}/{m['drafted_tokens']:<4}"
          f"{m['spec_vs_plain_mismatched_samples']:>5}/{m['samples']:<5} "
          f"{m['gap_before_max']:9.2e} {m['gap_before_mean']:9.2e} {m['gap_after_max']:9.2e}  "
          f"{m['on_policy_check']}")
if logits:
    print(f"\n{'target logits, verifier vs plain context':42} {'positions':>9} {'max |d|':>9} "
          f"{'draw flips':>10} {'near ties':>9}")
for dtype, m in logits.items():
    print(f"{dtype + ' (' + m['engine'] + ')':42} {m['positions']:>9} "
          f"{m['max_logit_abs_diff']:9.2e} {m['draw_flips']:>10} {m['near_ties']:>9}")
PY
printf '%-12s %-8s %7s  %s\n' total "" "$total" "wall time (limit ${GPU_CHECK_BUDGET_S:-290} s)"
exit "$FAILED"
