"""Study variants (override sets) -> paired BubbleSpec on / off runs, one off run per distinct
baseline -> per-variant summaries -> <out>/<study>/results.json; the command line every study takes.

A variant's overrides apply to its on run (``spec.enabled=true``). Its off run is the same config
with ``spec.enabled=false`` and the variant's ``spec.*`` overrides left out: with BubbleSpec off no
spec key reaches the rollout, so variants that differ only in spec keys (draft budget, staleness,
verification rule, continuation) share one off run, while variants that change the run itself
(learning rate, DP size, length cap, task, engine) get their own. The comparison is the package's:
``measure.bench.compare`` (decode-step, time, bubble and acceptance ratios, lr, policy drift) and
``measure.bench.token_mismatch`` (tokens that differ from the off run; 0 for an exact rule).

Every run writes its run directory (metrics.jsonl, rollouts.jsonl, config.yaml) and its console log
under <out>/<study>/runs/. An off run that any study under the same <out> already finished with
the same run config (``measure.bench.finished_run``: spec keys and observers aside) is reused, not
run again: the studies of one seed share one plain run. Tables and plots of the result: ``report``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from megatron_bubblespec.config import ConfigError, load_config
from megatron_bubblespec.distributed.launch import forward_signals
from megatron_bubblespec.measure.bench import (compare, compare_steps, finished_run,
                                             steady_state_first_step, token_mismatch)
from megatron_bubblespec.loop.heartbeat import EXIT_PREEMPTED
from megatron_bubblespec.loop.run_dir import CONFIG_FILE
from megatron_bubblespec.machine import load_average, machine_info
from megatron_bubblespec.metrics import to_json
from megatron_bubblespec.metrics.formatting import value
from megatron_bubblespec.metrics.reduce import mean_of, pooled_ratio

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
# Every run of a study: no live display, no TensorBoard, no per-run PNG (the study draws its own).
QUIET = ("logging.progress=false", "logging.tensorboard=false", "logging.plot=false")


@dataclass
class Variant:
    """One point of a study's grid: a label for tables and plots, and its dotted overrides."""

    label: str
    overrides: list[str] = field(default_factory=list)
    group: str = ""  # the variant it repeats with another seed (--seeds); "" = itself

    @property
    def off_overrides(self) -> list[str]:
        """The overrides of this variant's off run: the same, without the spec.* keys."""
        return [o for o in self.overrides if not o.startswith("spec.")]


# The learning regime of the studies, per model.path: a learning rate at which the reward really
# improves, the steps a reward curve needs to show it (``curve_steps``) and the steps of a grid
# study (``grid_steps``: enough for the drift to settle after the first large updates and for the
# timing-dependent drafting to average out). configs/tiny.yaml, measured without BubbleSpec: lr 3e-3
# lifts the mean reward of the synthetic task from 0.03 (steps 0-9) to 0.32 (steps 50-59), drift
# KL about 1e-1 per step over the first 4 steps and 1e-2 later; its own lr 1e-4 leaves the reward
# flat (and every draft accepted); 1e-2 collapses to max-length responses. Models without an
# entry use their config's train.lr and run.steps.
LEARNING = {"tiny": {"lr": 3e-3, "curve_steps": 60, "grid_steps": 12}}


