"""One engine's rollout, verification, bubble, rewards and sync -> its raw step metrics (the
per-engine dict ``metrics.aggregate`` reduces over the engines)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_bubblespec.machine import peak_rss_gb
from megatron_bubblespec.metrics import decode_steps_plain
from megatron_bubblespec.sampling.requests import RolloutResult
from megatron_bubblespec.speculative.bubble import BubbleStats


@dataclass
class EngineRollout:
    """What this rank's engine produced in stages 2-3 (its leader only)."""

    results: list[RolloutResult]     # of its share of the replica's samples
    seconds: float
    engine_steps: int
    bubble: dict | None = None       # the bubble's metrics


def bubble_metrics(stats: BubbleStats, drafted_anything: bool) -> dict:
    """The bubble's metrics; its idle time was draftable only when there was something to
    draft."""
    return {"bubble/idle_s": stats.idle_s, "bubble/drafting_s": stats.drafting_s,
            "bubble/overshoot_s": stats.overshoot_s,
            "bubble/draftable_s": stats.idle_s if drafted_anything else 0.0,
            "bubble/engine_steps": stats.engine_steps,
            "bubble/new_tokens": stats.new_tokens,
            "bubble/refreshed_drafts": stats.refreshed,
            "bubble/prefill_tokens": stats.prefill_tokens}


def engine_metrics(mine: EngineRollout, drafted: list[int], accepted: list[int],
                   verify_s: float, rewards, sync_metrics: dict, weight_version: int,
                   measured: dict) -> dict:
    """One engine's raw step metrics over its share of the samples: ``drafted`` and
    ``accepted`` draft tokens, ``rewards`` (``data.tasks.RewardBreakdown``) per sample, the
    ``weight_version`` that rolled them out, and the engine's ``measured`` costs, if any."""
    results = mine.results
    lengths = [len(r.token_ids) for r in results]
    verified = [a for d, a in zip(drafted, accepted) if d]
    metrics = {
        "rollout/time_s": mine.seconds,
        "rollout/decode_steps": sum(r.decode_steps for r in results),
        "rollout/decode_steps_plain": decode_steps_plain(lengths),
        "rollout/engine_steps": mine.engine_steps,
        "spec/continuation_proposed_tokens": sum(r.proposed_tokens for r in results),
        "spec/continuation_accepted_tokens": sum(r.accepted_tokens for r in results),
        **continuation_by_source(results),
        "rollout/tokens": sum(lengths),
        "rollout/max_response_len": max(lengths, default=0),
        "train/reward_mean": sum(x.total for x in rewards) / max(len(rewards), 1),
        "train/accuracy": sum(x.correct for x in rewards) / max(len(rewards), 1),
        **reward_parts(rewards),
        "exact/weight_version": weight_version,
        "spec/drafted_samples": len(verified),
        "spec/drafted_tokens": sum(drafted),
        # a draft that runs on past its response's end covers the response only up to there
        "spec/drafted_tokens_in_response": sum(min(d, n) for d, n in zip(drafted, lengths)),
        "spec/accepted_tokens": sum(accepted),
        "spec/verify_s": verify_s,
        "memory/rss_peak_gb": peak_rss_gb(),
        **(mine.bubble or {}), **sync_metrics,
    }
    if verified:
        metrics["spec/accepted_prefix_mean"] = sum(verified) / len(verified)
    metrics.update(measured)
    return metrics


def reward_parts(rewards) -> dict:
    """train/reward/<part>: each part's mean over the samples, and how many ran out of time."""
    parts = sorted({name for x in rewards for name in x.parts})
    metrics = {f"train/reward/{part}": sum(x.parts.get(part, 0.0) for x in rewards)
               / len(rewards) for part in parts}
    metrics["train/reward_timeouts"] = sum(x.outcome == "timeout" for x in rewards)
    return metrics


def continuation_by_source(results) -> dict:
    """spec/continuation_{proposed,accepted}_tokens/<source>, summed over the results."""
    metrics: dict = {}
    for r in results:
        for source, (proposed, accepted) in r.by_source.items():
            for kind, n in (("proposed", proposed), ("accepted", accepted)):
                key = f"spec/continuation_{kind}_tokens/{source}"
                metrics[key] = metrics.get(key, 0) + n
    return metrics
