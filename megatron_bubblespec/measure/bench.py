"""Config -> paired runs, spec on / off -> plain vLLM replay -> ratios, whole + steady -> bench.*

``bench(config_path, out_dir, overrides)`` loads the config twice, once with ``spec.enabled=true``
and once with ``spec.enabled=false`` (everything else identical, so both runs see the same seeds,
prompts and sampling keys), trains each as its own run under ``out_dir`` (run names
``<run.name>-on`` and ``<run.name>-off``, BubbleSpec on first), then replays the off run's samples
with plain vLLM sampling (:mod:`megatron_bubblespec.measure.plain_replay`: vLLM's own sampler, no
keyed processor, no drafts, each sample exactly as many tokens as in the off run, the initial
checkpoint, each DP rank's batch timed in turn and the slowest taken per step; written as the run
directory ``<run.name>-plain``; ``plain=False`` / ``--no-plain`` skips it) and compares.
``resume=True`` / ``--resume`` keeps each of the three runs that already finished under ``out_dir``
with the same resolved config (:func:`finished_run`; the off run and its replay also serve other
``spec`` settings and KV blocks, which BubbleSpec off does not read) and runs only the missing
ones, so a bench stopped during its last run does not redo the first two, and a study of spec
settings reruns only the on run; ``machine.reused`` names the kept runs.
The comparison:

* cost, over a step range: once over the steps >= 1 (the first step has no drafts to verify; the
  keys at the top level) and once over the steady state, the steps >= H + 1 (``steady_state``: the
  same keys plus ``first_step``; one function, :func:`compare_steps`, makes both). H =
  ``ablation.draft_lookahead`` + ``spec.draft_horizon`` - 1 is the last step that step 0's bubble
  drafts (step t's bubble drafts steps t + k .. t + k + h - 1, k the lookahead, h the horizon):
  steps 1 .. H ride on step 0's bubble, that of a step rolled out without drafts (its ranks
  finish closer together), and the steady state starts right after them.
  ``steps_compared`` = steps in the range;
  ``decode_steps_ratio`` = sum on decode steps / sum off decode steps (per request, the paper's
  metric); ``engine_steps_ratio`` = sum on / sum off of the step's engine steps (per step the
  slowest rank's: what its wall time follows, several tokens per request in a continuation step);
  ``rollout_time_ratio`` = on rollout time / off rollout time;
  ``throughput_ratio`` = off rollout time / on rollout time;
  ``throughput_ratio_with_verify`` = off rollout time / (on rollout time + on verify time + on
  overshoot time), since verifying the drafts is part of what the on run pays, and so is the
  overshoot (``bubble/overshoot_wall_s``: a drafting engine finishes the engine step it is in
  when the barrier closes, and the step waits for it);
  ``throughput_vs_plain`` = plain rollout time / (on rollout time + on verify time + on overshoot
  time): BubbleSpec against the rollout users run today (DESIGN.md, "What faster means");
  ``throughput_off_vs_plain`` = plain rollout time / off rollout time (below 1: what the keyed
  draw itself costs);
  ``verify_overhead_frac`` = on verify time / on rollout time; ``overshoot_frac`` = on overshoot
  time / on rollout time;
  the sums behind them: ``decode_steps_on`` / ``_off``, ``engine_steps_on`` / ``_off``,
  ``rollout_time_on_s`` / ``_off_s`` / ``_plain_s``, ``verify_time_on_s``, ``overshoot_time_on_s``;
* drafts, over the same range (step 0 has none): ``accepted_prefix_mean`` (weighted by drafted
  samples), ``accept_rate`` (accepted / drafted tokens), ``drafted_tokens``, ``accepted_tokens``,
  ``draft_len_mean`` (drafted tokens / drafted samples), ``draft_coverage`` (drafted tokens / on
  response tokens: the share of the responses the bubbles drafted; a draft longer than its
  response counts in full), ``accepted_coverage`` ((prefix + continuation accepted tokens) / on
  response tokens); the ceiling (:mod:`megatron_bubblespec.measure.sim.ceiling`): ``accept_per_token`` (a
  lower bound from the verified prefixes), ``decode_steps_ratio_ceiling`` = 1 - accept_per_token x
  draft_coverage (the lowest decode steps ratio exact verification allows with these drafts) and
  ``decode_steps_ratio_ceiling_full_coverage`` = 1 - accept_per_token (drafts covering every
  response); speculative continuation (rollout proposals, ``ablation.proposal_sources``):
  ``continuation_proposed_tokens``, ``continuation_accepted_tokens``, ``continuation_accept_rate``
  (accepted / proposed), and per source ``continuation_{proposed,accepted}_tokens_<source>``;
* bubble, over all steps (the drafts of step t are made in the bubble of step t - 1):
  ``bubble_ratio_off`` = idle share of the off run's rank rollout time (the bubble there is to use),
  ``bubble_ratio_on``, ``bubble_utilization`` = on drafting time / on idle time of the bubbles
  that could draft (:func:`megatron_bubblespec.metrics.summary.bubble_utilization`: the last step
  has nothing to draft);
* exactness: ``token_mismatch`` = response token positions that differ between the two runs over
  all steps and samples (a length difference counts its extra tokens, a sample missing from one run
  all of its tokens) and ``token_mismatch_samples`` = samples with any difference; both must be 0;
* training: ``lr`` (the on run's last logged learning rate), ``policy_drift_kl_mean`` (mean over
  the on run's steps of ``policy/drift_kl``; ``policy_drift_kl_mean_off`` the off run's),
  ``reward_mean_on`` / ``reward_mean_off``;
* context: ``name``, ``steps``, ``runs`` (the run directories: on, off and plain when replayed),
  ``machine`` (cpu count, torch version, start and end date, wall time, load average),
  ``config``, ``overrides``, and ``series`` (the full per-step records of both runs and, when
  replayed, ``plain``'s: ``rollout/time_s`` the slowest rank's, ``rank<r>/rollout/time_s``,
  ``rollout/tokens``, ``rollout/decode_steps``, ``rollout/engine_steps``; NaN as null).

A ratio whose denominator is 0 or missing is NaN in memory and null in bench.json (so is every
plain-vLLM number without the replay, and the steady state of a run too short to have one).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import time
from pathlib import Path
from typing import Mapping, Sequence

from megatron_bubblespec.config.schema import PROPOSAL_SOURCES
from megatron_bubblespec.machine import machine_info
from megatron_bubblespec.metrics import to_json
from megatron_bubblespec.metrics.aggregate import ratio
from megatron_bubblespec.metrics.formatting import (count, number, percent, scientific, seconds,
                                                    value)
from megatron_bubblespec.metrics.reduce import finite_values, mean_of, total_of, weighted_mean_of
from megatron_bubblespec.metrics.summary import bubble_utilization, plot_decode_breakdown
from megatron_bubblespec.measure.sim.ceiling import accept_per_token_lower_bound, decode_steps_ratio_ceiling

Record = Mapping[str, object]

# (label, key in the result, formatter) of the summary table in bench.md, in row order; the keys
# of compare_steps get a steady-state value too.
SUMMARY_ROWS = (
    ("decode steps on / off", "decode_steps_ratio", number),
    ("engine steps on / off", "engine_steps_ratio", number),
    ("rollout time on / off", "rollout_time_ratio", number),
    ("throughput on vs off (off time / on time)", "throughput_ratio", number),
    ("throughput with verify (off / (on + verify + overshoot))", "throughput_ratio_with_verify",
     number),
    ("throughput vs plain vLLM (plain / (on + verify + overshoot))", "throughput_vs_plain", number),
    ("throughput off vs plain vLLM (plain / off: the keyed draw)", "throughput_off_vs_plain",
     number),
    ("verify time / on rollout time", "verify_overhead_frac", percent),
    ("overshoot time / on rollout time", "overshoot_frac", percent),
    ("rollout time on", "rollout_time_on_s", seconds),
    ("rollout time off", "rollout_time_off_s", seconds),
    ("rollout time plain vLLM", "rollout_time_plain_s", seconds),
    ("verify time on", "verify_time_on_s", seconds),
    ("overshoot time on (drafting past the barrier)", "overshoot_time_on_s", seconds),
    ("decode steps on", "decode_steps_on", count),
    ("decode steps off", "decode_steps_off", count),
    ("engine steps on", "engine_steps_on", count),
    ("engine steps off", "engine_steps_off", count),
    ("accepted prefix mean (tokens)", "accepted_prefix_mean", number),
    ("accept rate (accepted / drafted tokens)", "accept_rate", percent),
    ("drafted tokens", "drafted_tokens", count),
    ("draft length mean (tokens per drafted sample)", "draft_len_mean", number),
    ("drafted share of the responses", "draft_coverage", percent),
    ("accepted share of the responses", "accepted_coverage", percent),
    ("per-token acceptance (lower bound, from the prefixes)", "accept_per_token", percent),
    ("decode steps on / off ceiling with these drafts", "decode_steps_ratio_ceiling", number),
    ("decode steps on / off ceiling, drafts covering all", "decode_steps_ratio_ceiling_full_coverage",
     number),
    ("accepted tokens", "accepted_tokens", count),
    ("continuation proposed tokens", "continuation_proposed_tokens", count),
    ("continuation accepted tokens", "continuation_accepted_tokens", count),
    ("continuation accept rate (accepted / proposed)", "continuation_accept_rate", percent),
    ("continuation proposed tokens from bubble", "continuation_proposed_tokens_bubble", count),
    ("continuation accepted tokens from bubble", "continuation_accepted_tokens_bubble", count),
    ("continuation proposed tokens from prompt", "continuation_proposed_tokens_prompt", count),
    ("continuation accepted tokens from prompt", "continuation_accepted_tokens_prompt", count),
    ("continuation proposed tokens from self", "continuation_proposed_tokens_self", count),
    ("continuation accepted tokens from self", "continuation_accepted_tokens_self", count),
    ("bubble ratio, off run (all steps)", "bubble_ratio_off", percent),
    ("bubble ratio, on run (all steps)", "bubble_ratio_on", percent),
    ("bubble utilization (drafting / idle), on run (all steps)", "bubble_utilization", percent),
    ("token mismatch on vs off (tokens, all steps)", "token_mismatch", count),
    ("token mismatch on vs off (samples, all steps)", "token_mismatch_samples", count),
    ("reward mean, on run", "reward_mean_on", number),
    ("reward mean, off run", "reward_mean_off", number),
    ("learning rate", "lr", scientific),
    ("policy drift KL mean, on run", "policy_drift_kl_mean", scientific),
)

# (header, metric, formatter) of the per-step table in bench.md; each shown for on and off.
STEP_COLUMNS = (
    ("decode steps", "rollout/decode_steps", count),
    ("engine steps", "rollout/engine_steps", count),
    ("rollout", "rollout/time_s", seconds),
    ("verify", "spec/verify_s", seconds),
    ("bubble", "bubble/ratio", percent),
)
# Shown for the plain vLLM replay, when there is one.
STEP_COLUMNS_PLAIN = (("rollout plain", "rollout/time_s", seconds),)
# Shown for the on run only.
STEP_COLUMNS_ON = (
    ("util", "bubble/utilization", percent),
    ("accept", "spec/accept_rate", percent),
    ("prefix", "spec/accepted_prefix_mean", number),
    ("drift KL", "policy/drift_kl", scientific),
)


def token_mismatch(on: Sequence[Mapping[int, Sequence[int]]],
                   off: Sequence[Mapping[int, Sequence[int]]]) -> tuple[int, int]:
    """(differing token positions, differing samples) between two runs' per-step rollouts.

    Positions are compared one to one; the tokens past the shorter response count as differing, a
    sample (or step) present in one run only counts all of its tokens.
    """
    tokens = samples = 0
    for step in range(max(len(on), len(off))):
        a = on[step] if step < len(on) else {}
        b = off[step] if step < len(off) else {}
        for index in set(a) | set(b):
            x, y = list(a.get(index, ())), list(b.get(index, ()))
            diff = sum(1 for p, q in zip(x, y) if p != q) + abs(len(x) - len(y))
            if index not in a or index not in b:
                diff = max(diff, 1)  # a missing sample differs even when the other is empty
            if diff:
                tokens += diff
                samples += 1
    return tokens, samples


def steady_state_first_step(cfg) -> int:
    """H + 1, H = ``ablation.draft_lookahead`` + ``spec.draft_horizon`` - 1: step 0's bubble drafts
    steps k .. H (k = the lookahead), all from one long bubble (step 0 rolls out without drafts),
    so the steady state starts right after them."""
    return cfg.ablation.draft_lookahead + cfg.spec.draft_horizon


def compare_steps(on: Sequence[Record], off: Sequence[Record], plain: Sequence[Record],
                  first_step: int) -> dict:
    """The cost and draft numbers of the module docstring over the steps >= ``first_step``."""
    on, off, plain = ([r for r in records if value(r, "step") >= first_step]
                      for records in (on, off, plain))
    dec_on, dec_off = total_of(on, "rollout/decode_steps"), total_of(off, "rollout/decode_steps")
    eng_on, eng_off = total_of(on, "rollout/engine_steps"), total_of(off, "rollout/engine_steps")
    t_on, t_off = total_of(on, "rollout/time_s"), total_of(off, "rollout/time_s")
    t_plain = total_of(plain, "rollout/time_s")
    verify = total_of(on, "spec/verify_s")
    overshoot = total_of(on, "bubble/overshoot_wall_s")
    paid = t_on + sum(0.0 if math.isnan(t) else t for t in (verify, overshoot))
    drafted, samples = total_of(on, "spec/drafted_tokens"), total_of(on, "spec/drafted_samples")
    accepted, tokens_on = total_of(on, "spec/accepted_tokens"), total_of(on, "rollout/tokens")
    proposed = total_of(on, "spec/continuation_proposed_tokens")
    continued = total_of(on, "spec/continuation_accepted_tokens")
    coverage = ratio(drafted, tokens_on)
    per_token = accept_per_token_lower_bound(accepted, samples)
    return {
        "first_step": first_step,
        "steps_compared": len(on),
        "decode_steps_on": dec_on,
        "decode_steps_off": dec_off,
        "decode_steps_ratio": ratio(dec_on, dec_off),
        "engine_steps_on": eng_on,
        "engine_steps_off": eng_off,
        "engine_steps_ratio": ratio(eng_on, eng_off),
        "rollout_time_on_s": t_on,
        "rollout_time_off_s": t_off,
        "rollout_time_plain_s": t_plain,
        "verify_time_on_s": verify,
        "overshoot_time_on_s": overshoot,
        "rollout_time_ratio": ratio(t_on, t_off),
        "throughput_ratio": ratio(t_off, t_on),
        "throughput_ratio_with_verify": ratio(t_off, paid),
        "throughput_vs_plain": ratio(t_plain, paid),
        "throughput_off_vs_plain": ratio(t_plain, t_off),
        "verify_overhead_frac": ratio(verify, t_on),
        "overshoot_frac": ratio(overshoot, t_on),
        "accepted_prefix_mean": weighted_mean_of(on, "spec/accepted_prefix_mean",
                                               "spec/drafted_samples"),
        "accept_rate": ratio(accepted, drafted),
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "draft_len_mean": ratio(drafted, samples),
        "draft_coverage": coverage,
        "accepted_coverage": ratio(accepted + (0.0 if math.isnan(continued) else continued),
                                   tokens_on),
        "accept_per_token": per_token,
        "decode_steps_ratio_ceiling": decode_steps_ratio_ceiling(per_token, coverage),
        "decode_steps_ratio_ceiling_full_coverage": decode_steps_ratio_ceiling(per_token, 1.0),
        "continuation_proposed_tokens": proposed,
        "continuation_accepted_tokens": continued,
        "continuation_accept_rate": ratio(continued, proposed),
        **{f"continuation_{kind}_tokens_{source}":
           total_of(on, f"spec/continuation_{kind}_tokens/{source}")
           for source in PROPOSAL_SOURCES for kind in ("proposed", "accepted")},
    }


def compare(on: Sequence[Record], off: Sequence[Record], plain: Sequence[Record] = (),
            steady_from: int | None = None) -> dict:
    """The numbers of the module docstring from the runs' step records (``plain``: the plain
    vLLM replay's, if any): :func:`compare_steps` over the steps >= 1 at the top level and, with
    ``steady_from``, over the steps >= ``steady_from`` as ``steady_state``."""
    whole = compare_steps(on, off, plain, 1)
    del whole["first_step"]

    def bubble_ratio(records):
        # mean of the step ratios weighted by rollout time = idle / (ranks x total rollout time)
        return weighted_mean_of(records, "bubble/ratio", "rollout/time_s")

    lrs = finite_values(value(r, "train/lr") for r in on)
    result = {
        "steps": len(on),
        **whole,
        "bubble_ratio_off": bubble_ratio(off),
        "bubble_ratio_on": bubble_ratio(on),
        "bubble_utilization": bubble_utilization(on),
        "reward_mean_on": mean_of(on, "train/reward_mean"),
        "reward_mean_off": mean_of(off, "train/reward_mean"),
        "lr": lrs[-1] if lrs else math.nan,
        "policy_drift_kl_mean": mean_of(on, "policy/drift_kl"),
        "policy_drift_kl_mean_off": mean_of(off, "policy/drift_kl"),
    }
    if steady_from is not None:
        result["steady_state"] = compare_steps(on, off, plain, steady_from)
    return result


def _fmt(fmt, x) -> str:
    return fmt(math.nan if x is None else float(x))


# The keys compare_steps computes over a step range (the ones with a steady-state value).
RANGED = frozenset(compare_steps((), (), (), 1))


def markdown_summary(result: Mapping[str, object]) -> str:
    """The summary table of bench.md: one row per number, whole run | steady state."""
    steady = result.get("steady_state")
    if not steady:
        lines = ["| metric | whole run (steps >= 1) |", "|---|---:|"]
        lines += [f"| {label} | {_fmt(fmt, result.get(key))} |" for label, key, fmt in SUMMARY_ROWS]
        return "\n".join(lines)
    first = steady["first_step"]
    lines = [f"| metric | whole run (steps >= 1) | steady state (steps >= {first}) |",
             "|---|---:|---:|"]
    for label, key, fmt in SUMMARY_ROWS:
        later = _fmt(fmt, steady.get(key)) if key in RANGED else ""
        lines.append(f"| {label} | {_fmt(fmt, result.get(key))} | {later} |")
    return "\n".join(lines)


def markdown_steps(on: Sequence[Record], off: Sequence[Record],
                   plain: Sequence[Record] = ()) -> str:
    """The per-step table of bench.md: on and off side by side (and the plain vLLM replay)."""
    plain_columns = STEP_COLUMNS_PLAIN if plain else ()
    header = ["step"]
    for name, _, _ in STEP_COLUMNS:
        header += [f"{name} on", f"{name} off"]
    header += [name for name, _, _ in plain_columns]
    header += [f"{name} on" for name, _, _ in STEP_COLUMNS_ON]
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for step in range(max(len(on), len(off))):
        a = on[step] if step < len(on) else {}
        b = off[step] if step < len(off) else {}
        c = plain[step] if step < len(plain) else {}
        row = [str(step)]
        for _, key, fmt in STEP_COLUMNS:
            row += [fmt(value(a, key)), fmt(value(b, key))]
        row += [fmt(value(c, key)) for _, key, fmt in plain_columns]
        row += [fmt(value(a, key)) for _, key, fmt in STEP_COLUMNS_ON]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _regimes(result: Mapping[str, object]) -> str:
    """The paragraph of bench.md on the two step ranges and the plain baseline."""
    first = result["steady_state"]["first_step"]
    before = "step 1 takes its" if first == 2 else f"steps 1 .. {first - 1} take their"
    text = (f"Whole run: ratios over steps >= 1 (bubble, token mismatch and training over all "
            f"steps). Steady state: steps >= {first}; before it, {before} drafts (if any) "
            f"from step 0's bubble (ablation.draft_lookahead + spec.draft_horizon - 1 = {first - 1}), "
            f"the bubble of a step rolled out without drafts.")
    if not result["steady_state"]["steps_compared"]:
        text += (f" This run has no steady-state step: run more than {first} steps "
                 "(run.steps) for one.")
    if result["series"].get("plain"):
        text += (" Plain vLLM: the off run's samples replayed with vLLM's own sampler (no keyed "
                 "draw, no drafts), each exactly as many tokens as in the off run, initial "
                 "checkpoint, each DP rank's batch timed in turn, the slowest per step.")
    else:
        text += " Plain vLLM replay skipped (--no-plain): its numbers are empty."
    return text


def markdown(result: Mapping[str, object]) -> str:
    m = result["machine"]
    over = " ".join(result["overrides"]) or "(none)"
    series = result["series"]
    return "\n".join([
        f"# BubbleSpec on vs off: {result['name']}",
        "",
        f"config `{result['config']}`, overrides `{over}`; {result['steps']} steps per run.",
        f"machine: {m['cpus_usable']} of {m['cpu_count']} CPUs, torch {m['torch']}, "
        f"{m['cuda'] or 'no GPU'}, {m['started']} to {m['date']} ({m['wall_s']:.0f} s), "
        f"load average at the end "
        f"{' '.join(f'{x:.2f}' for x in m['loadavg_1_5_15'] or ())}"
        + (f"; runs kept from an earlier bench (--resume): {', '.join(m['reused'])}."
           if m.get("reused") else "."),
        "",
        _regimes(result),
        "",
        markdown_summary(result),
        "",
        "## Per step",
        "",
        markdown_steps(series["on"], series["off"], series.get("plain", ())),
        "",
        "## Where the decode steps went (on run; line: decode steps of the off run)",
        "",
        "![decode steps per step](bench_decode.png)",
        "",
    ])


# Keys no run's tokens, counts or rollout work depend on: where and how often it checkpoints,
# its watchdogs and what it logs.
OBSERVER_KEYS = {"run": ("resume", "checkpoint_every", "checkpoint_dir", "keep_checkpoints",
                         "stall_timeout_s", "signal_grace_s", "checkpoint_grace_s"),
                 "logging": ("tensorboard", "progress", "plot")}
# Keys a run with BubbleSpec off does not depend on either: the KV block is the unit of reuse of
# drafts' KV (spec.reuse_draft_kv); without drafts it changes neither a token nor an engine step
# (the same off run served benches at blocks of 128 and 32 with 0 mismatched tokens).
OFF_RUN_KEYS = {"rollout": ("kv_block_size",)}


def _as_run(cfg) -> str:
    """The config as the run reads it, in YAML: the keys that cannot change its records set to
    their defaults. A run with BubbleSpec off reads nothing of ``spec`` but ``spec.enabled``
    (every other key, and every ``ablation`` key, is gated on it) and no key of ``OFF_RUN_KEYS``;
    no run depends on
    ``OBSERVER_KEYS``."""
    from megatron_bubblespec.config.load import to_yaml
    from megatron_bubblespec.config.schema import AblationConfig, SpecConfig

    neutral = dict(OBSERVER_KEYS)
    if not cfg.spec.enabled:
        cfg = dataclasses.replace(cfg, spec=SpecConfig(enabled=False), ablation=AblationConfig())
        neutral.update(OFF_RUN_KEYS)
    for room, keys in neutral.items():
        section = getattr(cfg, room)
        defaults = type(section)()
        cfg = dataclasses.replace(cfg, **{room: dataclasses.replace(
            section, **{key: getattr(defaults, key) for key in keys})})
    return to_yaml(cfg)


def finished_run(run_cfg, steps: int | None = None) -> dict | None:
    """The records and rollouts of the run ``run_cfg`` names if it finished all ``steps`` (default
    ``run_cfg.run.steps``) with this config (its ``config.yaml``, up to the keys :func:`_as_run`
    leaves out: an off run serves benches of any spec settings and KV block);
    else None. A plain replay directory has no config of its own: pass the off run's config and
    its run name."""
    from megatron_bubblespec.config import ConfigError, load_config
    from megatron_bubblespec.loop.train import run_dir
    from megatron_bubblespec.metrics import read_metrics
    from megatron_bubblespec.metrics.rollouts import read_rollouts

    path = run_dir(run_cfg)
    steps = run_cfg.run.steps if steps is None else steps
    config = path / "config.yaml"
    if config.is_file():
        try:
            saved = load_config(config)   # but where the run lies now, and its config's file
            saved = dataclasses.replace(
                saved, config_path=run_cfg.config_path,
                run=dataclasses.replace(saved.run, output_dir=run_cfg.run.output_dir))
            if _as_run(saved) != _as_run(run_cfg):
                return None
        except ConfigError:
            return None
    try:
        records = read_metrics(path)
    except (FileNotFoundError, ValueError):
        return None
    rollouts = read_rollouts(path)
    if [r["step"] for r in records] != list(range(steps)) or len(rollouts) != steps:
        return None
    return {"records": records, "rollouts": rollouts}


def bench(config_path: str | Path, out_dir: str | Path, overrides: Sequence[str] = (),
          plain: bool = True, resume: bool = False) -> dict:
    """Run the paired on/off runs of ``config_path`` under ``out_dir`` (and, with ``plain``, the
    plain vLLM replay of the off run) and write the bench files; with ``resume``, the runs that
    already finished there with the same config are kept."""
    from megatron_bubblespec.config import ConfigError, load_config
    from megatron_bubblespec.measure.plain_replay import check_replayable, replay_plain
    from megatron_bubblespec.loop.train import train
    from megatron_bubblespec.metrics import plot_run

    out = Path(out_dir)
    overrides = list(overrides)
    cfg = load_config(config_path, overrides)  # validates before any run starts
    name = cfg.run.name
    if plain:
        try:
            check_replayable(cfg)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    started, t0 = datetime.datetime.now().astimezone(), time.perf_counter()
    runs, reused = {}, []
    for mode, enabled in (("on", "true"), ("off", "false")):
        run_cfg = load_config(config_path, [*overrides, f"run.output_dir={out}",
                                            f"run.name={name}-{mode}", f"spec.enabled={enabled}"])
        runs[mode] = finished_run(run_cfg) if resume else None
        if runs[mode] is None:
            runs[mode] = train(run_cfg)
        else:
            reused.append(mode)
    on, off = runs["on"]["records"], runs["off"]["records"]
    dirs = {"on": str(out / f"{name}-on"), "off": str(out / f"{name}-off")}
    series = {"on": list(on), "off": list(off)}
    if plain:
        dirs["plain"] = str(out / f"{name}-plain")
        kept = (finished_run(load_config(Path(dirs["off"]) / "config.yaml",
                                         [f"run.output_dir={out}", f"run.name={name}-plain"]),
                             cfg.run.steps)
                if resume and "off" in reused else None)
        if kept is None:
            series["plain"] = replay_plain(dirs["off"], dirs["plain"]).records
        else:
            series["plain"] = kept["records"]
            reused.append("plain")
    mismatch, mismatch_samples = token_mismatch(runs["on"]["rollouts"], runs["off"]["rollouts"])
    steady_from = steady_state_first_step(cfg)
    result = {
        "name": name,
        "config": str(config_path),
        "overrides": overrides,
        "runs": dirs,
        **compare(on, off, series.get("plain", ()), steady_from),
        "token_mismatch": mismatch,
        "token_mismatch_samples": mismatch_samples,
        "machine": {**machine_info(), "started": started.isoformat(timespec="seconds"),
                    "wall_s": time.perf_counter() - t0, "reused": reused},
        "series": series,
    }
    out.mkdir(parents=True, exist_ok=True)
    text = to_json(result, indent=1)
    (out / "bench.json").write_text(text + "\n")
    (out / "bench.md").write_text(markdown(result))
    plot_run(on, out / "bench.png", baseline=off)
    plot_decode_breakdown(on, out / "bench_decode.png", baseline=off, steady_from=steady_from)
    return result


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``bench`` on a ``parser.add_subparsers()`` object."""
    parser = subparsers.add_parser("bench", help=cmd_bench.__doc__,
                                   description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML config (see configs/)")
    parser.add_argument("--out", required=True, help="directory for the two runs and bench.*")
    parser.add_argument("--no-plain", action="store_true",
                        help="skip the plain vLLM replay of the off run (no throughput_vs_plain)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs that already finished under --out with the same "
                             "config; run only the missing ones")
    parser.add_argument("overrides", nargs="*",
                        help="dotted overrides for both runs, e.g. run.steps=3")
    parser.set_defaults(func=cmd_bench)
    return parser


def cmd_bench(args) -> int:
    """Run a config with BubbleSpec on and off, replay the off run with plain vLLM: bench.*"""
    import sys

    from megatron_bubblespec.config import ConfigError

    try:
        result = bench(args.config, args.out, args.overrides, plain=not args.no_plain,
                       resume=args.resume)
    except ConfigError as err:
        print(f"bubblespec bench: config error: {err}", file=sys.stderr)
        return 2
    print(markdown_summary(result))
    print(f"bench files: {Path(args.out) / 'bench.json'}, bench.md, bench.png, bench_decode.png")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_bubblespec.measure.bench")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(argv if argv is not None else __import__("sys").argv[1:])])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
