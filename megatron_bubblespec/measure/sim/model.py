"""Setting + costs + lengths + acceptance -> paired on/off synchronous steps -> bench-style ratios.

The model of one synchronous step over ``R`` data-parallel ranks (model replicas), each owning
``B`` samples, run twice on the same response lengths (BubbleSpec off and on, as ``bubblespec
bench`` does):

* lengths: every sample's response length ``n`` (tokens, EOS included) is drawn from a
  ``LengthModel``, capped at the response budget; the on and off runs see the same lengths, since
  BubbleSpec is exact (same tokens);
* engines: each replica hosts ``E`` = ``Setting.engines_per_replica`` rollout engines of
  ``Setting.engine_tp`` GPUs each (``sim.layout``); engine ``e`` of a replica rolls out its samples
  ``e, e + E, ...`` (round-robin, as ``loop.layout`` splits them); the ``R x E`` engines are the
  ranks of everything below (arrival, bubble, drafting);
* engine speed with its TP: an engine of ``r`` GPUs runs every step, prefill and decode, in the
  measured engine's time (rollout TP ``r0`` = ``StepCosts.engine_tp``) x ``(r0 / r) ^ alpha``,
  ``alpha`` = ``Setting.tp_alpha`` (1: weights and KV heads split ``r`` ways and nothing lost to
  the all-reduces; an assumption, no TP > 1 engine has been measured);
* rollout of an engine = continuous batching: sample ``i`` needs ``m_i`` decode steps, the decode
  step ``j`` costs ``t(live_j, kv_j)`` with ``live_j`` the sequences decoding and ``kv_j`` their
  summed KV length (see ``EngineCosts``); with ``Setting.kv_slots`` = C (the sequences of
  ``max_model_len`` its KV cache holds, ``sim.memory``) at most C run at once, in submission order,
  the next one starting in the engine step where one finishes (``makespan_steps``): an engine
  with S > C sequences runs in waves; the engine is done when its last sample is;
* timing noise: with ``Setting.jitter`` = s > 0 every engine's rollout time in every step (and
  run) is multiplied by ``exp(s * Z - s^2 / 2)``, ``Z`` standard normal: the timing noise that is
  not explained by lengths (shared machines, thermal limits, slow nodes);
* barrier: the step waits for the slowest engine; an engine's bubble is its idle time there (from
  its arrival until it sees the barrier close, so a drafting engine's overshoot counts) and the
  step's bubble ratio is ``sum idle / (R x E x slowest rollout time)`` (the bench's
  ``bubble/ratio``);
* BubbleSpec on: idle engines draft the next step's samples (``sim.drafting``, at most
  ``min(spec.draft_in_flight, C)`` drafts in flight), with
  ``draft_horizon`` H > 1 those of the H - 1 steps after it too, continuing the drafts an earlier
  bubble left short (``sim.drafting.draft_ahead``); at the step a
  sample with a draft of ``d`` tokens keeps an accepted prefix ``a = min(G, d)`` with ``G``
  geometric (every draft token is accepted with probability ``accept_prob``, independently), plus
  the verifier's correction (or bonus) token, so its rollout starts from ``min(a + 1, n)`` known
  tokens and needs ``max(n - a - 2, 0)`` decode steps instead of ``n - 1``; a rank with drafts first
  pays a verify forward (``StepCosts.verify``) in the training layout, before its engines start;
* speculative continuation (``continuation_k`` > 0): a sample with a draft gets proposals from
  its prompt's drafts; a decode step yields ``1 + g`` tokens on average, with ``g`` the accepted
  proposal tokens per decode step measured by the bench: ``continuation_gain_past`` on the
  positions past the draft's end, ``continuation_gain_diverged`` on the positions the draft still
  covers after a divergence (unset: every proposal re-aligned with the draft, ``k`` at a time, each
  agreeing with probability ``accept_prob``, so ``g + 1 = (1 - p^(k+1)) / (1 - p)``); expected
  decode steps, not rounded;
* after the barrier: the drafting ranks finish their engine step in flight (overshoot), then train
  (cost per token of the rank with the most tokens) and reshard (a constant).

Not modelled: the prefill of a partial draft's earlier tokens when a later bubble extends it (the
claimed requests prefill their prompts only; ``ablation.reuse_draft_kv`` makes that nearly true on the
engine that drafted them, not on another), continuation on samples without a draft of their own
but with drafted siblings, proposals' dependence on what the drafts contain (one measured gain per
decode step), the higher cost of a k-token verify step over a plain decode step (a CPU cost), chunked prefill, prefill cost
growing with the square of the prompt, vLLM admitting more than C sequences while they are short
and preempting (recomputing) some when the cache fills (the slots reserve full length), the cost
of verification and training on a replica of several GPUs (both as calibrated), the all-gather of
drafts, and any dependence of acceptance on policy drift beyond one per-token probability. Timing
noise is one lognormal factor per engine and step, independent of the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from scipy.stats import norm

from megatron_bubblespec.config.schema import DRAFT_ORDERS
from megatron_bubblespec.measure.sim.drafting import draft_ahead


@dataclass(frozen=True)
class EngineCosts:
    """One rollout engine, in seconds.

    decode step with ``live`` sequences holding ``kv`` KV entries in all:
    ``step_s + seq_s * live + kv_token_s * kv``; prefill of ``tokens`` prompt tokens:
    ``prefill_s + prefill_token_s * tokens`` (0 for no tokens).
    """

    step_s: float
    seq_s: float
    kv_token_s: float
    prefill_s: float
    prefill_token_s: float

    def decode_step(self, live: float, kv: float) -> float:
        return self.step_s + self.seq_s * live + self.kv_token_s * kv

    def prefill(self, tokens):
        tokens = np.asarray(tokens, dtype=float)
        return np.where(tokens > 0, self.prefill_s + self.prefill_token_s * tokens, 0.0)

    def scaled(self, factor: float) -> EngineCosts:
        return EngineCosts(*(factor * x for x in (self.step_s, self.seq_s, self.kv_token_s,
                                                  self.prefill_s, self.prefill_token_s)))

    def rollout(self, decode_steps: np.ndarray, known: np.ndarray, prompt_len: int,
                slots: int | None = None) -> np.ndarray:
        """Rollout time per engine from per-sample decode steps and known response prefixes.

        ``decode_steps`` and ``known`` are (engines, samples); a sample with ``known`` tokens (its
        accepted prefix) and ``m`` decode steps left is prefilled with ``prompt_len + known``
        tokens unless it is already complete (``m == 0`` and ``known > 0``). The decode-step sum is
        exact for the linear step cost: ``sum_j step_s = step_s * makespan_steps(m, slots)`` (the
        engine steps, ``max m`` when every sample fits at once), ``sum_j seq_s * live_j = seq_s *
        sum m``, and sample ``i`` holds ``prompt_len + known_i + j`` KV entries at its ``j``-th
        decode step whenever it runs. So waves cost only the per-step term.
        """
        m = decode_steps.astype(float)
        k = known.astype(float)
        pending = (m > 0) | (k == 0)
        prefill = self.prefill(np.where(pending, prompt_len + k, 0.0).sum(axis=-1))
        kv = (m * (prompt_len + k) + m * (m + 1) / 2).sum(axis=-1)
        return (prefill + self.step_s * makespan_steps(m, slots)
                + self.seq_s * m.sum(axis=-1) + self.kv_token_s * kv)


def makespan_steps(decode_steps: np.ndarray, slots: int | None = None) -> np.ndarray:
    """Engine steps per engine to decode (engines, samples) ``decode_steps`` with at most ``slots``
    sequences at once (None: no limit): samples start in order, each in the first slot to free
    up (list scheduling), so with ``S`` equal samples of ``m`` steps it is ``ceil(S / slots) x
    m``."""
    m = np.asarray(decode_steps, dtype=float)
    if m.shape[-1] == 0:
        return np.zeros(m.shape[:-1])
    if slots is None or slots >= m.shape[-1]:
        return m.max(axis=-1)
    free = np.zeros(m.shape[:-1] + (slots,))
    rows = np.arange(len(free))
    for i in range(m.shape[-1]):
        first = free.argmin(axis=-1)
        free[rows, first] += m[:, i]
    return free.max(axis=-1)


@dataclass(frozen=True)
class StepCosts:
    """Everything a step costs besides the rollout engine, in seconds.

    verify on a replica with drafts: ``verify_s + verify_token_s * (prompt + draft tokens)`` of its
    drafted samples; train: ``train_token_s`` per token (prompt + response) of the replica with
    the most tokens; reshard: ``reshard_s`` per step. ``engine`` is an engine of ``engine_tp``
    GPUs (the measured one's rollout TP).
    """

    engine: EngineCosts
    verify_s: float = 0.0
    verify_token_s: float = 0.0
    train_token_s: float = 0.0
    reshard_s: float = 0.0
    engine_tp: int = 1


@dataclass(frozen=True)
class LengthModel:
    """Response lengths as a fraction ``x`` of the response budget ``cap``: ``n = ceil(x * cap)``
    clipped to ``1..cap``.

    ``lognormal``: ``log x ~ Normal(mu, sigma)`` (``sigma = 0``: every response has the same
    length, the no-variance case); with ``cap_share`` > 0 a mixture: a response runs to the cap
    with probability ``cap_share`` (a model that loops until the budget), else ``log x`` is that
    normal truncated to ``x < 1``; ``empirical``: ``x`` resampled from ``fractions`` (measured
    lengths over their budget).
    """

    kind: str = "lognormal"
    mu: float = 0.0
    sigma: float = 0.0
    fractions: tuple[float, ...] = ()
    cap_share: float = 0.0

    def __post_init__(self):
        if self.kind not in ("lognormal", "empirical"):
            raise ValueError(f"length model kind {self.kind!r}: use 'lognormal' or 'empirical'")
        if self.kind == "empirical" and not self.fractions:
            raise ValueError("an empirical length model needs measured fractions")
        if self.sigma < 0:
            raise ValueError(f"length model sigma must be >= 0, got {self.sigma}")
        if not 0.0 <= self.cap_share <= 1.0:
            raise ValueError(f"length model cap_share must be in [0, 1], got {self.cap_share}")

    def sample(self, rng: np.random.Generator, shape, cap: int) -> np.ndarray:
        if self.kind == "empirical":
            x = rng.choice(np.asarray(self.fractions, dtype=float), size=shape)
        elif self.cap_share > 0:
            # inverse CDF of the normal truncated to log x < 0, then the point mass at the cap
            top = norm.cdf(-self.mu / self.sigma) if self.sigma > 0 else float(self.mu < 0)
            u = np.clip(rng.random(shape) * top, 1e-300, None)
            x = (np.exp(self.mu + self.sigma * norm.ppf(u)) if self.sigma > 0
                 else np.full(shape, math.exp(min(self.mu, 0.0))))
            x = np.where(rng.random(shape) < self.cap_share, 1.0, x)
        else:
            x = np.exp(self.mu + self.sigma * rng.standard_normal(shape))
        return np.clip(np.ceil(x * cap - 1e-9), 1, cap).astype(np.int64)

    def describe(self) -> str:
        if self.kind == "empirical":
            return f"empirical ({len(self.fractions)} measured fractions of the budget)"
        if self.cap_share > 0:
            below = (math.exp(self.mu + self.sigma * norm.ppf(norm.cdf(-self.mu / self.sigma) / 2))
                     if self.sigma > 0 else math.exp(min(self.mu, 0.0)))
            return (f"{self.cap_share:.1%} run to the budget; the rest a lognormal fraction of "
                    f"the budget (mu {self.mu:.3g}, sigma {self.sigma:.3g}) truncated below it, "
                    f"median {below:.3g}")
        return (f"lognormal fraction of the budget: median {math.exp(self.mu):.3g}, "
                f"sigma {self.sigma:.3g}")


@dataclass(frozen=True)
class Setting:
    """The shape of the simulated job: ``ranks`` DP ranks (model replicas) of ``samples_per_rank``
    samples, each replica hosting ``engines_per_replica`` engines of ``engine_tp`` GPUs."""

    ranks: int
    samples_per_rank: int
    prompt_len: int
    max_new_tokens: int
    max_draft_tokens: int
    accept_prob: float = 1.0
    draft_concurrency: int = 32       # BubbleDrafter's in_flight (spec.draft_in_flight)
    draft_chunk: int = 2              # spec.draft_chunk
    draft_prefill_tokens: int = 0     # spec.draft_prefill_tokens: prompts claimed per engine step
    draft_horizon: int = 1            # spec.draft_horizon: steps a bubble drafts ahead
    draft_order: str = "engines"      # ablation.draft_order: which samples a bubble drafts first
    jitter: float = 0.0               # log-sd of a rank's rollout speed, drawn per rank and step
    spec: bool = True
    continuation_k: int = 0           # spec.spec_k with ablation.speculative_continuation, else 0
    # continuation's accepted tokens per decode step (0 = none), on positions past a draft's end
    # and on the positions a draft still covers after a divergence (None there: every proposal
    # re-aligned with the draft and agreeing with probability accept_prob, the optimistic case)
    continuation_gain_past: float = 0.0
    continuation_gain_diverged: float | None = None
    engines_per_replica: int = 1
    engine_tp: int = 1                # GPUs per engine (rollout.tensor_parallel)
    tp_alpha: float = 1.0             # engine time ~ engine_tp ^ -alpha (see the module docstring)
    kv_slots: int | None = None       # full-length sequences an engine's KV cache holds (None: any)

    def __post_init__(self):
        for name in ("ranks", "samples_per_rank", "max_new_tokens", "draft_concurrency",
                     "draft_chunk", "draft_horizon", "engines_per_replica", "engine_tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"setting {name} must be >= 1, got {getattr(self, name)}")
        if self.samples_per_rank % self.engines_per_replica:
            raise ValueError(f"{self.samples_per_rank} samples per replica do not split evenly "
                             f"over {self.engines_per_replica} engines")
        if self.draft_prefill_tokens < 0:
            raise ValueError(f"draft_prefill_tokens must be >= 0 (0: no bound), got "
                             f"{self.draft_prefill_tokens}")
        if self.kv_slots is not None and self.kv_slots < 1:
            raise ValueError(f"kv_slots must be >= 1 or None, got {self.kv_slots}")
        if self.draft_order not in DRAFT_ORDERS:
            raise ValueError(f"draft_order {self.draft_order!r}: expected one of {DRAFT_ORDERS}")
        if self.tp_alpha < 0:
            raise ValueError(f"tp_alpha must be >= 0, got {self.tp_alpha}")
        if self.continuation_k < 0:
            raise ValueError(f"continuation_k must be >= 0, got {self.continuation_k}")
        for name in ("continuation_gain_past", "continuation_gain_diverged"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.jitter < 0:
            raise ValueError(f"jitter must be >= 0, got {self.jitter}")
        if not 0.0 <= self.accept_prob <= 1.0:
            raise ValueError(f"accept_prob must be in [0, 1], got {self.accept_prob}")


@dataclass
class StepTrace:
    """Per-step sums of both runs (arrays over steps)."""

    rollout_off: list = field(default_factory=list)      # slowest engine's rollout time
    rollout_on: list = field(default_factory=list)
    engine_tokens: list = field(default_factory=list)    # most KV tokens an engine's samples end at
    idle_off: list = field(default_factory=list)         # engine-seconds
    idle_on: list = field(default_factory=list)
    verify_on: list = field(default_factory=list)        # slowest replica's verify time
    overshoot_on: list = field(default_factory=list)     # longest drafting step past the barrier
    drafting_on: list = field(default_factory=list)      # engine-seconds
    step_off: list = field(default_factory=list)         # barrier + overshoot + train + reshard
    step_on: list = field(default_factory=list)
    decode_off: list = field(default_factory=list)       # per-sample decode steps, summed
    decode_on: list = field(default_factory=list)
    engine_off: list = field(default_factory=list)       # slowest engine's engine steps
    engine_on: list = field(default_factory=list)
    response_tokens: list = field(default_factory=list)
    drafted_samples: list = field(default_factory=list)
    drafted_tokens: list = field(default_factory=list)
    accepted_tokens: list = field(default_factory=list)
    continuation_tokens: list = field(default_factory=list)  # decode steps continuation saved


def _ratio(num: float, den: float) -> float:
    return num / den if den else math.nan


def summarize(trace: StepTrace, engines: int) -> dict:
    """The bench's numbers (``measure.bench.compare``) from a trace of ``engines`` engines: cost
    ratios over steps >= 1, bubble and draft numbers over all steps."""
    t = {k: np.asarray(v, dtype=float) for k, v in vars(trace).items()}
    s1 = slice(1, None)
    roll_on, roll_off = t["rollout_on"][s1].sum(), t["rollout_off"][s1].sum()
    paid = t["verify_on"][s1].sum() + t["overshoot_on"][s1].sum()   # as the bench charges them
    drafted = t["drafted_samples"].sum()
    return {
        "steps": len(trace.rollout_off),
        "engines": engines,
        "bubble_ratio_off": _ratio(t["idle_off"].sum(), engines * t["rollout_off"].sum()),
        "bubble_ratio_on": _ratio(t["idle_on"].sum(), engines * t["rollout_on"].sum()),
        "bubble_utilization": _ratio(t["drafting_on"].sum(), t["idle_on"].sum()),
        "decode_steps_ratio": _ratio(t["decode_on"][s1].sum(), t["decode_off"][s1].sum()),
        "engine_steps_ratio": _ratio(t["engine_on"][s1].sum(), t["engine_off"][s1].sum()),
        "draft_coverage": _ratio(t["drafted_tokens"][s1].sum(), t["response_tokens"][s1].sum()),
        "continuation_accepted_tokens": float(t["continuation_tokens"].sum()),
        "throughput_ratio": _ratio(roll_off, roll_on),
        "throughput_ratio_with_verify": _ratio(roll_off, roll_on + paid),
        "step_speedup": _ratio(t["step_off"][s1].sum(), t["step_on"][s1].sum()),
        "accept_rate": _ratio(t["accepted_tokens"].sum(), t["drafted_tokens"].sum()),
        "accepted_prefix_mean": _ratio(t["accepted_tokens"].sum(), drafted),
        "drafted_tokens": float(t["drafted_tokens"].sum()),
        "accepted_tokens": float(t["accepted_tokens"].sum()),
        "rollout_time_off_s": float(t["rollout_off"].mean()),
        "rollout_time_on_s": float(t["rollout_on"].mean()),
        "engine_tokens_max": float(t["engine_tokens"].mean()),
        "step_time_off_s": float(t["step_off"].mean()),
    }


def accepted_prefix(rng: np.random.Generator, drafted: np.ndarray,
                    accept_prob: float) -> np.ndarray:
    """Accepted tokens of drafts of ``drafted`` tokens: the leading run of independent
    acceptances with probability ``accept_prob`` each, cut at the draft's end."""
    if accept_prob >= 1.0:
        return drafted.copy()
    if accept_prob <= 0.0:
        return np.zeros_like(drafted)
    run = np.floor(np.log(rng.random(drafted.shape)) / math.log(accept_prob))
    return np.minimum(run, drafted).astype(np.int64)


def tokens_per_continuation_step(accept_prob: float, k: int) -> float:
    """Mean tokens a decode step yields when it verifies ``k`` proposals that each agree with
    probability ``accept_prob``: the agreeing run before the first miss, plus one drawn token."""
    if accept_prob >= 1.0:
        return float(k + 1)
    return (1.0 - accept_prob ** (k + 1)) / (1.0 - accept_prob)


def continued_decode_steps(setting: Setting, decode_steps: np.ndarray, drafted: np.ndarray,
                           known: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Decode steps left to samples with a draft once speculative continuation proposes tokens:
    the positions the draft still covers past the verified prefix (after a divergence) and the
    positions past the draft's end, each a decode step that yields ``1 + gain`` tokens on
    average (``Setting.continuation_gain_*``). Samples without a draft have no pool."""
    covered = np.maximum(np.minimum(drafted, n) - known, 0)
    past = np.where(drafted > 0, np.maximum(decode_steps - covered, 0), 0)
    gain = setting.continuation_gain_diverged
    per_step = (tokens_per_continuation_step(setting.accept_prob, setting.continuation_k)
                if gain is None else 1.0 + gain)
    saved = covered - covered / per_step + past - past / (1.0 + setting.continuation_gain_past)
    return np.maximum(decode_steps - saved, 0.0)


def _speed(rng: np.random.Generator, ranks: int, jitter: float) -> np.ndarray:
    if jitter == 0:
        return np.ones(ranks)
    return np.exp(jitter * rng.standard_normal(ranks) - jitter ** 2 / 2)


def engine_costs(setting: Setting, costs: StepCosts) -> EngineCosts:
    """The measured engine's costs at the setting's rollout TP: x ``(r0 / r) ^ alpha``."""
    return costs.engine.scaled((costs.engine_tp / setting.engine_tp) ** setting.tp_alpha)


def per_engine(x: np.ndarray, engines: int) -> np.ndarray:
    """(replicas, samples) -> (replicas x engines, samples / engines): engine ``e`` of a replica
    takes its samples ``e, e + engines, ...``, engines in replica order."""
    replicas, samples = x.shape
    return x.reshape(replicas, samples // engines, engines).transpose(0, 2, 1).reshape(
        replicas * engines, samples // engines)


def simulate(setting: Setting, costs: StepCosts, lengths: LengthModel | None = None, *,
             steps: int = 20, seed: int = 0, measured_lengths: np.ndarray | None = None) -> dict:
    """Simulate ``steps`` paired steps; returns ``summarize``'s dict plus ``trace`` (per step).

    ``measured_lengths`` (steps, ranks, samples_per_rank) replays given response lengths instead
    of drawing them from ``lengths`` (then ``steps`` is its first dimension).
    """
    rng = np.random.default_rng(seed)
    R, B = setting.ranks, setting.samples_per_rank
    if measured_lengths is not None:
        all_lengths = np.asarray(measured_lengths, dtype=np.int64)
        if all_lengths.ndim != 3 or all_lengths.shape[1:] != (R, B):
            raise ValueError(f"measured lengths of shape {all_lengths.shape}: expected "
                             f"(steps, {R}, {B}) for {R} ranks of {B} samples")
    else:
        if lengths is None:
            raise ValueError("simulate needs a length model or measured lengths")
        all_lengths = lengths.sample(rng, (steps, R, B), setting.max_new_tokens)
    trace = StepTrace()
    pending: dict[int, np.ndarray] = {}     # step -> (R, B) drafted tokens of its samples so far
    for step in range(len(all_lengths)):
        _simulate_step(setting, costs, rng, all_lengths, step, pending, trace)
    return {**summarize(trace, R * setting.engines_per_replica),
            "trace": {k: [float(x) for x in v] for k, v in vars(trace).items()}}


def _simulate_step(setting: Setting, costs: StepCosts, rng: np.random.Generator,
                   all_lengths: np.ndarray, step: int, pending: dict[int, np.ndarray],
                   trace: StepTrace) -> None:
    """One paired step (off, then on) of response lengths ``all_lengths[step]`` -> ``trace``;
    the on run verifies ``pending``'s drafts of the step and drafts the coming steps'."""
    R, B, P = setting.ranks, setting.samples_per_rank, setting.prompt_len
    E, C = setting.engines_per_replica, setting.kv_slots
    engine = engine_costs(setting, costs)
    budget = min(setting.max_draft_tokens, setting.max_new_tokens)
    n = all_lengths[step]
    # BubbleSpec off: every token decoded
    n_e = per_engine(n, E)
    roll_off = engine.rollout(n_e - 1, np.zeros_like(n_e), P, C) * _speed(rng, R * E,
                                                                       setting.jitter)
    t_off = roll_off.max()
    train = costs.train_token_s * (n + P).sum(axis=-1).max()
    # BubbleSpec on: verify the drafts made in earlier bubbles, then roll out
    verified = pending.pop(step, np.zeros((R, B), dtype=np.int64))
    accepted = accepted_prefix(rng, verified, setting.accept_prob)
    known = np.where(verified > 0, np.minimum(accepted + 1, n), 0)
    plain_on = np.maximum(n - known - 1, 0)
    decode_on = (continued_decode_steps(setting, plain_on, verified, known, n)
                 if setting.continuation_k else plain_on)
    verify = np.where((verified > 0).any(axis=-1), costs.verify_s + costs.verify_token_s
                      * np.where(verified > 0, P + verified, 0).sum(axis=-1), 0.0)
    decode_e = per_engine(decode_on, E)
    roll_on = (engine.rollout(decode_e, per_engine(known, E), P, C)
               * _speed(rng, R * E, setting.jitter))
    arrive = np.repeat(verify, E) + roll_on
    close = arrive.max()
    drafting_s = overshoot = np.zeros(R * E)
    if setting.spec and budget > 0:
        drafting_s, overshoot = draft_ahead(setting, engine, pending, all_lengths, step,
                                            arrive, budget)
    trace.rollout_off.append(t_off)
    trace.rollout_on.append(roll_on.max())
    trace.engine_tokens.append((n_e + P).sum(axis=-1).max())
    trace.idle_off.append((t_off - roll_off).sum())
    trace.idle_on.append((close - arrive + overshoot).sum())   # idle as an engine sees it
    trace.verify_on.append(verify.max())
    trace.overshoot_on.append(overshoot.max())
    trace.drafting_on.append(drafting_s.sum())
    trace.step_off.append(t_off + train + costs.reshard_s)
    trace.step_on.append(close + overshoot.max() + train + costs.reshard_s)
    trace.decode_off.append((n - 1).sum())
    trace.decode_on.append(decode_on.sum())
    trace.engine_off.append(makespan_steps(n_e - 1, C).max() + 1)
    trace.engine_on.append(makespan_steps(decode_e, C).max() + 1)
    trace.response_tokens.append(n.sum())
    trace.continuation_tokens.append((plain_on - decode_on).sum())
    trace.drafted_samples.append((verified > 0).sum())
    trace.drafted_tokens.append(verified.sum())
    trace.accepted_tokens.append(accepted.sum())
