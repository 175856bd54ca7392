"""Engine and Megatron logprobs of the same rollout tokens -> their gap -> a hard failure when the engine is off-policy.

The rollout engine reports a logprob for every token it draws; the trainer's first forward of the
step gives Megatron's logprob of the same tokens under the same weights (version t). Both run one
policy, so they may differ only by floating-point noise. A gap beyond that noise means the engine
did not run the trainer's weights, so the step's tokens were not drawn from the policy being
trained, which is the one thing this project promises. ``check_on_policy`` raises then.

Limits, by the dtype the policy runs in (the max is over every response token of the rank's step;
the measured noise they rest on is in docs/results/onpolicy-gap.md):
- float32 (CPU): max |engine - Megatron| far above the measured fp32 noise of every family (dense
  and MoE), and below what one stale Adam step of the LM head gives, the bug it exists for.
- bfloat16 (GPU): provisional. bf16 kernels of vLLM and Transformer Engine differ, and a max over
  tokens in bf16 is dominated by a few low-probability tokens, so the limit is on the mean
  |difference| with only a loose max against gross errors (scripts/gpu_check.sh prints the gap).

Mixtures of experts: vLLM's fused MoE and Megatron's router compute the router scores in other
orders, so a token whose top-k experts are a near-tie may be routed differently, which moves its
logprob by more than fp32 noise. The limit stays the same; the error says to look there too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GapLimit:
    dtype: str
    max_abs: float          # limit on max |engine - Megatron| over the step's tokens
    mean_abs: float         # limit on the mean |engine - Megatron|
    basis: str              # what the numbers rest on


LIMITS = {
    "float32": GapLimit("float32", 1e-3, math.inf,
                        "above the measured fp32 noise, docs/results/onpolicy-gap.md"),
    "float64": GapLimit("float64", 1e-3, math.inf, "the float32 limit (float64 is tighter)"),
    "bfloat16": GapLimit("bfloat16", 1.0, 2e-2, "provisional, not measured on a GPU yet"),
}

CHECKLIST = (
    "reshard: every tensor reached the engine, with the trainer's names, shapes and dtypes "
    "(sync/reshard_bytes against the model's size; strict loading on the engine side)",
    "tied LM head: with tie_word_embeddings the engine's output projection must follow the updated "
    "input embeddings; untied, lm_head.weight must be sent",
    "prefix cache: reset after every weight update, or prompts reuse keys/values of older weights",
    "weight version: the engine's weight_version equals the trainer's at rollout time",
    "mixture of experts: a rare token whose router scores tie closely may pick other experts in "
    "vLLM than in Megatron; a gap at one such token only, with the rest at fp32 noise, is that, "
    "and a gap on most tokens is one of the above (expert weights gathered over EP in order)",
)


class OffPolicyError(RuntimeError):
    """The rollout engine's logprobs do not match the trainer's on the tokens it drew."""


@dataclass(frozen=True)
class LogprobGap:
    max_abs: float
    mean_abs: float
    tokens: int
    worst_sample: int       # index of the sample (in the step's order) holding the max
    worst_position: int     # its response position


def logprob_gap(engine: list[list[float]], megatron: list[list[float]]) -> LogprobGap:
    """Per-response logprob lists of the same tokens -> max and mean |difference| and where the
    max is."""
    if len(engine) != len(megatron) or any(len(a) != len(b) for a, b in zip(engine, megatron)):
        raise ValueError("logprob lists differ in shape: "
                         f"{[len(a) for a in engine]} vs {[len(b) for b in megatron]}")
    rows = [(i, j) for i, row in enumerate(engine) for j in range(len(row))]
    if not rows:
        return LogprobGap(0.0, 0.0, 0, -1, -1)
    diff = (torch.tensor([x for row in engine for x in row], dtype=torch.float64)
            - torch.tensor([x for row in megatron for x in row], dtype=torch.float64)).abs()
    worst = int(diff.argmax())
    return LogprobGap(float(diff[worst]), float(diff.mean()), len(rows), *rows[worst])


def gap_limit(dtype) -> GapLimit:
    name = str(dtype).removeprefix("torch.")
    if name not in LIMITS:
        raise ValueError(f"no on-policy gap limit for dtype {dtype!r}; known: {sorted(LIMITS)}")
    return LIMITS[name]


def check_on_policy(engine_logprobs: list[list[float]], megatron_logprobs: list[list[float]],
                    dtype, *, step: int, weight_version: int) -> float:
    """Raise ``OffPolicyError`` when the engine's and Megatron's logprobs of the step's rollout
    tokens differ by more than the dtype's limit; return the max |difference| (the step's
    ``sync/logprob_abs_diff``)."""
    gap, limit = logprob_gap(engine_logprobs, megatron_logprobs), gap_limit(dtype)
    over = []
    if gap.max_abs > limit.max_abs:
        over.append(f"max {gap.max_abs:.3g} > {limit.max_abs:g}")
    if gap.mean_abs > limit.mean_abs:
        over.append(f"mean {gap.mean_abs:.3g} > {limit.mean_abs:g}")
    if over:
        checks = "\n".join(f"  - {item}" for item in CHECKLIST)
        raise OffPolicyError(
            f"step {step}: the rollout engine is off-policy. Its logprobs of the tokens it drew "
            f"differ from Megatron's under weight version {weight_version} by "
            f"{' and '.join(over)} ({limit.dtype} limits; {limit.basis}) over {gap.tokens} "
            f"tokens; the largest at sample {gap.worst_sample}, response position "
            f"{gap.worst_position}. The engine is not running the trainer's weights. Check:\n"
            f"{checks}")
    return gap.max_abs