def parser(doc: str) -> argparse.ArgumentParser:
    """The flags every study takes; a study adds its own grid flags to it."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.relpath(TINY),
                   help="YAML config (default configs/tiny.yaml; configs/default.yaml = SmolLM2)")
    p.add_argument("--out", default="results/ablations",
                   help="results root; the study writes under <out>/<study>/ (default %(default)s)")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default: "
                   "the study's, else the config's run.steps)")
    p.add_argument("--lr", type=float, default=None, help="learning rate of every run "
                   "(default: the model's entry in LEARNING, else the config's train.lr)")
    p.add_argument("--seeds", type=csv(int), default=None,
                   help="repeat every variant with each of these run.seed values (each seed with "
                        "its own off run); table.md then adds the mean over seeds")
    p.add_argument("--resume", action="store_true",
                   help="keep the variants an interrupted run of the study finished (by label, "
                        "from its results.json and run directories) and run the rest; its runs "
                        "outside this grid (other --seeds) stay in the table")
    p.add_argument("--render-only", action="store_true",
                   help="start no run: redraw table.md and plot.png from the study's results.json")
    p.add_argument("--dry-run", action="store_true",
                   help="validate every run's config and list the runs, start none")
    p.add_argument("overrides", nargs="*",
                   help="dotted overrides for every run, e.g. rollout.prompts_per_step=8")
    return p


def csv(kind):
    """argparse type: 'a,b,c' -> [kind(a), kind(b), kind(c)]."""
    def parse(text: str) -> list:
        return [kind(x) for x in text.split(",") if x]
    return parse


def learning_defaults(args, curve: bool = False, min_steps: int = 1, lr: bool = True) -> None:
    """Fill in what the user left out from LEARNING for the config's model: --lr (unless ``lr`` is
    False: the study sweeps it) and --steps (``curve_steps`` for a study of reward curves, else
    ``grid_steps``; the config's run.steps for other models), at least ``min_steps``."""
    cfg = load(args.config, list(args.overrides))
    recipe = LEARNING.get(cfg.model.path, {})
    if lr and args.lr is None and "train.lr" not in _keys(args.overrides):
        args.lr = recipe.get("lr")
    if args.steps is None and "run.steps" not in _keys(args.overrides):
        steps = recipe.get("curve_steps" if curve else "grid_steps", cfg.run.steps)
        args.steps = max(steps, min_steps)


def _keys(overrides: Sequence[str]) -> set[str]:
    return {o.split("=", 1)[0] for o in overrides}


def base_overrides(args) -> list[str]:
    """Overrides shared by all runs of a study: quiet logging, --steps, --lr, then the user's."""
    out = list(QUIET)
    if args.steps is not None:
        out.append(f"run.steps={args.steps}")
    if args.lr is not None:
        out.append(f"train.lr={args.lr}")
    return out + list(args.overrides)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", text).strip("_") or "run"


def load(config: str, overrides: Sequence[str]):
    """The validated Config of ``config`` + ``overrides``; a config error ends the script."""
    try:
        return load_config(config, list(overrides))
    except ConfigError as err:
        raise SystemExit(f"config error ({' '.join(overrides) or 'no overrides'}): {err}")


def _rounded(load: list[float] | None) -> list[float] | None:
    return [round(x, 2) for x in load] if load else None


def train_run(config: str, overrides: Sequence[str], runs_dir: Path, name: str) -> dict:
    """One training run, ``bubblespec train`` in a process of its own (its console and its ranks'
    to runs_dir/name.log) -> records, rollouts, timing. A process per run, not ``train()`` here:
    the ranks start from their launcher's fork server and write to the files it was started with,
    so in one process every run's console would go to the first run's log; and every run pays the
    same start-up. Preemption signals sent to the study reach the run (it checkpoints and stops)
    and stop the study: rerun it with --resume."""
    run = [f"run.output_dir={runs_dir}", f"run.name={name}"]
    cfg = load(config, [*overrides, *run])
    runs_dir.mkdir(parents=True, exist_ok=True)
    print(f"  run {name}: {' '.join(o for o in overrides if o not in QUIET)}", flush=True)
    load_before, t0 = _rounded(load_average()), time.perf_counter()
    log_path = runs_dir / f"{name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "megatron_bubblespec.cli", "train",
                                 "--config", config, *overrides, *run],
                                stdout=log, stderr=subprocess.STDOUT)
        previous = forward_signals([proc.pid])
        try:
            code = proc.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    wall = time.perf_counter() - t0
    if code == EXIT_PREEMPTED or code < 0 or code > 128:
        raise SystemExit(f"{name}: stopped by a signal (exit code {code}; log: {log_path}); "
                         "the finished runs are in results.json: rerun the study with --resume")
    if code != 0:
        said = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
        raise RuntimeError(f"exit code {code}: {said[-1] if said else 'no output'}")
    found = finished_run(cfg)
    if found is None:
        raise RuntimeError(f"the run ended without the records of all {cfg.run.steps} steps")
    timing = {"wall_s": wall, "loadavg_before": load_before,
              "loadavg_after": _rounded(load_average())}
    print(f"    {wall:.0f} s (load average before {load_before}, after {timing['loadavg_after']})",
          flush=True)
    (runs_dir / f"{name}.timing.json").write_text(json.dumps(timing) + "\n")
    return {"name": name, "dir": str(runs_dir / name), **found, **timing,
            "lr_config": cfg.train.lr, "steps": cfg.run.steps}


