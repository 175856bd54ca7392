#!/usr/bin/env bash
# One-GPU check of the CUDA code paths in about five minutes. scripts/gpu_env.py prepares a Python
# with a CUDA torch (its docstring: which interpreter, WHEELHOUSE, GPU_CHECK_EXTRAS, GPU_CHECK_OUT,
# GPU_CHECK_BUDGET_S), then runs scripts/gpu_check.py with it, whose stages are the environment,
# `nvidia-smi -L`, `bubblespec info`, the tests marked `gpu` (keyed sampler on CUDA, Megatron
# verifier over NCCL, bfloat16 numerics), whether vLLM runs, one whole BubbleSpec step per dtype
# (tests/test_gpu_step.py) and a short engine benchmark; it prints a summary table last. Without
# an importable vllm the step runs with the reference engine and the table says why.
#
#   scripts/gpu_check.sh              (from anywhere; it runs in the repository root)
#   scripts/gpu_check.sh --dry-run    installs and runs nothing: which interpreter, the exact
#                                     commands and time limits of every stage, the gpu tests as
#                                     collected and why each would be skipped here
#   scripts/gpu_check.sh --help
#
# Every stage runs under a time limit; a failing stage is recorded and the next one still runs.
# Exit status: 0 when every stage passed, 1 otherwise.
set -uo pipefail
case "${1:-}" in
    --help|-h) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
esac
exec "${PYTHON:-python3}" "$(dirname "${BASH_SOURCE[0]}")/gpu_env.py" "$@"
