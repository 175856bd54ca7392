"""Metric declarations: name -> (reduction over engines, run-level value, format, label, header).

Every key of a step record is declared here once. The producers (``loop.step``,
``speculative.bubble``, the trainer) emit the names as strings; step aggregation
(``metrics.aggregate``), the progress line, the end-of-run summary and the bench tables read how to
reduce, format and label each one from this table.

Reductions over the rollout engines of one step (``reduce``):

* ``SUM``: counts and engine-seconds; ``MAX``: wall times every engine waits for, worst cases;
  ``MEAN``: the plain mean over the engines that report it; ``WEIGHTED``: a per-sample mean,
  weighted by each engine's ``weight`` metric; ``SAME``: identical on every engine (asserted);
* ``DERIVED``: computed by the aggregation from the reduced values (engines must not report it);
* ``TRAINER``: the trainer's own step metrics, already global (token means over the whole batch),
  added to the record as they come;
* ``PER_ENGINE``: ``rank{r}/<name>``, engine r's own value of ``<name>``.

The continuation's token counts per proposal source are one declaration per family,
``spec/continuation_{proposed,accepted}_tokens/{source}``, its members named by the sources
(``speculative.sources``); a task's reward parts (``data.tasks.RewardBreakdown``) are one
family, ``train/reward/{part}``, its members named by the task (:func:`family_of`).

``over_run`` is the whole-run value of a metric from its step records (``run_totals``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from megatron_bubblespec.metrics.formatting import count, number, percent, scientific, seconds
from megatron_bubblespec.metrics.reduce import (bubble_utilization, mean_of, pooled_ratio,
                                               total_of, weighted_mean_of)

Record = Mapping[str, object]

SUM, MAX, MEAN, WEIGHTED, SAME = "sum", "max", "mean", "weighted", "same"
DERIVED, TRAINER, PER_ENGINE = "derived", "trainer", "per_engine"
REPORTED = (SUM, MAX, MEAN, WEIGHTED, SAME)    # what an engine may report
SOURCE = "{source}"                             # the placeholder of a per-source family
PART = "{part}"                                 # the placeholder of the reward parts' family


@dataclass(frozen=True)
class Metric:
    name: str
    reduce: str
    fmt: Callable[[float], str] = number
    label: str = ""                      # what it is, for tables and docs
    header: str = ""                     # short column header (summary table, progress, bench)
    weight: str | None = None            # WEIGHTED: the per-engine sample count it is a mean over
    over_run: Callable[[Sequence[Record], str], float] | None = None   # (records, name) -> value

    @property
    def short(self) -> str:
        """The header on one line."""
        return self.header.replace("\n", " ")

    @property
    def per_source(self) -> bool:
        """A family of keys, one per proposal source (``.../{source}``)."""
        return self.name.endswith("/" + SOURCE)

    @property
    def family(self) -> bool:
        """A family of keys, one per proposal source or reward part."""
        return SOURCE in self.name or PART in self.name

    def for_source(self, source: str) -> tuple[str, str]:
        """(record key, label) of a per-source family's member."""
        return self.name.replace(SOURCE, source), self.label.replace(SOURCE, source)


def _pooled(num: str, den: str, complement: bool = False):
    def over_run(records: Sequence[Record], _name: str) -> float:
        x = pooled_ratio(records, num, den)
        return 1.0 - x if complement else x
    return over_run


def _weighted_by(weight: str):
    return lambda records, name: weighted_mean_of(records, name, weight)


def _utilization(records: Sequence[Record], _name: str) -> float:
    return bubble_utilization(records)


