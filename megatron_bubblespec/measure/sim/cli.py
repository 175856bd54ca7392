"""`bubblespec simulate`: bench.json (+ bench-engine JSONs, a config) -> calibration -> check at the
measured setting -> simulated grid of DP ranks x contexts -> tables, simulate.json/md/png.

The grid keeps the calibrated job's shape per rank (samples per rank, prompt length, draft budget
as a fraction of the response budget, acceptance, rank timing noise, drafting concurrency) and
changes the number of DP ranks and the context; a context of ``C`` tokens gives a response budget
of ``C - prompt`` tokens, and the fitted length model (a fraction of the budget) is scaled to it.
``--config`` takes samples per rank, draft budget fraction, draft chunk, drafts in flight,
continuation and prompt length from a training config instead; the ``--lengths``,
``--accept-prob``, ``--jitter``, ``--continuation-diverged`` and ``--max-draft-tokens`` flags
replace single fitted parts, to ask "what if". Every row carries the ceiling ``1 - acceptance x
coverage`` (``sim.ceiling``).

``--layouts`` (with ``--config`` and ``--gpu-memory-gb``) simulates every point once per rollout
layout of that config (``sim.layout``: one engine per replica, or engines on every GPU at each
rollout TP ``r`` vLLM can split the model over, or the ``--rollout-tp`` ones): the engines per
replica, their TP (engine time x ``(r0 / r) ^ --tp-alpha``) and their KV slots (``sim.memory``,
from the config's ``max_model_len`` and ``gpu_memory_utilization`` or
``--gpu-memory-utilization``). Without it the grid keeps the calibrated job's one engine per
replica at its own rollout TP, with no KV limit.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, replace
from typing import Sequence

import numpy as np

from megatron_bubblespec.config.schema import DRAFT_ORDERS

DEFAULT_RANKS = (8, 16, 32, 64, 128, 256, 512, 1024)
DEFAULT_CONTEXTS = (4096, 8192, 16384, 32768, 65536)


def _ints(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers: {text!r}")
    return values


def _lengths(text: str):
    """``calibrated`` | ``empirical`` | ``lognormal:MEDIAN,SIGMA`` (MEDIAN as a fraction of the
    budget); the first two are resolved against the calibration (``length_model``)."""
    from megatron_bubblespec.measure.sim.model import LengthModel

    if text in ("calibrated", "empirical"):
        return text
    kind, _, params = text.partition(":")
    try:
        median, sigma = (float(x) for x in params.split(","))
        if kind != "lognormal" or median <= 0:
            raise ValueError
        return LengthModel("lognormal", mu=float(np.log(median)), sigma=sigma)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--lengths {text!r}: use 'calibrated', 'empirical' or 'lognormal:MEDIAN,SIGMA' with "
            "MEDIAN the median response as a fraction of the budget, e.g. lognormal:0.2,0.8"
        ) from None


def length_model(cal, choice):
    """The grid's length model: the fitted lognormal (``calibrated``), the measured fractions of
    the budget resampled (``empirical``), or a given ``LengthModel``."""
    from megatron_bubblespec.measure.sim.model import LengthModel

    if choice == "calibrated":
        return cal.lengths
    if choice == "empirical":
        if cal.measured_lengths is None:
            raise ValueError("--lengths empirical needs the bench runs' rollouts.jsonl next to "
                             "bench.json (per-sample lengths); use calibrated or lognormal:M,S")
        fractions = cal.measured_lengths.reshape(-1) / cal.setting.max_new_tokens
        return LengthModel("empirical", fractions=tuple(float(x) for x in fractions))
    return choice


def _layouts(text: str) -> list[str]:
    from megatron_bubblespec.measure.sim.layout import LAYOUTS

    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names or any(n not in LAYOUTS for n in names):
        raise argparse.ArgumentTypeError(f"--layouts {text!r}: comma-separated names from "
                                         f"{', '.join(LAYOUTS)}")
    return names


def _jitter(text: str) -> float | None:
    if text == "calibrated":
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0:
        raise argparse.ArgumentTypeError(f"--jitter {text!r}: 'calibrated' or a log-sd >= 0")
    return value


def config_shape(path):
    """A training config's values (schema defaults <- the YAML file) without the checks of
    ``load_config`` that only this machine's hardware fails (a bf16 GPU layout read on a CPU):
    the simulator takes only the job's shape from it."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from megatron_bubblespec.config import ConfigError
    from megatron_bubblespec.config.schema import Config

    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(path))
        return OmegaConf.to_object(merged)
    except (OSError, OmegaConfBaseException, yaml.YAMLError) as err:
        raise ConfigError(f"--config {path}: {' '.join(str(err).split())}") from None


