"""Bench-engine rows + bench step records -> fits -> engine/verify costs, lengths, acceptance.

The fits ``sim.calibrate`` combines into a ``Calibration`` (also rank timing noise and
continuation gains); its module docstring says what each is fitted from.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np
from scipy.optimize import brentq, least_squares, minimize, nnls
from scipy.stats import norm

from megatron_bubblespec.measure.sim.model import EngineCosts, LengthModel

ATTENTION_EQUAL_CTX = 8192  # KV length at which a sequence's attention costs its per-sequence share
DEFAULT_SIGMA = 1.0         # log-length spread when no per-sample lengths were kept
ENGINE_QUANTILE = 0.02
ROBUST_SCALE = 0.1          # relative residual beyond which a bench-engine row counts as an outlier


def _nnls(features: list[list[float]], targets: list[float]) -> np.ndarray:
    a, b = np.asarray(features, dtype=float), np.asarray(targets, dtype=float)
    scale = np.where(a.max(axis=0) > 0, a.max(axis=0), 1.0)
    return nnls(a / scale, b)[0] / scale


def _robust_fit(features: list[list[float]], targets: list[float]) -> np.ndarray:
    """Non-negative coefficients of a linear model of positive times, robust to the outliers of a
    shared machine: least squares of relative residuals with a soft-L1 loss (residuals beyond
    ``ROBUST_SCALE`` count linearly, not squared), started from the plain non-negative fit."""
    a, b = np.asarray(features, dtype=float), np.asarray(targets, dtype=float)
    scale = np.where(a.max(axis=0) > 0, a.max(axis=0), 1.0)
    start = nnls(a / scale, b)[0]
    fit = least_squares(lambda c: (a / scale @ c - b) / b, start + 1e-12, bounds=(0.0, np.inf),
                        loss="soft_l1", f_scale=ROBUST_SCALE)
    return fit.x / scale


def fit_engine(rows: Sequence[Mapping]) -> tuple[EngineCosts, list[str]]:
    """Decode-step and prefill costs from bench-engine rows (see ``sim.calibrate``)."""
    decode_x, decode_y, kv_per_seq = [], [], []
    for row in rows:
        times = [t for run in row.get("runs", ()) for t in run["decode_step_s"]]
        y = float(np.quantile(times, ENGINE_QUANTILE)) if times else row["decode_step_min_s"]
        kv = row["prompt_len"] + row["new_tokens"] / 2
        decode_x.append([1.0, row["batch_size"], row["batch_size"] * kv])
        decode_y.append(y)
        kv_per_seq.append(kv)
    notes = []
    if max(kv_per_seq) >= 2 * min(kv_per_seq):
        step_s, seq_s, kv_s = _robust_fit(decode_x, decode_y)
        notes.append(f"decode step fitted on {len(rows)} bench-engine rows, prompt lengths "
                     f"{sorted({r['prompt_len'] for r in rows})}")
    else:
        step_s, seq_s = _robust_fit([[1.0, b + b_kv / ATTENTION_EQUAL_CTX]
                                     for _, b, b_kv in decode_x], decode_y)
        kv_s = seq_s / ATTENTION_EQUAL_CTX
        notes.append(f"decode step fitted on {len(rows)} bench-engine rows of one prompt length: "
                     f"attention cost per KV token set to seq_s / {ATTENTION_EQUAL_CTX}")
    prefill = _robust_fit([[1.0, r["prefill_tokens"]] for r in rows],
                          [min([run["prefill_s"] for run in r.get("runs", ())]
                               or [r["prefill_s"]]) for r in rows])
    return EngineCosts(step_s, seq_s, kv_s, *prefill), notes


def rank_rollout_times(records: Sequence[Mapping], ranks: int) -> np.ndarray:
    """(steps, ranks) measured rollout seconds: slowest rank's time minus each rank's idle."""
    out = []
    for r in records:
        wall = r["rollout/time_s"]
        out.append([wall - (r.get(f"rank{k}/bubble/idle_s") or 0.0) for k in range(ranks)])
    return np.asarray(out, dtype=float)


def fit_engine_from_bench(lengths: np.ndarray, measured: np.ndarray,
                          prompt_len: int) -> EngineCosts:
    """Decode-step cost from the bench's rank rollout times alone (in-sample, no prefill term).

    A rank's time is ``f_t * (step_s * max m + seq_s * (sum m + kv / ATTENTION_EQUAL_CTX))`` with
    ``f_t`` the machine's load in step ``t``, common to its ranks: with two or more ranks the ratio
    ``seq_s / step_s`` is fitted on the ranks' times relative to each other within each step
    (least squares of the log times less each step's mean), and ``step_s`` on the median load;
    with one rank, ``_robust_fit`` on the times themselves."""
    m = (lengths - 1).astype(float)
    kv = (m * prompt_len + m * (m + 1) / 2).sum(axis=-1)
    longest, per_seq = m.max(axis=-1), m.sum(axis=-1) + kv / ATTENTION_EQUAL_CTX
    measured = np.asarray(measured, dtype=float)
    if measured.ndim < 2 or measured.shape[1] < 2:
        x = np.stack([longest, per_seq], axis=-1).reshape(-1, 2)
        keep = measured.reshape(-1) > 0
        step_s, seq_s = _robust_fit(x[keep].tolist(), measured.reshape(-1)[keep].tolist())
        return EngineCosts(step_s, seq_s, seq_s / ATTENTION_EQUAL_CTX, 0.0, 0.0)

    def spread(log_rho: float) -> float:
        r = np.log(measured) - np.log(longest + math.exp(log_rho) * per_seq)
        return float(((r - r.mean(axis=1, keepdims=True)) ** 2).sum())

    grid = np.linspace(-12.0, 4.0, 161)
    start = grid[int(np.argmin([spread(u) for u in grid]))]
    best = minimize(lambda u: spread(float(u[0])), [start], method="Nelder-Mead")
    rho = math.exp(float(np.clip(best.x[0], -12.0, 4.0)))
    if rho <= math.exp(-12.0) * 1.0001:
        rho = 0.0
    step_s = float(np.median(measured / (longest + rho * per_seq)))
    return EngineCosts(step_s, rho * step_s, rho * step_s / ATTENTION_EQUAL_CTX, 0.0, 0.0)


def fit_jitter(measured: np.ndarray, modelled: np.ndarray) -> float:
    """Log-sd of measured / modelled rank rollout times (steps, ranks) less each step's mean over
    its ranks: the rank-to-rank timing noise the lengths do not explain (a slow step of the whole
    machine delays every rank alike and makes no bubble). Corrected for the ranks' mean taken out
    (``sqrt(R / (R - 1))``); 0 with one rank."""
    residual = np.log(np.asarray(measured, dtype=float) / np.asarray(modelled, dtype=float))
    residual = residual.reshape(len(residual), -1)
    ranks = residual.shape[1]
    if ranks < 2:
        return 0.0
    within = residual - residual.mean(axis=1, keepdims=True)
    return float(np.sqrt((within ** 2).sum() / (within.size - len(within))))


def fit_verify(records: Sequence[Mapping], ranks: int, prompt_len: int,
               floor_token_s: float) -> tuple[float, float]:
    """(verify_s, verify_token_s) from the on run's steps with drafts: ``spec/verify_s`` against
    the step's prompt + draft tokens per rank; the per-token cost is at least ``floor_token_s``."""
    steps = [(r["spec/verify_s"], (r["spec/drafted_tokens"] + r["spec/drafted_samples"]
                                   * prompt_len) / ranks)
             for r in records if (r.get("spec/drafted_samples") or 0) > 0
             and r.get("spec/verify_s") is not None]
    if not steps:
        return 0.0, floor_token_s
    token_s = floor_token_s
    if len(steps) > 1:
        token_s = max(float(_nnls([[1.0, x] for _, x in steps], [y for y, _ in steps])[1]),
                      floor_token_s)
    return max(_mean(y - token_s * x for y, x in steps), 0.0), token_s


def fit_lengths(lengths: np.ndarray, cap: int) -> LengthModel:
    """Censored lognormal of ``lengths / cap`` (responses at the cap are right-censored)."""
    x = np.asarray(lengths, dtype=float).reshape(-1) / cap
    capped = x >= 1.0
    logs = np.log(x[~capped])
    if capped.all() or len(logs) < 2 and not capped.any():
        return LengthModel("lognormal", mu=float(np.log(x.mean())), sigma=0.0)

    def nll(theta):
        mu, sigma = theta[0], math.exp(theta[1])
        ll = norm.logpdf(logs, mu, sigma).sum() + capped.sum() * norm.logsf(0.0, mu, sigma)
        return -ll

    start = [float(np.log(x).mean()), math.log(max(float(np.log(x).std()), 0.1))]
    best = minimize(nll, start, method="Nelder-Mead", options={"xatol": 1e-6, "fatol": 1e-9})
    mu, sigma = float(np.clip(best.x[0], -20, 20)), float(np.clip(math.exp(best.x[1]), 1e-3, 10))
    return LengthModel("lognormal", mu=mu, sigma=sigma)


def fit_capped_lengths(lengths: np.ndarray, cap: int) -> LengthModel:
    """The share of responses at the cap, and a lognormal of ``lengths / cap`` truncated below 1
    fitted by maximum likelihood to the others (a plain lognormal when none reached the cap)."""
    x = np.asarray(lengths, dtype=float).reshape(-1) / cap
    capped = x >= 1.0
    if not capped.any():
        return fit_lengths(lengths, cap)
    share = float(capped.mean())
    logs = np.log(x[~capped])
    if len(logs) < 2:
        mu = float(logs.mean()) if len(logs) else 0.0
        return LengthModel("lognormal", mu=mu, sigma=0.0, cap_share=share)

    def nll(theta):
        mu, sigma = theta[0], math.exp(theta[1])
        return -(norm.logpdf(logs, mu, sigma).sum() - len(logs) * norm.logcdf(0.0, mu, sigma))

    start = [float(logs.mean()), math.log(max(float(logs.std()), 0.1))]
    best = minimize(nll, start, method="Nelder-Mead", options={"xatol": 1e-6, "fatol": 1e-9})
    mu, sigma = float(np.clip(best.x[0], -20, 20)), float(np.clip(math.exp(best.x[1]), 1e-3, 10))
    return LengthModel("lognormal", mu=mu, sigma=sigma, cap_share=share)


def lengths_from_mean(mean_fraction: float, sigma: float = DEFAULT_SIGMA) -> LengthModel:
    """The lognormal with ``sigma`` whose budget-capped mean fraction is ``mean_fraction``."""
    def capped_mean(mu):
        # E[min(X, 1)] for log X ~ N(mu, sigma)
        tail = norm.sf(-mu / sigma)
        return math.exp(mu + sigma ** 2 / 2) * norm.cdf((-mu - sigma ** 2) / sigma) + tail

    target = float(np.clip(mean_fraction, 1e-6, 1 - 1e-6))
    return LengthModel("lognormal", mu=brentq(lambda mu: capped_mean(mu) - target, -30, 30),
                       sigma=sigma)


def expected_accepted(p: float, draft: float) -> float:
    """E[min(G, draft)] for P(G >= k) = p^k: the mean accepted prefix of a draft."""
    if p >= 1.0:
        return draft
    return p * (1 - p ** draft) / (1 - p)


def fit_accept_prob(records: Sequence[Mapping]) -> float | None:
    """The per-token acceptance probability that explains the on run's accepted tokens."""
    steps = [(r["spec/drafted_samples"], r["spec/drafted_tokens"], r["spec/accepted_tokens"])
             for r in records if (r.get("spec/drafted_samples") or 0) > 0]
    if not steps:
        return None
    accepted = sum(a for _, _, a in steps)
    if accepted >= sum(d for _, d, _ in steps):
        return 1.0
    if accepted <= 0:
        return 0.0

    def gap(p):
        return sum(s * expected_accepted(p, d / s) for s, d, _ in steps) - accepted
    return float(brentq(gap, 0.0, 1.0 - 1e-12))


def grid_accept_prob(records: Sequence[Mapping], fitted: float) -> float:
    """The per-token acceptance for predictions: ``fitted`` when some draft was cut by a miss,
    else the lower bound ``A / (A + N)`` of ``sim.ceiling`` (``A`` accepted tokens over ``N``
    drafted samples)."""
    from megatron_bubblespec.measure.sim.ceiling import accept_per_token_lower_bound

    if fitted < 1.0:
        return fitted
    accepted = sum(r.get("spec/accepted_tokens") or 0 for r in records)
    drafted = sum(r.get("spec/drafted_samples") or 0 for r in records)
    bound = accept_per_token_lower_bound(accepted, drafted)
    return bound if math.isfinite(bound) else fitted


def fit_continuation(records: Sequence[Mapping], samples: int) -> tuple[float, float | None]:
    """(gain past a draft's end, gain after a divergence or None): continuation-accepted tokens
    per decode step of the drafted samples (see ``sim.calibrate``)."""
    sums = {True: [0.0, 0.0], False: [0.0, 0.0]}    # clean step -> [accepted, decode steps]
    for r in records:
        drafted = r.get("spec/drafted_samples") or 0
        if drafted <= 0 or r.get("spec/continuation_accepted_tokens") is None:
            continue
        clean = (r.get("spec/accepted_tokens") or 0) >= (r.get("spec/drafted_tokens") or 0)
        sums[clean][0] += r["spec/continuation_accepted_tokens"]
        sums[clean][1] += r.get("rollout/decode_steps", 0) * min(drafted / samples, 1.0)
    past = sums[True][0] / sums[True][1] if sums[True][1] > 0 else None
    diverged = sums[False][0] / sums[False][1] if sums[False][1] > 0 else None
    if past is None:
        past = diverged if diverged is not None else 0.0
    return past, diverged


def _mean(values) -> float:
    values = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return sum(values) / len(values) if values else 0.0
