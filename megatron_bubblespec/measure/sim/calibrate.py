"""bench.json (+ its runs' rollouts and config) and bench-engine JSONs -> fitted costs, lengths,
acceptance -> ``Calibration``; the simulator replayed on the measured lengths -> errors vs bench.

What is fitted from what (every choice is recorded in ``Calibration.notes``):

* decode step ``step_s + seq_s * live + kv_token_s * kv`` and prefill ``prefill_s +
  prefill_token_s * tokens``: robust non-negative least squares (``_robust_fit``) over the
  bench-engine rows of the engine the bench ran (``rollout.engine``), on the 2 % quantile of each
  row's raw decode-step times and the fastest run's prefill (the machine is shared: those are the
  uncontended costs, the medians are not), with ``kv = batch * (prompt_len + new_tokens / 2)``.
  ``kv_token_s`` is fitted only when the rows' per-sequence KV lengths span at least a factor of 2
  (two ``--prompt-len`` runs); otherwise it is ``seq_s / ATTENTION_EQUAL_CTX``.
* one scale on those costs: the median over the off run's ranks and steps >= 1 of measured /
  modelled rollout time (the real loop's overheads and the machine's load at bench time); the
  log-sd of the remaining measured / modelled ratios, less each step's factor common to all ranks
  (the shared machine's load, not a rank-to-rank difference), is the rank timing noise
  ``Setting.jitter``. Without bench-engine JSONs the decode step is fitted on those rank times
  directly (``step_s``, ``seq_s``, no prefill term, ``kv_token_s`` tied to ``seq_s`` as above;
  ``seq_s / step_s`` from the ranks' times relative to each other within a step, so that the
  machine's load in a step cancels): an in-sample fit.
* a rank's measured rollout time: the step's ``rollout/time_s`` (the slowest rank) minus the
  rank's ``bubble/idle_s`` (off run: nothing else happens between the rollout and the barrier).
* verify: ``verify_token_s`` = the slope of a non-negative least-squares line of ``spec/verify_s``
  against prompt + draft tokens per rank (the step's tokens / ranks) over the on run's steps with
  drafts, but at least the engine's prefill cost per token (a forward over the same tokens);
  ``verify_s`` = the mean of the rest.
* train: ``train/step_s`` per token of the rank with the most tokens, over the off run; reshard:
  mean ``sync/reshard_s``.
* acceptance: the per-token probability ``p`` with ``sum_t S_t * E[min(G, d_t)] = sum_t A_t``
  over the on run's steps (``S_t`` drafted samples, ``d_t`` their mean draft length, ``A_t``
  accepted tokens, ``G`` geometric with ``P(G >= k) = p^k``); 1 when every drafted token was
  accepted. The check at the measured setting uses that fit; the predicted grid uses the same
  ``p`` when some draft was cut by a miss, else the lower bound ``A / (A + N)`` of
  ``sim.ceiling`` (no miss seen in ``A`` tokens does not make ``p = 1`` at 64k tokens).
* continuation: ``g`` = continuation-accepted tokens per decode step of the drafted samples
  (``spec/continuation_accepted_tokens`` over ``spec/drafted_samples / samples`` of the step's
  ``rollout/decode_steps``), over the on run's steps with drafts: steps where every drafted token
  was accepted give the gain past a draft's end, steps with a rejected token the gain after a
  divergence (taken as the past-the-end gain when no draft was rejected).
* engine TP: the fitted engine is one of the bench's rollout TP (``rollout.tensor_parallel``, 1
  without a config; ``StepCosts.engine_tp``); a bench whose replicas ran several engines each is
  refused (its rank times are per DP rank).
* lengths: the responses of the off run (``<out>/<name>-off/rollouts.jsonl``, in global sample
  order, so the ``B`` samples of rank ``r`` are ``r * B .. r * B + B - 1``) as fractions of the
  budget ``rollout.max_new_tokens``: the share that ran to the budget (``LengthModel.cap_share``)
  and a lognormal truncated below the budget fitted by maximum likelihood to the rest
  (``fit_capped_lengths``). Without rollouts: ``DEFAULT_SIGMA`` and the median that reproduces the
  series' mean response length.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from megatron_bubblespec.loop.run_dir import RunDir
from megatron_bubblespec.measure.sim.fits import (DEFAULT_SIGMA, _mean, fit_accept_prob,
                                                  fit_capped_lengths, fit_continuation, fit_engine,
                                                  fit_engine_from_bench, fit_jitter, fit_verify,
                                                  grid_accept_prob, lengths_from_mean,
                                                  rank_rollout_times)
from megatron_bubblespec.measure.sim.model import LengthModel, Setting, StepCosts, simulate

DEFAULT_ACCEPT_PROB = 0.9   # when the bench drafted nothing
DRAFT_CONCURRENCY = 32      # BubbleDrafter's in_flight when the config is unknown
CHECKED = ("bubble_ratio_off", "bubble_ratio_on", "decode_steps_ratio", "engine_steps_ratio",
           "draft_coverage", "throughput_ratio", "throughput_ratio_with_verify",
           "bubble_utilization", "accept_rate")
REPO_ROOT = Path(__file__).resolve().parents[2]


class CalibrationError(ValueError):
    """A measurement file that cannot calibrate the simulator (the message says which and why)."""


@dataclass
class Calibration:
    setting: Setting                     # the measured job (its ranks, samples, budget)
    costs: StepCosts
    lengths: LengthModel
    measured: dict                       # the bench's own ratios
    measured_lengths: np.ndarray | None  # (steps, ranks, samples_per_rank) of the off run
    source: dict                         # files and config the numbers came from
    notes: list[str] = field(default_factory=list)
    grid_accept_prob: float | None = None  # per-token acceptance for predictions (None: setting's)

    @property
    def draft_budget_frac(self) -> float:
        return self.setting.max_draft_tokens / self.setting.max_new_tokens


# ------------------------------------------------------------------------------------ reading

def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CalibrationError(f"{what} {path}: no such file") from None
    except json.JSONDecodeError as err:
        raise CalibrationError(f"{what} {path}: not JSON ({err})") from None


def load_bench(path: str | Path) -> dict:
    """A ``bubblespec bench`` result (``<out>/bench.json``), checked for what calibration needs."""
    bench = _read_json(Path(path), "bench file")
    series = bench.get("series")
    if not isinstance(series, Mapping) or not series.get("on") or not series.get("off"):
        raise CalibrationError(f"bench file {path}: no 'series' with 'on' and 'off' step records; "
                               "pass the bench.json written by `bubblespec bench --out DIR`")
    missing = [k for k in ("rollout/time_s", "rollout/tokens", "rollout/decode_steps")
               if k not in series["off"][0]]
    if missing:
        raise CalibrationError(f"bench file {path}: step records lack {missing}")
    return bench


def _run_dir(bench_path: Path, bench: dict, mode: str) -> Path | None:
    """The directory of the bench's on / off run: next to bench.json, else where it was written."""
    recorded = Path(bench.get("runs", {}).get(mode, f"{bench.get('name', '')}-{mode}"))
    for candidate in (bench_path.parent / recorded.name, recorded):
        if candidate.is_dir():
            return candidate
    return None


