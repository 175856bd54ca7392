"""Study 1, the main table: BubbleSpec against plain synchronous GRPO (paired runs, same seeds and
prompts), at a learning rate where the reward really improves over the run.

The table gives the package's paired numbers (``measure.bench``): decode steps on / off, rollout
throughput with and without the verify cost, the off run's bubble and the share of it spent
drafting, acceptance, token mismatch (0: both runs produced the same tokens), learning rate, policy
drift, and the reward of the first and last quarter of the steps. On configs/tiny.yaml the run uses
runner.LEARNING (lr 3e-3, 60 steps) unless --lr / --steps say otherwise.

    python scripts/ablations/01_main_table.py [--config configs/tiny.yaml] [--steps N] [--lr X]
        [dotted overrides...]
"""

from __future__ import annotations

import report
import runner
from megatron_bubblespec.measure.bench_report import markdown_steps, markdown_summary
from megatron_bubblespec.metrics import plot_run
from megatron_bubblespec.metrics.formatting import number

STUDY = "01_main_table"
TITLE = "BubbleSpec vs plain synchronous GRPO"


def main(argv=None) -> None:
    args = runner.parser(__doc__).parse_args(argv)
    runner.learning_defaults(args, curve=True)
    result = runner.run_study(STUDY, args, [runner.Variant("BubbleSpec", [])])
    run = result["runs"][0]
    on, off = run["series"]["on"], run["series"]["off"]
    plot_run(on, f"{result['out']}/bench.png", baseline=off)
    columns = (*report.ACCEPT, *report.SPEED[:2], *report.ENGINE, *report.SPEED[2:],
               *report.STEADY, *report.BUBBLE, *report.COVERAGE, *report.EXACT, *report.TRAINING)
    report.finish(result, TITLE, columns, panels=[
        report.curves("train/reward_mean", "reward per step (identical tokens on and off)"),
        report.curves("rollout/decode_steps", "decode steps per step"),
        report.curves("rollout/time_s", "rollout time per step (s)"),
        report.curves("spec/accept_rate", "accept rate per step", off=False),
        report.curves("policy/drift_kl", "policy drift KL per step", off=False),
        report.curves("bubble/ratio", "bubble ratio per step"),
    ], extra=[
        "## Paired summary", "", markdown_summary(run), "",
        f"Reward, mean of the first / last quarter of the steps: on "
        f"{number(run['reward_first_on'])} → {number(run['reward_last_on'])}, off "
        f"{number(run['reward_first_off'])} → {number(run['reward_last_off'])}.", "",
        "## Per step", "", markdown_steps(on, off), "",
        "## Reward per step", "", report.per_step_table(result["runs"], "train/reward_mean"),
    ])


if __name__ == "__main__":
    main()