def grid_setting(cal, args):
    """The per-rank shape of the predicted job: calibrated, then --config, then single flags."""
    from megatron_bubblespec.measure.sim.calibrate import prompt_length

    setting = cal.setting
    if cal.grid_accept_prob is not None:
        setting = replace(setting, accept_prob=cal.grid_accept_prob)
    budget_frac = cal.draft_budget_frac
    if args.config:
        cfg = config_shape(args.config)
        r = cfg.rollout
        setting = replace(setting, samples_per_rank=max(
            r.prompts_per_step * r.samples_per_prompt // cfg.parallel.data, 1),
            draft_chunk=cfg.spec.draft_chunk, draft_concurrency=cfg.spec.draft_in_flight,
            draft_prefill_tokens=cfg.spec.draft_prefill_tokens,
            draft_horizon=cfg.spec.draft_horizon, draft_order=cfg.ablation.draft_order,
            continuation_k=cfg.spec.spec_k if cfg.ablation.speculative_continuation else 0)
        budget_frac = min(cfg.spec.max_draft_tokens, r.max_new_tokens) / r.max_new_tokens
        prompt = prompt_length(cfg) if args.prompt_len is None else None
        if prompt is not None:
            setting = replace(setting, prompt_len=prompt)
    changes = {}
    if args.samples_per_rank:
        changes["samples_per_rank"] = args.samples_per_rank
    if args.prompt_len is not None:
        changes["prompt_len"] = args.prompt_len
    if args.accept_prob is not None:
        changes["accept_prob"] = args.accept_prob
    if args.draft_horizon is not None:
        changes["draft_horizon"] = args.draft_horizon
    if args.draft_order is not None:
        changes["draft_order"] = args.draft_order
    if args.jitter is not None:
        changes["jitter"] = args.jitter
    if args.tp_alpha is not None:
        changes["tp_alpha"] = args.tp_alpha
    if args.continuation_diverged != "calibrated":
        changes["continuation_gain_diverged"] = (None if args.continuation_diverged == "realigned"
                                                 else args.continuation_diverged)
    return replace(setting, **changes), budget_frac


def _continuation(text: str):
    if text in ("calibrated", "realigned"):
        return text
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0:
        raise argparse.ArgumentTypeError(f"--continuation-diverged {text!r}: 'calibrated', "
                                         "'realigned' or accepted tokens per decode step >= 0")
    return value


def predict(cal, setting, budget_frac: float, lengths, ranks: Sequence[int],
            contexts: Sequence[int], *, steps: int, seeds: int, max_draft_tokens: int | None,
            seed: int = 0, layouts: Sequence | None = None) -> list[dict]:
    """One row per (layout, context, ranks): the mean over ``seeds`` of ``simulate``'s summary,
    with the ceiling ``1 - acceptance x coverage`` (``sim.ceiling``) of the point's decode-step
    ratio. ``layouts`` (``sim.layout.EngineLayout``s) set the engines per replica, their TP and
    KV slots; None keeps ``setting``'s."""
    from megatron_bubblespec.measure.sim.ceiling import decode_steps_ratio_ceiling
    from megatron_bubblespec.measure.sim.model import simulate

    rows = []
    for layout in layouts or [None]:
        shaped, facts = setting, {}
        if layout is not None:
            shaped = replace(setting, engines_per_replica=layout.engines_per_replica,
                             engine_tp=layout.engine_tp, kv_slots=layout.kv_slots)
            facts = {"layout": layout.name, "engine_tp": layout.engine_tp,
                     "engines_per_replica": layout.engines_per_replica,
                     "kv_slots": layout.kv_slots,
                     "samples_per_engine": layout.samples_per_engine(setting.samples_per_rank),
                     "waves": layout.waves(setting.samples_per_rank),
                     "kv_tokens": layout.capacity.tokens}
        for context in contexts:
            budget = context - setting.prompt_len
            if budget < 2:
                raise ValueError(f"context {context} leaves no response budget after a prompt of "
                                 f"{setting.prompt_len} tokens")
            draft = (max_draft_tokens if max_draft_tokens is not None
                     else round(budget_frac * budget))
            for r in ranks:
                point = replace(shaped, ranks=r, max_new_tokens=budget,
                                max_draft_tokens=min(draft, budget))
                runs = [simulate(point, cal.costs, lengths, steps=steps, seed=seed + i)
                        for i in range(seeds)]
                row = {"ranks": r, "context": context, "response_budget": budget,
                       "max_draft_tokens": point.max_draft_tokens, **facts}
                for key, value in runs[0].items():
                    if key not in ("trace", "steps", "engines"):
                        row[key] = float(np.nanmean([run[key] for run in runs]))
                row["engines"] = runs[0]["engines"]
                if layout is not None:
                    row["kv_demand"] = row["engine_tokens_max"] / layout.capacity.tokens
                row["decode_steps_ratio_ceiling"] = decode_steps_ratio_ceiling(
                    point.accept_prob, row["draft_coverage"])
                rows.append(row)
    return rows


def grid_layouts(args) -> tuple[list, list[str], str | None]:
    """``--layouts`` of ``--config`` on GPUs of ``--gpu-memory-gb``: the layouts, the notes on
    those left out, and the model's name (all empty without ``--layouts``)."""
    from megatron_bubblespec.measure.sim.layout import rollout_layouts

    if not args.layouts:
        return [], [], None
    if not args.config or args.gpu_memory_gb is None:
        raise ValueError("--layouts needs --config (the training layout and model) and "
                         "--gpu-memory-gb (the memory of one GPU)")
    cfg = config_shape(args.config)
    overhead = None if args.engine_overhead_gb is None else args.engine_overhead_gb * 1e9
    layouts, notes = rollout_layouts(cfg, args.layouts, gpu_bytes=args.gpu_memory_gb * 1e9,
                                     gpu_memory_utilization=args.gpu_memory_utilization,
                                     engine_tps=args.rollout_tp, overhead_bytes=overhead)
    if not layouts:
        raise ValueError("no layout fits: " + "; ".join(notes))
    return layouts, notes, cfg.model.path


def run_simulation(args) -> dict:
    from megatron_bubblespec.measure.sim.calibrate import calibrate, calibration_check

    cal = calibrate(args.bench, args.engine or (), prompt_len=args.prompt_len)
    check = calibration_check(cal, replicates=args.check_replicates, seed=args.seed)
    setting, budget_frac = grid_setting(cal, args)
    lengths = length_model(cal, args.lengths)
    layouts, layout_notes, model = grid_layouts(args)
    predictions = predict(cal, setting, budget_frac, lengths, args.ranks, args.contexts,
                          steps=args.steps, seeds=args.seeds,
                          max_draft_tokens=args.max_draft_tokens, seed=args.seed,
                          layouts=layouts)
    draft = (str(args.max_draft_tokens) if args.max_draft_tokens is not None
             else f"{budget_frac:.0%} of the response budget")
    return {
        "calibration": {"setting": asdict(cal.setting), "costs": asdict(cal.costs),
                        "lengths": asdict(cal.lengths) | {"description": cal.lengths.describe()},
                        "measured": cal.measured, "source": cal.source, "notes": cal.notes},
        "check": check,
        "grid": {"setting": asdict(setting), "lengths": lengths.describe(),
                 "draft_budget": draft, "steps": args.steps, "seeds": args.seeds,
                 "ranks": list(args.ranks), "contexts": list(args.contexts),
                 "layouts": [asdict(layout) | {"kv_slots": layout.kv_slots} for layout in layouts],
                 "layout_notes": layout_notes, "model": model,
                 "gpu_memory_gb": args.gpu_memory_gb},
        "predictions": predictions,
    }


def add_simulate_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``simulate`` on a ``parser.add_subparsers()`` object."""
    parser = subparsers.add_parser("simulate", help=cmd_simulate.__doc__,
                                   description=cmd_simulate.__doc__)
    parser.add_argument("--bench", required=True, help="bench.json of `bubblespec bench --out DIR`")
    parser.add_argument("--engine", action="append", default=[],
                        help="JSON of `bubblespec bench-engine --out FILE` (repeatable: two "
                        "prompt lengths fit the attention cost)")
    parser.add_argument("--ranks", type=_ints, default=list(DEFAULT_RANKS),
                        help="DP rank counts, comma-separated")
    parser.add_argument("--contexts", type=_ints, default=list(DEFAULT_CONTEXTS),
                        help="contexts (prompt + response budget) in tokens, comma-separated")
    parser.add_argument("--config", help="training config (configs/*.yaml) for samples per rank, "
                        "draft budget and chunk, prompt length")
    parser.add_argument("--out", help="write simulate.json, simulate.md, simulate.png here")
    parser.add_argument("--lengths", type=_lengths, default="calibrated",
                        help="calibrated (fitted lognormal, default) | empirical (the measured "
                        "responses, as fractions of the budget) | lognormal:MEDIAN,SIGMA, MEDIAN "
                        "as a fraction of the response budget")
    parser.add_argument("--accept-prob", type=float, default=None,
                        help="per-token draft acceptance (default: fitted)")
    parser.add_argument("--jitter", type=_jitter, default=None,
                        help="rank timing noise, log-sd (default: calibrated; 0 = lengths only)")
    parser.add_argument("--continuation-diverged", type=_continuation, default="calibrated",
                        help="continuation after a divergence: calibrated (the bench's accepted "
                        "tokens per decode step) | realigned (proposals re-aligned with the draft, "
                        "each accepted with the per-token acceptance: optimistic) | a number of "
                        "accepted tokens per decode step")
    parser.add_argument("--max-draft-tokens", type=int, default=None,
                        help="draft budget in tokens (default: the calibrated fraction of the "
                        "response budget)")
    parser.add_argument("--draft-horizon", type=int, default=None,
                        help="steps a bubble drafts ahead (spec.draft_horizon; default: the "
                             "calibrated job's, or --config's)")
    parser.add_argument("--draft-order", choices=DRAFT_ORDERS, default=None,
                        help="which samples a bubble drafts first (ablation.draft_order; default: "
                             "the calibrated job's, or --config's)")
    _add_layout_arguments(parser)
    parser.add_argument("--samples-per-rank", type=int, default=None)
    parser.add_argument("--prompt-len", type=int, default=None,
                        help="prompt tokens (default: measured from the bench config's task)")
    parser.add_argument("--steps", type=int, default=12, help="simulated steps per point")
    parser.add_argument("--seeds", type=int, default=2, help="seeds averaged per point")
    parser.add_argument("--check-replicates", type=int, default=32,
                        help="seeds averaged in the calibration check")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=cmd_simulate)
    return parser


def _add_layout_arguments(parser: argparse.ArgumentParser) -> None:
    """``simulate``'s rollout layout options: layouts, their TPs, GPU memory, TP scaling."""
    parser.add_argument("--layouts", type=_layouts, default=None,
                        help="comma-separated rollout layouts of --config to simulate: "
                        "one-per-replica (one engine per replica at rollout TP = TP, on the first "
                        "stage) | every-gpu (engines on every GPU, at each rollout TP that divides "
                        "TP x CP, or --rollout-tp)")
    parser.add_argument("--rollout-tp", type=_ints, default=None,
                        help="rollout TPs of the every-gpu layout, comma-separated (default: "
                        "every divisor of TP x CP that vLLM can split the model's heads over)")
    parser.add_argument("--gpu-memory-gb", type=float, default=None,
                        help="memory of one GPU in GB (1e9 bytes), for the KV cache arithmetic")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="share of a GPU each engine takes (default: the config's "
                        "rollout.gpu_memory_utilization)")
    parser.add_argument("--engine-overhead-gb", type=float, default=None,
                        help="engine memory per GPU besides weights and KV cache (default: 3 GB "
                        "for Qwen2.5-7B, 4 GB otherwise: the configs' estimates)")
    parser.add_argument("--tp-alpha", type=float, default=None,
                        help="an engine of r GPUs takes (r0 / r) ^ alpha of the measured rollout "
                        "TP r0's time (default 1: ideal scaling; not measured)")


def cmd_simulate(args) -> int:
    """Predict bubble ratio and BubbleSpec speedup at scale from bench measurements (simulated)."""
    from megatron_bubblespec.config import ConfigError
    from megatron_bubblespec.measure.sim.calibrate import CalibrationError
    from megatron_bubblespec.measure.sim.report import print_result, write

    if args.accept_prob is not None and not 0.0 <= args.accept_prob <= 1.0:
        print(f"bubblespec simulate: --accept-prob {args.accept_prob} is not in [0, 1]",
              file=sys.stderr)
        return 2
    if args.tp_alpha is not None and args.tp_alpha < 0:
        print(f"bubblespec simulate: --tp-alpha {args.tp_alpha} is negative", file=sys.stderr)
        return 2
    try:
        result = run_simulation(args)
    except (CalibrationError, ConfigError, ValueError) as err:
        print(f"bubblespec simulate: {err}", file=sys.stderr)
        return 2
    print_result(result)
    if args.out:
        paths = write(result, args.out)
        print("simulation files: " + ", ".join(str(p) for p in paths))
    return 0