def _resolve(path: str) -> Path | None:
    for candidate in (Path(path), REPO_ROOT / path):
        if candidate.is_file():
            return candidate
    return None


def bench_config(bench_path: Path, bench: dict):
    """A run's resolved config (its run directory's config.yaml: the on run's first, whose spec
    keys are the ones that drafted, since ``bench --resume`` may pair it with an off run made
    under other spec settings; then the off run's), else the bench's config file with its
    overrides; None when none can be read."""
    from megatron_bubblespec.config import ConfigError, load_config

    tries = []
    for mode in ("on", "off"):
        run = _run_dir(bench_path, bench, mode)
        if run is not None and RunDir(run).has_config():
            tries.append(RunDir(run).read_config)
    if bench.get("config") and _resolve(bench["config"]) is not None:
        path, overrides = _resolve(bench["config"]), list(bench.get("overrides", []))
        tries.append(lambda: load_config(path, overrides))
    for read in tries:
        try:
            return read()
        except (ConfigError, OSError):
            continue
    return None


def prompt_length(cfg, prompts: int = 64) -> int | None:
    """Mean prompt tokens of the config's task over its first ``prompts`` prompts (None when the
    task cannot be built here)."""
    try:
        from megatron_bubblespec.data.registry import task_from_config

        task = task_from_config(cfg, cfg.model.tiny_vocab_size)
        count = min(prompts, getattr(task, "size", prompts) or prompts)
        return round(sum(len(task.prompt(i).token_ids) for i in range(count)) / count)
    except Exception:   # a task that needs files or a tokenizer that is not here
        return None


