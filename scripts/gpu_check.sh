#!/usr/bin/env bash
# One-GPU check of the CUDA code paths in about five minutes: this wrapper prepares a Python with
# a CUDA torch, then runs scripts/gpu_check.py with it, whose stages are the environment,
# `nvidia-smi -L`, `bubblespec info`, the tests marked `gpu` (keyed sampler on CUDA, Megatron
# verifier over NCCL, bfloat16 numerics), whether vLLM runs, one whole BubbleSpec step per dtype
# (tests/test_gpu_step.py: verification, vLLM rollout with speculative continuation, GRPO step in
# float32 and bfloat16, reshard, the on-policy check, and spec-vs-plain target logits per key and
# position) and a short engine benchmark; it prints a summary table last.
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
# Every stage runs under a time limit; a failing stage is recorded and the next one still runs.
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
CHECKS=$ROOT/scripts/gpu_check.py
OUT=${GPU_CHECK_OUT:-runs/gpu-check}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
START=$(date +%s)
DEADLINE=$((START + ${GPU_CHECK_BUDGET_S:-290}))
WHEELHOUSE=${WHEELHOUSE:-}
if [[ -z $WHEELHOUSE && -d wheels ]]; then
    WHEELHOUSE=$ROOT/wheels
fi
export GPU_CHECK_OUT=$OUT GPU_CHECK_START=$START
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export BUBBLESPEC_GPU_METRICS=$OUT/gpu-metrics.jsonl
export TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-1}
export VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-0}

# Seconds a set-up step may take: at most $1, leaving $2 seconds for the stages after it.
budget() {
    local left=$((DEADLINE - $(date +%s) - $2))
    ((left < $1)) || left=$1
    ((left > 5)) || left=5
    echo "$left"
}

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

# Install what $1 lacks in one pip call; from a wheelhouse, retry one requirement per call so
# that one absent wheel does not block the others.
install_missing() {
    local py=$1 missing req reqs=() failed=()
    if ! missing=$("$py" "$CHECKS" --missing-requirements 2>>"$OUT/environment.log"); then
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

dry_run_python() {  # sets PY to what the real run would use, installing nothing; prints which
    PY=${BUBBLESPEC_PYTHON:-}
    if [[ -n $PY ]]; then
        echo "interpreter: BUBBLESPEC_PYTHON=$PY, used as it is"
        return
    fi
    PY=$(cuda_venv_python)
    if [[ -n $PY ]]; then
        echo "interpreter: $PY (its torch sees CUDA); missing requirements would be installed"
        return
    fi
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
}

if ((DRY_RUN)); then
    dry_run_python
    echo
    exec "$PY" "$CHECKS" --dry-run
fi

printf '\n== set-up of the interpreter\n'
PY=python3
if choose_python; then GPU_CHECK_SETUP=ok; else GPU_CHECK_SETUP=FAILED; fi
export GPU_CHECK_SETUP
exec "$PY" "$CHECKS"
