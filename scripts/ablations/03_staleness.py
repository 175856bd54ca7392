"""Study 3: draft staleness. BubbleSpec drafts a step's samples one step ahead (made by the policy
of step t - 1, ablation.draft_lookahead=1); k steps ahead (ablation.draft_lookahead=k) they are k policy
updates old; SPEC-RL-like drafts are the prompt's responses from the previous epoch
(ablation.draft_source=previous_epoch), older still and drawn with another step's sampling keys.

So that the previous-epoch variant has drafts within a short run, every run (off runs included)
uses the task's first ``--epoch-steps`` steps' worth of prompts (data.max_prompts = epoch_steps
x rollout.prompts_per_step; 0 keeps the config's). All variants share one off run.

    python scripts/ablations/03_staleness.py [--config configs/tiny.yaml] [--steps N]
        [--lookahead 1,2,3] [--no-previous-epoch] [--epoch-steps 2] [dotted overrides...]
"""

from __future__ import annotations

import report
import runner
from megatron_bubblespec.metrics.formatting import count, percent

STUDY = "03_staleness"
TITLE = "Draft staleness: 1 step vs k steps vs previous epoch"
COLUMNS = (report.Column("drafted tok", "drafted_tokens", count),
           *report.DEFAULT_COLUMNS)


def main(argv=None) -> None:
    p = runner.parser(__doc__)
    p.add_argument("--lookahead", type=runner.csv(int), default=[1, 2, 3],
                   help="values of ablation.draft_lookahead (default %(default)s)")
    p.add_argument("--no-previous-epoch", dest="previous_epoch", action="store_false",
                   help="leave out the ablation.draft_source=previous_epoch variant")
    p.add_argument("--epoch-steps", type=int, default=2,
                   help="steps per epoch of every run (default %(default)s; 0 = the config's)")
    args = p.parse_args(argv)
    runner.learning_defaults(args, min_steps=8)
    if args.epoch_steps:
        prompts = runner.load(args.config, runner.base_overrides(args)).rollout.prompts_per_step
        args.overrides = [f"data.max_prompts={args.epoch_steps * prompts}", *args.overrides]
    variants = [runner.Variant(f"{k} step{'s' * (k > 1)} old",
                               ["ablation.draft_source=bubble", f"ablation.draft_lookahead={k}"])
                for k in args.lookahead]
    if args.previous_epoch:
        variants.append(runner.Variant("previous epoch", ["ablation.draft_source=previous_epoch"]))
    result = runner.run_study(STUDY, args, variants)
    report.finish(result, TITLE, COLUMNS, panels=[
        report.bars("accept_rate", "accept rate (accepted / drafted tokens)", percent),
        report.bars("accepted_prefix_mean", "accepted prefix per drafted sample (tokens)"),
        report.bars("decode_steps_ratio", "decode steps on / off (steps >= 1)"),
        report.bars("throughput_ratio_with_verify", "throughput on vs off, incl. verify"),
        report.curves("spec/accept_rate", "accept rate per step", off=False),
        report.curves("spec/drafted_tokens", "drafted tokens per step", off=False),
    ], extra=[
        "## Accept rate per step", "",
        report.per_step_table(result["runs"], "spec/accept_rate", percent, off=False), "",
        "## Drafted tokens per step", "",
        report.per_step_table(result["runs"], "spec/drafted_tokens", count, off=False),
    ])


if __name__ == "__main__":
    main()