def read_lengths(run_dir: Path | None, ranks: int) -> np.ndarray | None:
    """Response lengths (steps, ranks, samples per rank) from a run's rollouts.jsonl."""
    if run_dir is None or not RunDir(run_dir).rollouts_file.is_file():
        return None
    steps = [[len(responses[g]) for g in sorted(responses)]
             for responses in RunDir(run_dir).read_rollouts()]
    if not steps or len({len(s) for s in steps}) != 1 or len(steps[0]) % ranks:
        return None
    return np.asarray(steps, dtype=np.int64).reshape(len(steps), ranks, -1)


def load_engine_rows(paths: Sequence[str | Path], engine: str | None) -> tuple[list[dict], str]:
    """The rows of ``bubblespec bench-engine`` JSONs for ``engine`` (else the first engine)."""
    rows = []
    for path in paths:
        report = _read_json(Path(path), "bench-engine file")
        if not report.get("rows"):
            raise CalibrationError(f"bench-engine file {path}: no 'rows'; pass the JSON written by "
                                   "`bubblespec bench-engine --out FILE`")
        rows += report["rows"]
    names = [r["engine"] for r in rows]
    chosen = engine if engine in names else names[0]
    return [r for r in rows if r["engine"] == chosen], chosen


# ------------------------------------------------------------------------------------ calibrate

def _job_shape(cfg, off: Sequence[Mapping], bench_path: Path) -> dict:
    """Ranks, samples per rank, budgets, chunk, rollout TP and engine of the measured job (config
    first)."""
    if cfg is not None:
        r, p = cfg.rollout, cfg.parallel
        engines = p.tensor * p.pipeline * p.context // r.tensor_parallel
        if engines != 1:
            raise CalibrationError(f"bench file {bench_path}: its job ran {engines} engines per "
                                   "model replica; calibration reads one engine per DP rank")
        return {"ranks": p.data, "cap": r.max_new_tokens, "engine_tp": r.tensor_parallel,
                "samples": r.prompts_per_step * r.samples_per_prompt // cfg.parallel.data,
                "draft_budget": min(cfg.spec.max_draft_tokens, r.max_new_tokens),
                "chunk": cfg.spec.draft_chunk, "in_flight": cfg.spec.draft_in_flight,
                "prefill_budget": cfg.spec.draft_prefill_tokens,
                "horizon": cfg.spec.draft_horizon, "order": cfg.ablation.draft_order,
                "continuation_k": cfg.spec.spec_k if cfg.ablation.speculative_continuation else 0,
                "engine": r.engine}
    ranks = sum(1 for k in off[0] if k.startswith("rank") and k.endswith("/bubble/idle_s"))
    if ranks < 1:
        raise CalibrationError(f"bench file {bench_path}: cannot tell the number of DP ranks "
                               "(no run config.yaml and no rank*/bubble/idle_s metrics)")
    cap = int(max(r["rollout/max_response_len"] for r in off))
    return {"ranks": ranks, "cap": cap, "engine_tp": 1, "samples": None, "draft_budget": cap,
            "chunk": 2, "in_flight": DRAFT_CONCURRENCY, "prefill_budget": 0, "horizon": 1,
            "order": "engines", "continuation_k": 0, "engine": None}


def _engine_costs(engine_paths, engine_name, lengths, measured_rank_s, prompt_len, notes):
    """(engine costs, engine name, rank timing noise): bench-engine shape or bench fit, scaled to
    the bench's rank times when per-rank lengths are known."""
    if engine_paths:
        rows, engine_name = load_engine_rows(engine_paths, engine_name)
        engine, engine_notes = fit_engine(rows)
        notes += engine_notes
    elif lengths is not None:
        engine = fit_engine_from_bench(lengths, measured_rank_s, prompt_len)
        notes.append("no bench-engine file: decode step fitted on the bench's own rank times "
                     "(in-sample)")
    else:
        raise CalibrationError("without the bench runs' rollouts.jsonl the simulator needs a "
                               "bench-engine JSON (--engine) for its costs")
    if lengths is None:
        notes.append("no per-rank lengths: bench-engine costs used unscaled, no timing noise")
        return engine, engine_name, 0.0
    modelled = np.asarray([engine.rollout(n - 1, np.zeros_like(n), prompt_len) for n in lengths])
    scale = float(np.median(measured_rank_s / modelled))
    jitter = fit_jitter(measured_rank_s, modelled * scale)
    notes.append(f"engine costs x {scale:.3g} to match the off run's rank rollout times; "
                 f"unexplained rank timing noise (log-sd) {jitter:.3g}")
    return engine.scaled(scale), engine_name, jitter


