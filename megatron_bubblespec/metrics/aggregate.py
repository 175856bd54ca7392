"""Step aggregation: one metric dict per rollout engine -> one step record (sums, maxima, means, ratios).

Each rollout engine (``loop.layout``; one per DP rank in a DP-only layout) reports the raw metrics
of its own share of the step under the names of metrics.registry ("rollout/tokens", "bubble/idle_s", ...);
"rank r" below is the engine with global index r, and the per-engine keys are ``rank{r}/...``.
How each metric reduces is declared once, in ``metrics.registry``. The ratios are never averaged
across ranks: they are recomputed from the aggregated sums, so a rank with more samples weighs
more. A rank that does not report a metric (or reports None) is left out of that metric; a record
holds only metrics that at least one rank reported, and a ratio only when its inputs are there
(NaN when its denominator is 0).
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

from megatron_bubblespec.metrics.registry import (DERIVED, MAX, MEAN, METRICS,
                                                  PER_ENGINE_METRICS, REPORTED, SAME, SUM,
                                                  WEIGHTED, engine_key, family_of,
                                                  metrics_reduced_by)

RankMetrics = Mapping[str, float | None]


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


def aggregate_step(step: int, rank_metrics: Sequence[RankMetrics]) -> dict:
    """The step record of ``step`` from the per-rank dicts, listed in DP rank order.

    Rules (``n`` ranks, ``T`` = the step's rollout wall time = max over ranks of rollout/time_s),
    each metric's reduction as ``metrics.registry`` declares it:

    * sums: counts (decode steps, tokens, drafted / accepted counts, the bubbles' engine steps,
      new draft tokens and prefilled tokens, reshard bytes, the continuation's counts per
      proposal source) and bubble seconds as rank-seconds;
    * max: rollout/time_s, max_response_len, engine steps (the straggler's: what the step waits
      for), verify / reshard wall time, logprob gap;
    * mean: losses, rewards, KLs, grad norm, lr;
    * spec/accepted_prefix_mean: mean weighted by each rank's spec/drafted_samples;
    * exact/weight_version: identical on every rank, else ValueError;
    * derived (:func:`derive`): tokens per second, bubble ratio and utilization, accept rates,
      decode steps saved, the engines' summed engine steps, the largest overshoot;
    * per rank r (:func:`per_engine`): ``rank{r}/<key>`` for the registry's per-engine keys.
    """
    _check_reported(step, rank_metrics)
    record: dict = {"step": step, "rollout/engines": len(rank_metrics)}
    record.update(_reduced(step, rank_metrics))
    record.update(derive(record, rank_metrics))
    for r, metrics in enumerate(rank_metrics):
        record.update(per_engine(r, metrics, record.get("rollout/time_s")))
    return record


def _check_reported(step: int, rank_metrics: Sequence[RankMetrics]) -> None:
    if not rank_metrics:
        raise ValueError(f"step {step}: no rank metrics to aggregate; pass one dict per DP rank")
    reported = [m.name for m in METRICS.values() if m.reduce in REPORTED]
    for r, metrics in enumerate(rank_metrics):
        unknown = sorted(k for k in metrics if not _reportable(k))
        if unknown:
            derived = all(k in METRICS and METRICS[k].reduce == DERIVED for k in unknown)
            hint = ("they are computed from the aggregated sums; do not report them" if derived
                    else f"known metrics: {', '.join(reported)} (declare new ones in "
                         "megatron_bubblespec/metrics/registry.py)")
            raise ValueError(f"step {step}, rank {r}: cannot aggregate {unknown}; {hint}")


def _reportable(key: str) -> bool:
    metric = METRICS.get(key) or family_of(key)
    return metric is not None and metric.reduce in REPORTED


def _reduced(step: int, rank_metrics: Sequence[RankMetrics]) -> dict:
    """The reported metrics, each reduced over the ranks that report it."""
    def reported(key: str) -> list[float]:
        return [m[key] for m in rank_metrics if m.get(key) is not None]

    record: dict = {}
    plain = [m.name for m in metrics_reduced_by(SUM) if not m.per_source]
    # The families' members come after the other keys of their reduction, in key order.
    members = sorted({k for m in rank_metrics for k in m if k not in METRICS
                      and family_of(k) is not None})
    by_source = [k for k in members if family_of(k).reduce == SUM]
    for key in (*plain, *by_source):
        if values := reported(key):
            record[key] = sum(values)
    for metric in metrics_reduced_by(MAX):
        if values := reported(metric.name):
            record[metric.name] = max(values)
    means = [m.name for m in metrics_reduced_by(MEAN) if not m.family]
    for key in (*means, *(k for k in members if family_of(k).reduce == MEAN)):
        if values := reported(key):
            record[key] = sum(values) / len(values)
    for metric in metrics_reduced_by(WEIGHTED):
        if (mean := _weighted_mean(step, rank_metrics, metric.name, metric.weight)) is not None:
            record[metric.name] = mean
    for metric in metrics_reduced_by(SAME):
        if values := reported(metric.name):
            if len(set(values)) > 1:
                raise ValueError(f"step {step}: ranks disagree on {metric.name}: {values} (in "
                                 "rank order); every rank must hold the same policy weights")
            record[metric.name] = values[0]
    return record


def _weighted_mean(step: int, rank_metrics: Sequence[RankMetrics], key: str,
                   weight_key: str) -> float | None:
    pairs = [(m.get(weight_key), m[key]) for m in rank_metrics if m.get(key) is not None]
    if not pairs:
        return None
    if any(w is None for w, _ in pairs):
        raise ValueError(f"step {step}: {key} is a per-sample mean; every rank reporting it "
                         f"must also report {weight_key}")
    pairs = [(w, v) for w, v in pairs if w > 0]
    return ratio(sum(w * v for w, v in pairs), sum(w for w, _ in pairs))


def derive(record: Mapping[str, float], rank_metrics: Sequence[RankMetrics]) -> dict:
    """The derived metrics from the reduced ones (see :func:`aggregate_step`)."""
    out: dict = {}
    wall = record.get("rollout/time_s")
    if "rollout/tokens" in record and wall is not None:
        out["rollout/tokens_per_s"] = ratio(record["rollout/tokens"], wall)
    if "bubble/idle_s" in record and wall is not None:
        out["bubble/ratio"] = ratio(record["bubble/idle_s"], len(rank_metrics) * wall)
    if "bubble/drafting_s" in record and (usable := _draftable(record)) is not None:
        out["bubble/utilization"] = ratio(record["bubble/drafting_s"], usable)
    if values := [m["rollout/engine_steps"] for m in rank_metrics
                  if m.get("rollout/engine_steps") is not None]:
        out["rollout/engine_steps_sum"] = sum(values)
    if values := [m["bubble/overshoot_s"] for m in rank_metrics
                  if m.get("bubble/overshoot_s") is not None]:
        out["bubble/overshoot_wall_s"] = max(values)
    for rate, num, den in _RATES:
        if num in record and den in record:
            out[rate] = ratio(record[num], record[den])
    if "rollout/decode_steps" in record and "rollout/decode_steps_plain" in record:
        out["spec/decode_steps_saved_frac"] = 1.0 - ratio(record["rollout/decode_steps"],
                                                          record["rollout/decode_steps_plain"])
    return out


# (rate, numerator, denominator) of the step's pooled rates.
_RATES = (("spec/continuation_accept_rate", "spec/continuation_accepted_tokens",
           "spec/continuation_proposed_tokens"),
          ("spec/accept_rate", "spec/accepted_tokens", "spec/drafted_tokens"))


def per_engine(engine: int, metrics: RankMetrics, wall: float | None) -> dict:
    """Engine ``engine``'s own values, as reported, but its bubble ratio (idle_s / the step's
    wall time) and utilization (drafting_s / draftable_s, or / idle_s), under ``rank{r}/``."""
    idle, drafting = metrics.get("bubble/idle_s"), metrics.get("bubble/drafting_s")
    usable = _draftable(metrics)
    own = {m.name: metrics.get(m.name) for m in PER_ENGINE_METRICS}
    own["bubble/ratio"] = ratio(idle, wall) if idle is not None else None
    own["bubble/utilization"] = (ratio(drafting, usable)
                                 if usable is not None and drafting is not None else None)
    return {engine_key(engine, key): v for key, v in own.items() if v is not None}