# In record order: the aggregation writes each reduction's metrics in the order declared here.
_METRICS = [
    Metric("rollout/engines", DERIVED, count, "rollout engines that reported"),
    # --- sums
    Metric("rollout/decode_steps", SUM, count, "decode steps (engine forward passes per request)",
           "decode\nsteps", over_run=total_of),
    Metric("rollout/decode_steps_plain", SUM, count, "decode steps without drafts"),
    Metric("rollout/tokens", SUM, count, "response tokens"),
    Metric("bubble/idle_s", SUM, seconds, "idle engine-seconds at the barrier"),
    Metric("bubble/drafting_s", SUM, seconds, "engine-seconds drafting in the bubble"),
    Metric("bubble/overshoot_s", SUM, seconds, "drafting engine-seconds past the barrier"),
    Metric("bubble/draftable_s", SUM, seconds, "idle engine-seconds with a next step to draft"),
    Metric("bubble/engine_steps", SUM, count, "engine steps run in the bubble"),
    Metric("bubble/new_tokens", SUM, count, "new draft tokens"),
    Metric("bubble/refreshed_drafts", SUM, count, "complete drafts drafted again by newer weights"),
    Metric("bubble/prefill_tokens", SUM, count, "tokens prefilled for drafting"),
    Metric("spec/drafted_samples", SUM, count, "samples with a draft"),
    Metric("spec/drafted_tokens", SUM, count, "drafted tokens", "drafts\ntok",
           over_run=total_of),
    Metric("spec/drafted_tokens_in_response", SUM, count,
           "drafted tokens within their responses' lengths"),
    Metric("spec/accepted_tokens", SUM, count, "accepted draft tokens", "accept\ntok",
           over_run=total_of),
    Metric("spec/continuation_proposed_tokens", SUM, count, "continuation proposed tokens"),
    Metric("spec/continuation_accepted_tokens", SUM, count, "continuation accepted tokens"),
    Metric("sync/reshard_bytes", SUM, count, "bytes resharded to the engines"),
    Metric("train/reward_timeouts", SUM, count,
           "responses whose reward ran out of time (scored 0)"),
    Metric("spec/continuation_proposed_tokens/{source}", SUM, count,
           "continuation proposed tokens from {source}"),
    Metric("spec/continuation_accepted_tokens/{source}", SUM, count,
           "continuation accepted tokens from {source}"),
    # --- maxima
    Metric("rollout/time_s", MAX, seconds, "rollout wall time (the slowest engine's)", "rollout",
           over_run=total_of),
    Metric("rollout/max_response_len", MAX, count, "longest response"),
    Metric("rollout/engine_steps", MAX, count, "engine steps of the slowest engine",
           "engine\nsteps"),
    Metric("spec/verify_s", MAX, seconds, "verify wall time", "verify"),
    Metric("train/reward_s", MAX, seconds, "reward stage wall time"),
    Metric("sync/reshard_s", MAX, seconds, "reshard wall time"),
    Metric("sync/logprob_abs_diff", MAX, scientific, "max |engine - Megatron| logprob"),
    Metric("memory/rss_peak_gb", MAX, number, "peak resident memory of a rank so far (GB)"),
    # --- means
    Metric("train/loss", MEAN, number, "GRPO loss", "loss", over_run=mean_of),
    Metric("train/reward_mean", MEAN, number, "mean reward", "reward", over_run=mean_of),
    Metric("train/accuracy", MEAN, percent, "share of correct responses"),
    Metric("train/reward/{part}", MEAN, number, "mean reward part {part}"),
    Metric("train/kl", MEAN, scientific, "KL to the reference policy"),
    Metric("train/grad_norm", MEAN, number, "gradient norm"),
    Metric("train/lr", MEAN, scientific, "learning rate"),
    Metric("policy/drift_kl", MEAN, scientific, "KL between the policies of steps t-1 and t",
           "drift\nKL", over_run=mean_of),
    Metric("policy/draft_kl_half_step", MEAN, scientific,
           "k3 of the step's policy against W_t + (W_t - W_t-1) / 2", over_run=mean_of),
    Metric("policy/draft_kl_full_step", MEAN, scientific,
           "k3 of the step's policy against W_t + (W_t - W_t-1)", over_run=mean_of),
    Metric("spec/proposal_token_cost", MEAN, number, "cost of a proposal token"),
    # --- per-sample means, and the same on every engine
    Metric("spec/accepted_prefix_mean", WEIGHTED, number, "accepted prefix per drafted sample",
           "prefix", weight="spec/drafted_samples"),
    Metric("exact/weight_version", SAME, count, "policy weight version of the rollout"),
    # --- derived, in the order the aggregation computes them
    Metric("rollout/tokens_per_s", DERIVED, number, "response tokens per rollout second"),
    Metric("bubble/ratio", DERIVED, percent, "idle share of engine rollout time", "bubble",
           over_run=_weighted_by("rollout/time_s")),
    Metric("bubble/utilization", DERIVED, percent, "drafting share of the bubble", "util",
           over_run=_utilization),
    Metric("rollout/engine_steps_sum", DERIVED, count, "engine steps summed over engines"),
    Metric("bubble/overshoot_wall_s", DERIVED, seconds, "largest overshoot of an engine"),
    Metric("spec/continuation_accept_rate", DERIVED, percent,
           "continuation accepted / proposed tokens"),
    Metric("spec/accept_rate", DERIVED, percent, "accepted / drafted tokens", "accept\nrate",
           over_run=_pooled("spec/accepted_tokens", "spec/drafted_tokens")),
    Metric("spec/decode_steps_saved_frac", DERIVED, percent, "1 - decode steps / plain",
           "steps\nsaved",
           over_run=_pooled("rollout/decode_steps", "rollout/decode_steps_plain", True)),
    # --- the trainer's, already global
    Metric("train/pg_loss", TRAINER, number, "policy-gradient loss"),
    Metric("train/clip_frac", TRAINER, percent, "share of clipped tokens"),
    Metric("train/ratio_mean", TRAINER, number, "mean policy ratio"),
    Metric("train/entropy", TRAINER, number, "token entropy"),
    Metric("train/num_tokens", TRAINER, count, "response tokens trained on"),
    Metric("train/tis_weight_mean", TRAINER, number,
           "mean truncated importance weight, Megatron over engine (train.tis_cap)"),
    Metric("exact/batch_hash", TRAINER, count, "fingerprint of what the learner read"),
    Metric("exact/state_hash", TRAINER, count,
           "fingerprint of the weights and optimizer state after the step"),
    Metric("exact/engine_logprobs_hash", TRAINER, count,
           "fingerprint of the engine's logprobs (read by the learner only with train.tis_cap)"),
    Metric("train/update_skipped", TRAINER, count, "1 when the optimizer skipped the step"),
    Metric("train/step_s", TRAINER, seconds, "train step wall time"),
]
# Kept per engine as ``rank{r}/<name>``, in this order (ratios recomputed per engine).
_PER_ENGINE = ("bubble/idle_s", "bubble/drafting_s", "bubble/overshoot_s", "bubble/draftable_s",
               "bubble/engine_steps", "bubble/new_tokens", "bubble/refreshed_drafts",
               "bubble/prefill_tokens",
               "bubble/ratio", "bubble/utilization", "rollout/engine_steps", "rollout/time_s",
               "spec/drafted_tokens", "memory/rss_peak_gb")