def _length_model(lengths: np.ndarray | None, cap: int, off: Sequence[Mapping], ranks: int,
                  samples: int, notes: list[str]) -> LengthModel:
    """The fitted length model: of the off run's responses (``lengths``), else the lognormal of
    ``DEFAULT_SIGMA`` matching the series' mean response length (``samples`` per rank)."""
    if lengths is not None:
        length_model = fit_capped_lengths(lengths, cap)
        notes.append(f"lengths: {lengths.size} measured responses, "
                     f"{(lengths >= cap).mean():.1%} at the budget {cap}")
    else:
        mean = sum(r["rollout/tokens"] for r in off) / (len(off) * ranks * samples)
        length_model = lengths_from_mean(mean / cap)
        notes.append("lengths: no rollouts.jsonl next to the bench; lognormal with sigma "
                     f"{DEFAULT_SIGMA} matching the mean response length")
    return length_model


def _acceptance(on: Sequence[Mapping], notes: list[str]) -> tuple[float, float]:
    """(per-token acceptance for the check, for the predicted grid) from the on run."""
    accept = fit_accept_prob(on)
    if accept is None:
        accept = DEFAULT_ACCEPT_PROB
        notes.append(f"the bench drafted nothing: acceptance per token {DEFAULT_ACCEPT_PROB}")
        grid_accept = accept
    else:
        grid_accept = grid_accept_prob(on, accept)
        notes.append(f"acceptance per token: fitted {accept:.4g} (the check); "
                     + (f"predictions use the lower bound A / (A + N) = {grid_accept:.4g}, as no "
                        "drafted token was rejected" if grid_accept < accept
                        else "predictions use the same"))
    return accept, grid_accept


def _continuation_gains(on: Sequence[Mapping], continuation_k: int, samples: int,
                        notes: list[str]) -> tuple[float, float]:
    """(gain past a draft's end, gain after a divergence), capped at ``continuation_k``; both 0
    without speculative continuation."""
    gain_past = gain_diverged = 0.0
    if continuation_k:
        gain_past, gain_diverged = fit_continuation(on, samples)
        gain_past = min(gain_past, continuation_k)
        if gain_diverged is None:
            gain_diverged = gain_past
            notes.append(f"continuation: {gain_past:.3g} accepted tokens per decode step past a "
                         "draft's end; no draft was rejected, so the same after a divergence")
        else:
            gain_diverged = min(gain_diverged, continuation_k)
            notes.append(f"continuation: {gain_past:.3g} accepted tokens per decode step past a "
                         f"draft's end, {gain_diverged:.3g} in steps with a divergence")
    return gain_past, gain_diverged


