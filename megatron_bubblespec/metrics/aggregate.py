"""Step aggregation: one metric dict per rollout engine -> one step record (sums, maxima, means, ratios).

Each rollout engine (``loop.layout``; one per DP rank in a DP-only layout) reports the raw metrics
of its own share of the step under the names of DESIGN.md ("rollout/tokens", "bubble/idle_s", ...);
"rank r" below is the engine with global index r, and the per-engine keys are ``rank{r}/...``. The ratios are never averaged across ranks: they are
recomputed from the aggregated sums, so a rank with more samples weighs more. A rank that does not
report a metric (or reports None) is left out of that metric; a record holds only metrics that at
least one rank reported, and a ratio only when its inputs are there (NaN when its denominator is 0).
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

# Counts and rank-seconds: the step's total is the sum over ranks.
SUMMED = (
    "rollout/decode_steps",
    "rollout/decode_steps_plain",
    "rollout/tokens",
    "bubble/idle_s",
    "bubble/drafting_s",
    "bubble/overshoot_s",
    "bubble/draftable_s",
    "bubble/engine_steps",
    "bubble/new_tokens",
    "bubble/prefill_tokens",
    "spec/drafted_samples",
    "spec/drafted_tokens",
    "spec/accepted_tokens",
    "spec/continuation_proposed_tokens",
    "spec/continuation_accepted_tokens",
    "sync/reshard_bytes",
)
# Summed too: the continuation's counts per proposal source, ``<prefix><source>``.
SUMMED_PREFIXES = ("spec/continuation_proposed_tokens/", "spec/continuation_accepted_tokens/")
# Wall times every rank waits for, and worst cases: the step's value is the slowest / worst rank.
MAXED = (
    "rollout/time_s",
    "rollout/max_response_len",
    "rollout/engine_steps",
    "spec/verify_s",
    "sync/reshard_s",
    "sync/logprob_abs_diff",
)
# Losses, rewards and training scalars: the plain mean over the ranks that report them.
MEANED = (
    "train/loss",
    "train/reward_mean",
    "train/accuracy",
    "train/kl",
    "train/grad_norm",
    "train/lr",
    "policy/drift_kl",
    "spec/proposal_token_cost",
)
# Per-sample means: weighted by the rank's count of samples in the key's value.
WEIGHTED = {"spec/accepted_prefix_mean": "spec/drafted_samples"}
# Must be identical on every rank (asserted).
SAME = ("exact/weight_version",)
# Computed here from the aggregated values; ranks must not report them.
DERIVED = (
    "rollout/tokens_per_s",
    "bubble/ratio",
    "bubble/utilization",
    "spec/accept_rate",
    "spec/continuation_accept_rate",
    "spec/decode_steps_saved_frac",
    "rollout/engine_steps_sum",
    "rollout/engines",
    "bubble/overshoot_wall_s",
)
# Also kept per rank, as "rank{r}/<key>".
PER_RANK = ("bubble/idle_s", "bubble/drafting_s", "bubble/overshoot_s", "bubble/draftable_s",
            "bubble/engine_steps", "bubble/new_tokens", "bubble/prefill_tokens", "bubble/ratio",
            "bubble/utilization", "rollout/engine_steps", "rollout/time_s", "spec/drafted_tokens")

REPORTED = SUMMED + MAXED + MEANED + tuple(WEIGHTED) + SAME


def decode_steps_plain(response_lens: Iterable[int]) -> int:
    """Decode steps the same responses need without drafts: sum over samples of (len - 1).

    Prefill produces a response's first token, each decode step one more, so a response of length n
    costs n - 1 decode steps when every token is decoded (an empty response costs none).
    """
    return sum(max(int(n) - 1, 0) for n in response_lens)


def _draftable(metrics: Mapping[str, float | None]) -> float | None:
    """The bubble seconds that could draft: bubble/draftable_s, else (not reported) bubble/idle_s."""
    usable = metrics.get("bubble/draftable_s")
    return usable if usable is not None else metrics.get("bubble/idle_s")


def ratio(numerator: float | None, denominator: float | None) -> float:
    """numerator / denominator; NaN when either is missing or NaN, or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return math.nan
    return numerator / denominator


