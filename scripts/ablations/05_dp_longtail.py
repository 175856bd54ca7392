"""Study 5: data-parallel size and long-tail severity. The bubble a fast rank can use grows with the
number of DP ranks waiting for the slowest one and with the spread of response lengths (the length
cap rollout.max_new_tokens bounds the tail; the task mix sets its shape). Each setting changes the
plain run too, so each has its own off run; drafts may cover the whole cap
(spec.max_draft_tokens = rollout.max_new_tokens). The table gives the off run's bubble ratio and the
decode steps saved per setting.

A DP size keeps the prompts per rank of the config (rollout.prompts_per_step scales with
parallel.data), so every rank rolls out as many samples as in the base setting.
--no-base leaves out the config's own setting (when another study already ran it).

parallel.data = parallel.world_size / (tensor x pipeline) ranks; 4 ranks on 2 CPU cores are slow,
keep --steps small there. The chat tasks (data.task=arithmetic: short word problems, gsm8k: longer
reasoning) need a tokenizer: mix them with --config configs/default.yaml (SmolLM2) --tasks
arithmetic,gsm8k; the tiny random model only has the synthetic task.

    python scripts/ablations/05_dp_longtail.py [--config configs/tiny.yaml] [--steps N]
        [--dp 2,4] [--max-new-tokens 16,48,96] [--tasks arithmetic,gsm8k] [--full-grid]
        [--no-base] [dotted overrides...]
"""

from __future__ import annotations

import itertools

import report
import runner
from megatron_bubblespec.metrics.formatting import percent

STUDY = "05_dp_longtail"
TITLE = "DP size and long-tail severity"
COLUMNS = (*report.BUBBLE, report.Column("bubble (on run)", "bubble_ratio_on", percent),
           *report.SPEED, *report.STEADY, *report.ACCEPT, *report.EXACT, *report.TRAINING)


def main(argv=None) -> None:
    p = runner.parser(__doc__)
    p.add_argument("--dp", type=runner.csv(int), default=[2, 4],
                   help="DP sizes (default %(default)s)")
    p.add_argument("--max-new-tokens", type=runner.csv(int), default=[16, 48, 96],
                   help="length caps, rollout.max_new_tokens (default %(default)s)")
    p.add_argument("--tasks", type=runner.csv(str), default=None,
                   help="data.task values (default: the config's task)")
    p.add_argument("--full-grid", action="store_true", help="every (dp, cap, task) triple "
                   "instead of one factor at a time around the config's values")
    p.add_argument("--no-base", action="store_true", help="leave out the config's own "
                   "(dp, cap, task) point (one factor at a time only)")
    args = p.parse_args(argv)
    runner.learning_defaults(args)
    cfg = runner.load(args.config, runner.base_overrides(args))
    tasks = args.tasks or [cfg.data.task]
    if cfg.model.path == "tiny" and set(tasks) != {"synthetic"}:
        raise SystemExit(f"--tasks {','.join(tasks)}: the tiny random model has no tokenizer, "
                         "only data.task=synthetic runs on it; use --config configs/default.yaml "
                         "for the chat tasks")
    base = (cfg.parallel.data, cfg.rollout.max_new_tokens, cfg.data.task)
    if args.full_grid:
        points = list(itertools.product(args.dp, args.max_new_tokens, tasks))
    else:
        points = [base] + [(d, base[1], base[2]) for d in args.dp]
        points += [(base[0], n, base[2]) for n in args.max_new_tokens]
        points += [(base[0], base[1], t) for t in tasks]
        if args.no_base:
            points = [x for x in points if x != base]
    per_rank = cfg.rollout.prompts_per_step // cfg.parallel.data
    model_parallel = cfg.parallel.tensor * cfg.parallel.pipeline * cfg.parallel.context
    variants = [runner.Variant(f"dp {d}, cap {n}, {t}", [
        f"parallel.data={d}", f"parallel.world_size={d * model_parallel}",
        f"rollout.prompts_per_step={d * per_rank}",
        f"rollout.max_new_tokens={n}", f"data.task={t}", f"spec.max_draft_tokens={n}"])
        for d, n, t in dict.fromkeys(points)]
    result = runner.run_study(STUDY, args, variants)
    report.finish(result, TITLE, COLUMNS, panels=[
        report.bars("bubble_ratio_off", "bubble ratio of the off run", percent),
        report.bars("decode_steps_ratio", "decode steps on / off (steps >= 1)"),
        report.bars("throughput_ratio_with_verify", "throughput on vs off, incl. verify"),
        report.bars("bubble_utilization", "share of the bubble spent drafting", percent),
        report.bars("accept_rate", "accept rate (accepted / drafted tokens)", percent),
        report.scatter("bubble_ratio_off", "decode_steps_ratio", "bubble vs decode steps saved",
                       "bubble ratio, off run", "decode steps on / off"),
    ])


if __name__ == "__main__":
    main()