METRICS: dict[str, Metric] = {m.name: m for m in _METRICS}
assert len(METRICS) == len(_METRICS), "a metric is declared twice"
PER_ENGINE_METRICS = tuple(METRICS[name] for name in _PER_ENGINE)

# Views: which metrics each display shows, in its order.
SUMMARY_COLUMNS = tuple(METRICS[name] for name in (
    "train/reward_mean", "train/loss", "rollout/time_s", "rollout/decode_steps",
    "spec/drafted_tokens", "spec/accepted_tokens", "spec/accept_rate",
    "spec/decode_steps_saved_frac", "bubble/ratio", "bubble/utilization", "policy/drift_kl"))
PROGRESS = tuple(METRICS[name] for name in (
    "train/reward_mean", "bubble/ratio", "spec/drafted_tokens", "spec/accepted_tokens"))
BENCH_STEP_COLUMNS = tuple(METRICS[name] for name in (     # on and off side by side
    "rollout/decode_steps", "rollout/engine_steps", "rollout/time_s", "spec/verify_s",
    "bubble/ratio"))
BENCH_STEP_COLUMNS_ON = tuple(METRICS[name] for name in (  # the on run only
    "bubble/utilization", "spec/accept_rate", "spec/accepted_prefix_mean", "policy/drift_kl"))
PER_SOURCE = tuple(m for m in _METRICS if m.per_source)


def metrics_reduced_by(reduce: str) -> tuple[Metric, ...]:
    """The metrics of one reduction, in declaration order."""
    return tuple(m for m in _METRICS if m.reduce == reduce)


def engine_key(engine: int, name: str) -> str:
    """The record key of engine ``engine``'s own value of ``name``."""
    return f"rank{engine}/{name}"


def family_of(key: str) -> Metric | None:
    """The family ``key`` belongs to (``spec/continuation_proposed_tokens/bubble`` ->
    ``.../{source}``, ``train/reward/format`` -> ``train/reward/{part}``), None for any other
    key."""
    family, _, member = key.rpartition("/")
    metric = METRICS.get(f"{family}/{SOURCE}") or METRICS.get(f"{family}/{PART}")
    return metric if metric is not None and member else None


def lookup(key: str) -> Metric | None:
    """The declaration of a record key: a metric, a per-source family's member, or an engine's
    own value (``rank{r}/<name>``); None when ``key`` is not declared."""
    head, _, rest = key.partition("/")
    if head.startswith("rank") and head[4:].isdigit():
        return METRICS[rest] if rest in _PER_ENGINE else None
    return METRICS.get(key) or family_of(key)


def run_totals(records: Sequence[Record]) -> dict[str, float]:
    """Whole-run values of the summary's metrics: sums of counts and times, ratios pooled over
    steps, means of the rest (each metric's ``over_run``)."""
    return {m.name: m.over_run(records, m.name) for m in SUMMARY_COLUMNS}