def reusable_off_run(out: Path, config: str, overrides: Sequence[str]) -> dict | None:
    """An off run that a study under ``out`` already finished with this run config (the off
    run's ``overrides``), as :func:`train_run` returns it; None when there is none."""
    for saved in sorted(out.glob(f"*/runs/*/{CONFIG_FILE}")):
        run = saved.parent
        cfg = load(config, [*overrides, f"run.output_dir={run.parent}", f"run.name={run.name}"])
        found = finished_run(cfg)
        if found is None:
            continue
        timing_file = run.parent / f"{run.name}.timing.json"
        timing = (json.loads(timing_file.read_text()) if timing_file.is_file()
                  else _timing_from_results(run))
        return {"name": run.name, "dir": str(run), **found, **timing,
                "lr_config": cfg.train.lr, "steps": cfg.run.steps}
    return None


def _timing_from_results(run: Path) -> dict:
    """Wall time and load averages of an off run from its study's results.json (runs written
    before the timing file existed); unknown ones are NaN / None."""
    results = run.parent.parent / "results.json"
    summaries = json.loads(results.read_text())["runs"] if results.is_file() else []
    for s in summaries:
        if Path(s["run_off"]) == run:
            return {"wall_s": s["wall_off_s"], "loadavg_before": s["loadavg_off"][0],
                    "loadavg_after": s["loadavg_off"][1]}
    return {"wall_s": math.nan, "loadavg_before": None, "loadavg_after": None}


