"""Config -> paired runs, spec on / off -> plain vLLM replay -> ratios, whole + steady -> bench.*

``bench(config_path, out_dir, overrides)`` loads the config twice, once with ``spec.enabled=true``
and once with ``spec.enabled=false`` (everything else identical, so both runs see the same seeds,
prompts and sampling keys), trains each as its own run under ``out_dir`` (run names
``<run.name>-on`` and ``<run.name>-off``, BubbleSpec on first), then replays the off run's samples
with plain vLLM sampling (:mod:`megatron_bubblespec.measure.plain_replay`: vLLM's own sampler, no
keyed processor, no drafts, each sample exactly as many tokens as in the off run, the initial
checkpoint, every rollout engine's batch run at once in its own process, as the run's engines
run, and the slowest taken per step; written as the run directory ``<run.name>-plain``;
``plain=False`` / ``--no-plain`` skips it) and compares.
``resume=True`` / ``--resume`` keeps each of the three runs that already finished under ``out_dir``
with the same resolved config (:func:`finished_run`; the off run and its replay also serve other
``spec`` settings and KV blocks, which BubbleSpec off does not read) and runs only the missing
ones, so a bench stopped during its last run does not redo the first two, and a study of spec
settings reruns only the on run; ``machine.reused`` names the kept runs. Each run's own start, end
and load average are written into its directory when it runs (``RUN_RECORD``) and read back into
``machine.runs``, so a resumed bench, or one whose run directories were copied in, still says when
and beside what load each of its runs ran.
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
  time): BubbleSpec against the rollout users run today (docs/results/README.md, "How the bench
  measures");
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
  response counts up to the response's length, in full in runs recorded before
  ``spec/drafted_tokens_in_response``), ``accepted_coverage`` ((prefix + continuation accepted
  tokens) / on response tokens); the ceiling (:mod:`megatron_bubblespec.measure.sim.ceiling`):
  ``accept_per_token`` (a lower bound from the verified prefixes),
  ``decode_steps_ratio_ceiling`` = 1 - accept_per_token x draft_coverage (the lowest decode steps
  ratio exact verification allows with these drafts) and
  ``decode_steps_ratio_ceiling_full_coverage`` = 1 - accept_per_token (drafts covering every
  response); speculative continuation (rollout proposals, ``spec.proposal_sources``):
  ``continuation_proposed_tokens``, ``continuation_accepted_tokens``, ``continuation_accept_rate``
  (accepted / proposed), and per source ``continuation_{proposed,accepted}_tokens_<source>``;
* bubble, over all steps (the drafts of step t are made in the bubble of step t - 1):
  ``bubble_ratio_off`` = idle share of the off run's rank rollout time (the bubble there is to use),
  ``bubble_ratio_on``, ``bubble_utilization`` = on drafting time / on idle time of the bubbles
  that could draft (:func:`megatron_bubblespec.metrics.reduce.bubble_utilization`: the last step
  has nothing to draft);
* exactness: ``token_mismatch`` = response token positions that differ between the two runs over
  all steps and samples (a length difference counts its extra tokens, a sample missing from one run
  all of its tokens) and ``token_mismatch_samples`` = samples with any difference; both must be 0;
  ``parted_at_step`` = the first step whose tokens differ (None: never). From that step on the two
  runs do different work, so every other number above and below is over the steps before it only
  (``steps_compared`` says how many); ``learner_parted_at_step`` = the first step whose learner
  fingerprints (``exact/batch_hash``, ``exact/state_hash``) differ, None when they never do or
  the runs did not record them;
* training: ``lr`` (the on run's last logged learning rate), ``policy_drift_kl_mean`` (mean over
  the on run's steps of ``policy/drift_kl``; ``policy_drift_kl_mean_off`` the off run's),
  ``reward_mean_on`` / ``reward_mean_off``, ``reward_first4_on`` / ``reward_last4_on`` (the on
  run's first and last 4 steps), ``token_entropy_mean`` (mean of ``train/entropy`` over the on run's
  steps: the entropy of softmax(logits / T) at the sampled tokens' positions, before top-p);
* context: ``name``, ``steps``, ``runs`` (the run directories: on, off and plain when replayed),
  ``machine`` (cpu count, torch version, start and end date, wall time, load average; ``reused``,
  the runs kept by ``--resume``; ``runs``, each run's own start, end and load average),
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
import json
import math
import time
from pathlib import Path
from typing import Mapping, Sequence

from megatron_bubblespec.machine import load_average, machine_info
from megatron_bubblespec.measure.bench_report import SOURCE_COUNTS, markdown, markdown_summary
from megatron_bubblespec.measure.sim.ceiling import (accept_per_token_lower_bound,
                                                     decode_steps_ratio_ceiling)
from megatron_bubblespec.metrics import to_json
from megatron_bubblespec.metrics.aggregate import ratio
from megatron_bubblespec.metrics.formatting import value
from megatron_bubblespec.metrics.plots import plot_decode_breakdown, plot_run
from megatron_bubblespec.metrics.reduce import (bubble_utilization, finite_values, mean_of,
                                               total_of, weighted_mean_of)

Record = Mapping[str, object]

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


def parted_at_step(on: Sequence[Mapping[int, Sequence[int]]],
                   off: Sequence[Mapping[int, Sequence[int]]]) -> int | None:
    """The first step whose rollouts differ between the two runs (None: none does)."""
    for step in range(max(len(on), len(off))):
        if token_mismatch(on[step:step + 1], off[step:step + 1])[0]:
            return step
    return None


LEARNER_FINGERPRINTS = ("exact/batch_hash", "exact/state_hash")


def learner_parted_at_step(on: Sequence[Record], off: Sequence[Record]) -> int | None:
    """The first step whose learner fingerprints differ (None: none does, or not recorded)."""
    for a, b in zip(on, off):
        for name in LEARNER_FINGERPRINTS:
            if name in a and name in b and a[name] != b[name]:
                return int(value(a, "step"))
    return None


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
    # runs recorded before the in-response count: a draft counts in full
    within = total_of(on, "spec/drafted_tokens_in_response")
    coverage = ratio(drafted if math.isnan(within) else within, tokens_on)
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
        **{result: total_of(on, key) for key, result, _, _ in SOURCE_COUNTS},
    }


def before_step(records: Sequence[Record], step: int | None) -> list[Record]:
    """The records of the steps before ``step`` (all of them when ``step`` is None)."""
    return [r for r in records if step is None or value(r, "step") < step]


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
        # whether the job learns: the reward's first and last steps
        "reward_first4_on": mean_of(on[:4], "train/reward_mean"),
        "reward_last4_on": mean_of(on[-4:], "train/reward_mean"),
        "token_entropy_mean": mean_of(on, "train/entropy"),
        "lr": lrs[-1] if lrs else math.nan,
        "policy_drift_kl_mean": mean_of(on, "policy/drift_kl"),
        "policy_drift_kl_mean_off": mean_of(off, "policy/drift_kl"),
    }
    if steady_from is not None:
        result["steady_state"] = compare_steps(on, off, plain, steady_from)
    return result


def finished_run(run_cfg, steps: int | None = None) -> dict | None:
    """The records and rollouts of the run ``run_cfg`` names if it finished all ``steps`` (default
    ``run_cfg.run.steps``) with this config (its ``config.yaml``, up to the keys
    ``config.identity.run_identity`` leaves out: an off run serves benches of any spec settings);
    else None. A plain replay directory has no config of its own: pass the off run's config and
    its run name."""
    from megatron_bubblespec.config import ConfigError
    from megatron_bubblespec.config.identity import run_identity
    from megatron_bubblespec.loop.run_dir import RunDir

    run = RunDir.of(run_cfg)
    steps = run_cfg.run.steps if steps is None else steps
    if run.has_config():
        try:
            saved = run.read_config()   # but where the run lies now, and its config's file
            saved = dataclasses.replace(
                saved, config_path=run_cfg.config_path,
                run=dataclasses.replace(saved.run, output_dir=run_cfg.run.output_dir))
            if run_identity(saved) != run_identity(run_cfg):
                return None
        except ConfigError:
            return None
    try:
        records = run.read_metrics()
    except (FileNotFoundError, ValueError):
        return None
    rollouts = run.read_rollouts()
    if [r["step"] for r in records] != list(range(steps)) or len(rollouts) != steps:
        return None
    return {"records": records, "rollouts": rollouts}


def bench(config_path: str | Path, out_dir: str | Path, overrides: Sequence[str] = (),
          plain: bool = True, resume: bool = False) -> dict:
    """Run the paired on/off runs of ``config_path`` under ``out_dir`` (and, with ``plain``, the
    plain vLLM replay of the off run) and write the bench files; with ``resume``, the runs that
    already finished there with the same config are kept."""
    from megatron_bubblespec.config import ConfigError, load_config
    from megatron_bubblespec.measure.plain_replay import check_replayable

    out, overrides = Path(out_dir), list(overrides)
    cfg = load_config(config_path, overrides)  # validates before any run starts
    if plain:
        try:
            check_replayable(cfg)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    started, t0 = datetime.datetime.now().astimezone(), time.perf_counter()
    runs, reused = _paired_runs(config_path, overrides, cfg.run.name, out, resume)
    on, off = runs["on"]["records"], runs["off"]["records"]
    series = {"on": list(on), "off": list(off)}
    dirs = {mode: str(out / f"{cfg.run.name}-{mode}") for mode in ("on", "off")}
    if plain:
        dirs["plain"] = str(out / f"{cfg.run.name}-plain")
        series["plain"] = _plain_records(cfg, out, resume and "off" in reused, reused)
    run_records = {mode: _read_run_record(Path(d)) for mode, d in dirs.items()}
    mismatch, mismatch_samples = token_mismatch(runs["on"]["rollouts"], runs["off"]["rollouts"])
    parted = parted_at_step(runs["on"]["rollouts"], runs["off"]["rollouts"])
    steady_from = steady_state_first_step(cfg)
    result = {
        "name": cfg.run.name,
        "config": str(config_path),
        "overrides": overrides,
        "runs": dirs,
        **compare(*(before_step(records, parted) for records in (on, off, series.get("plain", ()))),
                  steady_from),
        "steps": len(on),
        "token_mismatch": mismatch,
        "token_mismatch_samples": mismatch_samples,
        "parted_at_step": parted,
        "learner_parted_at_step": learner_parted_at_step(on, off),
        "machine": {**machine_info(), "started": started.isoformat(timespec="seconds"),
                    "wall_s": time.perf_counter() - t0, "reused": reused, "runs": run_records},
        "series": series,
    }
    _write_bench(out, result, steady_from)
    return result


def _paired_runs(config_path, overrides: list[str], name: str, out: Path,
                 resume: bool) -> tuple[dict, list[str]]:
    """The on and off runs (BubbleSpec on first), each trained unless ``resume`` finds it
    finished under ``out``; and the modes kept from an earlier bench."""
    from megatron_bubblespec.config import load_config
    from megatron_bubblespec.loop.train import train

    runs, reused = {}, []
    for mode, enabled in (("on", "true"), ("off", "false")):
        run_cfg = load_config(config_path, [*overrides, f"run.output_dir={out}",
                                            f"run.name={name}-{mode}", f"spec.enabled={enabled}"])
        runs[mode] = finished_run(run_cfg) if resume else None
        if runs[mode] is None:
            runs[mode] = _recorded(out / f"{name}-{mode}", lambda: train(run_cfg))
        else:
            reused.append(mode)
    return runs, reused


def _plain_records(cfg, out: Path, keep: bool, reused: list[str]) -> list[dict]:
    """The plain vLLM replay of the off run: kept from an earlier bench when ``keep`` and it
    finished (then "plain" joins ``reused``), else replayed now."""
    from megatron_bubblespec.loop.run_dir import RunDir
    from megatron_bubblespec.measure.plain_replay import replay_plain

    off, plain = out / f"{cfg.run.name}-off", out / f"{cfg.run.name}-plain"
    if keep:
        off_cfg = RunDir(off).read_config([f"run.output_dir={out}", f"run.name={plain.name}"])
        if (kept := finished_run(off_cfg, cfg.run.steps)) is not None:
            reused.append("plain")
            return kept["records"]
    return _recorded(plain, lambda: replay_plain(str(off), str(plain))).records


RUN_RECORD = "bench_run.json"   # in each run directory: when the run ran, and beside what load


def _recorded(run_dir: Path, work):
    """``work()``, with its start, end, wall time and the load average at its end written into
    ``run_dir/RUN_RECORD`` (the directory stays the run's own, copied or resumed)."""
    started, t0 = datetime.datetime.now().astimezone(), time.perf_counter()
    result = work()
    record = {"started": started.isoformat(timespec="seconds"),
              "ended": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "wall_s": time.perf_counter() - t0, "loadavg_1_5_15": load_average()}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_RECORD).write_text(json.dumps(record) + "\n")
    return result


def _read_run_record(run_dir: Path) -> dict | None:
    """A run's ``RUN_RECORD``; None for a run made before benches kept one."""
    path = run_dir / RUN_RECORD
    return json.loads(path.read_text()) if path.is_file() else None


def _write_bench(out: Path, result: dict, steady_from: int) -> None:
    """bench.json, bench.md, bench.png (the on run, the off run as baseline), bench_decode.png."""
    on, off = result["series"]["on"], result["series"]["off"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(to_json(result, indent=1) + "\n")
    (out / "bench.md").write_text(markdown(result))
    plot_run(on, out / "bench.png", baseline=off)
    plot_decode_breakdown(on, out / "bench_decode.png", baseline=off, steady_from=steady_from)


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