def calibrate(bench_path: str | Path, engine_paths: Sequence[str | Path] = (), *,
              prompt_len: int | None = None) -> Calibration:
    """Fit the simulator to one bench and optional bench-engine files (see the module docstring)."""
    bench_path = Path(bench_path)
    bench = load_bench(bench_path)
    on, off = bench["series"]["on"], bench["series"]["off"]
    cfg = bench_config(bench_path, bench)
    notes = [] if cfg is not None else ["no run config found: budget = longest response, "
                                        "draft budget = budget, chunk 2"]
    job = _job_shape(cfg, off, bench_path)
    ranks, cap = job["ranks"], job["cap"]
    lengths = read_lengths(_run_dir(bench_path, bench, "off"), ranks)
    samples = job["samples"] or (lengths.shape[2] if lengths is not None else 1)
    if prompt_len is None and cfg is not None:
        prompt_len = prompt_length(cfg)
    if prompt_len is None:
        prompt_len = 0
        notes.append("prompt length unknown (pass --prompt-len): taken as 0")

    length_model = _length_model(lengths, cap, off, ranks, samples, notes)

    # step 0 is left out of the time fits: its rollout includes the engine's warm-up
    engine, engine_name, jitter = _engine_costs(
        engine_paths, job["engine"], None if lengths is None else lengths[1:],
        rank_rollout_times(off, ranks)[1:], prompt_len, notes)
    verify_s, verify_token_s = fit_verify(on, ranks, prompt_len, engine.prefill_token_s)
    if lengths is not None:   # tokens of the rank with the most, per step
        heaviest = (lengths + prompt_len).sum(axis=-1).max(axis=-1).tolist()
    else:
        heaviest = [r["rollout/tokens"] / ranks + samples * prompt_len for r in off]
    train_token_s = _mean(r.get("train/step_s") for r in off) / max(_mean(heaviest), 1.0)
    costs = StepCosts(engine, verify_s, verify_token_s, train_token_s,
                      _mean(r.get("sync/reshard_s") for r in off), engine_tp=job["engine_tp"])
    accept, grid_accept = _acceptance(on, notes)
    gain_past, gain_diverged = _continuation_gains(on, job["continuation_k"], ranks * samples,
                                                   notes)
    setting = Setting(ranks, samples, prompt_len, cap, job["draft_budget"], accept_prob=accept,
                      draft_concurrency=job["in_flight"], draft_chunk=job["chunk"],
                      draft_prefill_tokens=job["prefill_budget"],
                      draft_horizon=job["horizon"], draft_order=job["order"],
                      engine_tp=job["engine_tp"],
                      jitter=jitter, continuation_k=job["continuation_k"],
                      continuation_gain_past=gain_past, continuation_gain_diverged=gain_diverged)
    measured = {k: bench.get(k) for k in (*CHECKED, "accepted_prefix_mean", "steps",
                                          "accept_per_token", "decode_steps_ratio_ceiling",
                                          "continuation_accepted_tokens",
                                          "continuation_proposed_tokens")}
    source = {"bench": str(bench_path), "engine": [str(p) for p in engine_paths],
              "engine_name": engine_name, "config": bench.get("config"),
              "overrides": bench.get("overrides", []), "machine": bench.get("machine", {})}
    return Calibration(setting, costs, length_model, measured, lengths, source, notes,
                       grid_accept_prob=grid_accept)


def calibration_check(cal: Calibration, *, replicates: int = 32, seed: int = 0) -> dict:
    """The simulator at the measured setting vs the bench, per metric: measured, simulated and
    relative error (simulated / measured - 1), in three modes:

    * ``replay``: the measured lengths of every rank and step, with the fitted timing noise (the
      random parts averaged over ``replicates`` seeds);
    * ``replay_no_jitter``: the same without timing noise (the bubble lengths alone explain);
    * ``sampled``: lengths drawn from the fitted model, with timing noise, as many steps as the
      bench ran, averaged over ``replicates`` seeds.

    ``sd`` is the spread of one replicate around that mean: for ``sampled``, how far one bench of
    that many steps may land from the model's mean by the draw of lengths alone.
    """
    runs = {}
    if cal.measured_lengths is not None:
        for mode, setting in (("replay", cal.setting),
                              ("replay_no_jitter", replace(cal.setting, jitter=0.0))):
            runs[mode] = [simulate(setting, cal.costs, measured_lengths=cal.measured_lengths,
                                   seed=seed + i) for i in range(replicates)]
    steps = len(cal.measured_lengths) if cal.measured_lengths is not None else cal.measured["steps"]
    runs["sampled"] = [simulate(cal.setting, cal.costs, cal.lengths, steps=int(steps),
                                seed=seed + i) for i in range(replicates)]
    out = {}
    for mode, reps in runs.items():
        rows = {}
        for key in CHECKED:
            values = [float(r[key]) for r in reps if math.isfinite(float(r[key]))]
            measured, simulated = cal.measured.get(key), _mean(values)
            error = (simulated / measured - 1.0 if measured not in (None, 0)
                     and math.isfinite(simulated) else math.nan)
            rows[key] = {"measured": measured, "simulated": simulated, "rel_error": error,
                         "sd": float(np.std(values)) if len(values) > 1 else math.nan}
        out[mode] = rows
    return out