def aggregate_step(step: int, rank_metrics: Sequence[Mapping[str, float | None]]) -> dict:
    """The step record of ``step`` from the per-rank dicts, listed in DP rank order.

    Rules (``n`` ranks, ``T`` = the step's rollout wall time = max over ranks of rollout/time_s):

    * sums: ``SUMMED`` (decode steps, tokens, drafted / accepted counts, bubble seconds as
      rank-seconds, the bubbles' engine steps, new draft tokens and prefilled tokens, reshard
      bytes) and the continuation's counts per proposal source;
    * max: ``MAXED`` (rollout/time_s, max_response_len, engine steps (the straggler's: what the
      step waits for), verify / reshard wall time, logprob gap); rollout/engine_steps_sum = the sum
      of the ranks' engine steps (the compute spent);
    * mean: ``MEANED`` (losses, rewards, KLs, grad norm, lr);
    * spec/accepted_prefix_mean: mean weighted by each rank's spec/drafted_samples;
    * exact/weight_version: identical on every rank, else ValueError;
    * rollout/tokens_per_s = sum tokens / T;
    * bubble/ratio = sum idle_s / (n * T);
    * bubble/utilization = sum drafting_s / sum draftable_s, the idle time of the bubbles that had
      a next step to draft (a rank's bubble/draftable_s is its idle_s, or 0 at the run's last step
      and wherever drafting is off), so a bubble that cannot draft counts neither way (NaN when no
      bubble could draft); ranks that do not report draftable_s: sum drafting_s / sum idle_s;
    * spec/accept_rate = sum accepted_tokens / sum drafted_tokens;
    * spec/continuation_accept_rate = sum continuation_accepted_tokens / sum
      continuation_proposed_tokens;
    * spec/decode_steps_saved_frac = 1 - sum decode_steps / sum decode_steps_plain, where
      decode_steps_plain is :func:`decode_steps_plain` of the step's responses;
    * rollout/engines = the number of engines that reported (n);
    * bubble/overshoot_wall_s = the largest overshoot of a rank: how long the drafting engines'
      last engine steps held the step past the barrier's close (they run in parallel);
    * per rank r: rank{r}/bubble/{idle_s, drafting_s, overshoot_s, engine_steps, new_tokens,
      prefill_tokens}, rank{r}/rollout/{engine_steps,
      time_s} and rank{r}/spec/drafted_tokens as reported,
      rank{r}/bubble/ratio = idle_s / T and rank{r}/bubble/utilization = drafting_s /
      draftable_s (or / idle_s, as above).
    """
    if not rank_metrics:
        raise ValueError(f"step {step}: no rank metrics to aggregate; pass one dict per DP rank")
    for r, metrics in enumerate(rank_metrics):
        unknown = sorted(k for k in set(metrics) - set(REPORTED)
                         if not k.startswith(SUMMED_PREFIXES))
        if unknown:
            hint = ("they are computed from the aggregated sums; do not report them"
                    if set(unknown) <= set(DERIVED) else f"known metrics: {', '.join(REPORTED)}")
            raise ValueError(f"step {step}, rank {r}: cannot aggregate {unknown}; {hint}")

    def reported(key: str) -> list[float]:
        return [m[key] for m in rank_metrics if m.get(key) is not None]

    record: dict = {"step": step, "rollout/engines": len(rank_metrics)}
    by_source = sorted({k for m in rank_metrics for k in m if k.startswith(SUMMED_PREFIXES)})
    for key in (*SUMMED, *by_source):
        if values := reported(key):
            record[key] = sum(values)
    for key in MAXED:
        if values := reported(key):
            record[key] = max(values)
    for key in MEANED:
        if values := reported(key):
            record[key] = sum(values) / len(values)
    for key, weight_key in WEIGHTED.items():
        pairs = [(m.get(weight_key), m[key]) for m in rank_metrics if m.get(key) is not None]
        if not pairs:
            continue
        if any(w is None for w, _ in pairs):
            raise ValueError(f"step {step}: {key} is a per-sample mean; every rank reporting it "
                             f"must also report {weight_key}")
        pairs = [(w, v) for w, v in pairs if w > 0]
        record[key] = ratio(sum(w * v for w, v in pairs), sum(w for w, _ in pairs))
    for key in SAME:
        if values := reported(key):
            if len(set(values)) > 1:
                raise ValueError(f"step {step}: ranks disagree on {key}: {values} (in rank order); "
                                 f"every rank must hold the same policy weights")
            record[key] = values[0]

    wall = record.get("rollout/time_s")
    if "rollout/tokens" in record and wall is not None:
        record["rollout/tokens_per_s"] = ratio(record["rollout/tokens"], wall)
    if "bubble/idle_s" in record and wall is not None:
        record["bubble/ratio"] = ratio(record["bubble/idle_s"], len(rank_metrics) * wall)
    if "bubble/drafting_s" in record and (usable := _draftable(record)) is not None:
        record["bubble/utilization"] = ratio(record["bubble/drafting_s"], usable)
    if values := reported("rollout/engine_steps"):
        record["rollout/engine_steps_sum"] = sum(values)
    if values := reported("bubble/overshoot_s"):
        record["bubble/overshoot_wall_s"] = max(values)
    if "spec/continuation_proposed_tokens" in record and \
            "spec/continuation_accepted_tokens" in record:
        record["spec/continuation_accept_rate"] = ratio(
            record["spec/continuation_accepted_tokens"], record["spec/continuation_proposed_tokens"])
    if "spec/drafted_tokens" in record and "spec/accepted_tokens" in record:
        record["spec/accept_rate"] = ratio(record["spec/accepted_tokens"],
                                           record["spec/drafted_tokens"])
    if "rollout/decode_steps" in record and "rollout/decode_steps_plain" in record:
        record["spec/decode_steps_saved_frac"] = 1.0 - ratio(record["rollout/decode_steps"],
                                                             record["rollout/decode_steps_plain"])

    for r, metrics in enumerate(rank_metrics):
        idle, drafting = metrics.get("bubble/idle_s"), metrics.get("bubble/drafting_s")
        usable = _draftable(metrics)
        per_rank = {key: metrics.get(key) for key in PER_RANK}   # as reported, but the ratios
        per_rank["bubble/ratio"] = ratio(idle, wall) if idle is not None else None
        per_rank["bubble/utilization"] = (ratio(drafting, usable)
                                          if usable is not None and drafting is not None else None)
        for key in PER_RANK:
            if per_rank[key] is not None:
                record[f"rank{r}/{key}"] = per_rank[key]
    return record