def reward_ends(records: Sequence[Mapping]) -> tuple[float, float]:
    """Mean reward over the first and over the last quarter of the steps (at least one step)."""
    k = max(1, len(records) // 4)
    return mean_of(records[:k], "train/reward_mean"), mean_of(records[-k:], "train/reward_mean")


def summarize(variant: Variant, on: dict, off: dict, steady_from: int) -> dict:
    """The variant's numbers: the package's on/off comparison (also over the steady state, the
    steps >= ``steady_from``) plus token mismatch, reward ends, run times. ``lr`` falls back to
    the configured one when the runs did not log it."""
    result = compare(on["records"], off["records"])
    if math.isnan(result["lr"]):
        result["lr"] = on["lr_config"]
    mismatch, mismatch_samples = token_mismatch(on["rollouts"], off["rollouts"])
    return with_series_numbers({
        "label": variant.label,
        "group": variant.group or variant.label,
        "overrides": variant.overrides,
        "off_overrides": variant.off_overrides,
        "run_on": on["dir"],
        "run_off": off["dir"],
        **result,
        "token_mismatch": mismatch,
        "token_mismatch_samples": mismatch_samples,
        "wall_on_s": on["wall_s"], "wall_off_s": off["wall_s"],
        "loadavg_on": [on["loadavg_before"], on["loadavg_after"]],
        "loadavg_off": [off["loadavg_before"], off["loadavg_after"]],
        "series": {"on": list(on["records"]), "off": list(off["records"])},
    }, steady_from)


def with_series_numbers(summary: dict, steady_from: int | None = None) -> dict:
    """Add the numbers computed from the per-step series: reward of the first / last quarter of
    the steps (on and off), and ``decode_steps_saved_frac`` = 1 - the on run's decode steps / the
    plain decode steps of its own responses over steps >= 1, the saving a run made on its own
    tokens (it equals 1 - decode_steps_ratio when the rule is exact; an inexact rule's responses
    differ from the off run's, so only this one compares). With ``steady_from`` (or the one the
    summary holds), the comparison over the steps >= it as ``steady_state``, as
    ``bubblespec bench`` reports it."""
    on, off = summary["series"]["on"], summary["series"]["off"]
    steady_from = summary.get("steady_from", steady_from)
    if steady_from is not None:
        summary["steady_from"] = steady_from
        summary["steady_state"] = compare_steps(on, off, (), steady_from)
    summary["reward_first_on"], summary["reward_last_on"] = reward_ends(on)
    summary["reward_first_off"], summary["reward_last_off"] = reward_ends(off)
    on1 = [r for r in on if value(r, "step") >= 1]
    summary["decode_steps_saved_frac"] = 1.0 - pooled_ratio(on1, "rollout/decode_steps",
                                                            "rollout/decode_steps_plain")
    return summary


def run_study(study: str, args, variants: Sequence[Variant]) -> dict:
    """Run every variant's on run and the distinct off runs; return the study's result (also
    written to <out>/<study>/results.json after each variant, so a long study can be watched)."""
    out = Path(args.out) / study
    runs_dir = out / "runs"
    base = base_overrides(args)
    if args.seeds:
        variants = [Variant(f"{v.label}, seed {seed}", [*v.overrides, f"run.seed={seed}"],
                            v.label) for v in variants for seed in args.seeds]
    steady_from = {}  # label -> the variant's first steady-state step
    for v in variants:  # validate everything before the first run starts
        steady_from[v.label] = _steady_from(args, base, v.overrides)
        load(args.config, [*base, *v.off_overrides, "spec.enabled=false"])
    if args.render_only:
        path = out / "results.json"
        if not path.is_file():
            raise SystemExit(f"--render-only: {path} does not exist; run the study first")
        result = json.loads(path.read_text())
        result["out"] = str(out)  # redrawn where asked, also from a copy of the study's folder
        result["runs"] = [with_series_numbers(s, _steady_from(args, base, s["overrides"]))
                          for s in result["runs"]]
        return result
    if args.dry_run:
        offs = list(dict.fromkeys(tuple(v.off_overrides) for v in variants))
        print(f"{study}: base {' '.join(base)}")
        for key in offs:
            print(f"  off: {' '.join(key) or '(base)'}")
        for v in variants:
            print(f"  on {v.label!r}: {' '.join(v.overrides) or '(base)'} "
                  f"(off run {offs.index(tuple(v.off_overrides))})")
        raise SystemExit(0)
    started, t0 = datetime.datetime.now().astimezone(), time.perf_counter()
    result = {"study": study, "out": str(out), "config": args.config, "base_overrides": base,
              "variants": [{"label": v.label, "overrides": v.overrides} for v in variants],
              "runs": []}
    offs: dict[tuple[str, ...], dict] = {}
    broken: dict[tuple[str, ...], RunFailed] = {}  # off runs that failed: not tried twice
    # --resume: the runs kept from the study's last results.json are in it from the start, so
    # stopping this study part-way never drops them; new runs take their places in variant order,
    # and kept runs outside this grid (another --seeds list, another grid point) follow them
    done = finished_runs(out / "results.json", base) if args.resume else {}
    summaries = {v.label: with_series_numbers(done[v.label], steady_from[v.label])
                 for v in variants if v.label in done}
    beyond = [with_series_numbers(s, _steady_from(args, base, s["overrides"]))
              for label, s in done.items() if label not in steady_from]
    result["runs"] = [*summaries.values(), *beyond]
    print(f"{study}: {len(variants)} variants, {len({tuple(v.off_overrides) for v in variants})} "
          f"off run(s), config {args.config}; logs under {runs_dir}", flush=True)
    for s in beyond:
        print(f"  {s['label']}: kept from the previous run of the study (not in this grid)",
              flush=True)
    result["failed"] = []
    for i, v in enumerate(variants):
        key = tuple(v.off_overrides)
        if v.label in summaries:
            print(f"  {v.label}: kept from the previous run of the study", flush=True)
            continue
        try:
            if key in broken:
                raise broken[key]
            off_overrides = [*base, *key, "spec.enabled=false"]
            if key not in offs:
                if (reused := reusable_off_run(Path(args.out), args.config, off_overrides)):
                    print(f"  off run: reusing {reused['dir']}", flush=True)
                    offs[key] = reused
            if key not in offs:
                try:
                    name = f"off-{len(offs) + len(broken)}-{_slug(v.label)}"
                    offs[key] = _attempt(args.config, off_overrides, runs_dir, name)
                except RunFailed as err:
                    broken[key] = err
                    raise
            on = _attempt(args.config, [*base, *v.overrides, "spec.enabled=true"], runs_dir,
                          f"on-{i}-{_slug(v.label)}")
            summaries[v.label] = summarize(v, on, offs[key], steady_from[v.label])
        except RunFailed as err:
            result["failed"].append({"label": v.label, "overrides": v.overrides, "run": err.run,
                                     "error": err.message, "log": err.log})
        result["runs"] = [*(summaries[u.label] for u in variants if u.label in summaries),
                          *beyond]
        result["machine"] = {**machine_info(), "started": started.isoformat(timespec="seconds"),
                             "wall_s": time.perf_counter() - t0}
        write_json(out / "results.json", result)
    if not result["runs"]:
        raise SystemExit(f"{study}: every run failed; see the logs under {runs_dir}")
    return result


def _steady_from(args, base: Sequence[str], overrides: Sequence[str]) -> int:
    """The first steady-state step of the on run with these overrides (validates its config)."""
    return steady_state_first_step(load(args.config, [*base, *overrides, "spec.enabled=true"]))


def finished_runs(path: Path, base: Sequence[str]) -> dict[str, dict]:
    """--resume: label -> summary of the variants ``path`` (a results.json) holds (their off runs
    are found again by :func:`reusable_off_run`); none when that study ran with other base
    overrides (--steps, --lr, dotted overrides): its runs are not this grid's points."""
    if not path.is_file():
        return {}
    previous = json.loads(path.read_text())
    if previous["base_overrides"] != list(base):
        print(f"--resume: {path} ran with {' '.join(previous['base_overrides']) or '(none)'}, "
              f"not {' '.join(base) or '(none)'}; none of its runs is kept (it is rewritten as "
              "this study runs)", flush=True)
        return {}
    return {s["label"]: s for s in previous["runs"]}


class RunFailed(Exception):
    def __init__(self, run: str, message: str, log: str):
        super().__init__(f"{run}: {message}")
        self.run, self.message, self.log = run, message, log


def _attempt(config: str, overrides: Sequence[str], runs_dir: Path, name: str) -> dict:
    """``train_run(...)``, or RunFailed with the error's last line: one failed variant (or its off
    run) does not stop the study; its variants are listed as failed in the table."""
    try:
        return train_run(config, overrides, runs_dir, name)
    except Exception as err:  # a failed run: its exit code and its log's last line
        lines = [line for line in str(err).strip().splitlines() if line.strip()]
        message = lines[-1] if lines else type(err).__name__
        print(f"    FAILED: {message} (log: {runs_dir / name}.log)", flush=True)
        with open(runs_dir / f"{name}.log", "a") as log:
            log.write(f"\n{err}\n")
        raise RunFailed(name, message, str(runs_dir / f"{name}.log")) from None


def write_json(path: Path, result: Mapping) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_json(result, indent=1) + "\n")
