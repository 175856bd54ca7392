"""Study 1, the main table: BubbleSpec against plain synchronous GRPO (paired runs, same seeds and
prompts), at a learning rate where the reward really improves over the run.

The table gives the package's paired numbers (``loop.bench``): decode steps on / off, rollout
throughput with and without the verify cost, the off run's bubble and the share of it spent
drafting, acceptance, token mismatch (0: both runs produced the same tokens), learning rate, policy
drift, and the reward of the first and last quarter of the steps. On configs/tiny.yaml the run uses
common.LEARNING (lr 3e-3, 60 steps) unless --lr / --steps say otherwise.

    python scripts/ablations/01_main_table.py [--config configs/tiny.yaml] [--steps N] [--lr X]
        [dotted overrides...]
"""

from __future__ import annotations

import common
from megatron_bubblespec.loop.bench import markdown_steps, markdown_summary
from megatron_bubblespec.metrics import plot_run
from megatron_bubblespec.metrics.formatting import number

STUDY = "01_main_table"
TITLE = "BubbleSpec vs plain synchronous GRPO"


def main(argv=None) -> None:
    args = common.parser(__doc__).parse_args(argv)
    common.learning_defaults(args, curve=True)
    result = common.run_study(STUDY, args, [common.Variant("BubbleSpec", [])])
    run = result["runs"][0]
    on, off = run["series"]["on"], run["series"]["off"]
    plot_run(on, f"{result['out']}/bench.png", baseline=off)
    columns = (*common.ACCEPT, *common.SPEED[:2], *common.ENGINE, *common.SPEED[2:],
               *common.BUBBLE, *common.COVERAGE, *common.EXACT, *common.TRAINING)
    common.finish(result, TITLE, columns, panels=[
        common.curves("train/reward_mean", "reward per step (identical tokens on and off)"),
        common.curves("rollout/decode_steps", "decode steps per step"),
        common.curves("rollout/time_s", "rollout time per step (s)"),
        common.curves("spec/accept_rate", "accept rate per step", off=False),
        common.curves("policy/drift_kl", "policy drift KL per step", off=False),
        common.curves("bubble/ratio", "bubble ratio per step"),
    ], extra=[
        "## Paired summary", "", markdown_summary(run), "",
        f"Reward, mean of the first / last quarter of the steps: on "
        f"{number(run['reward_first_on'])} → {number(run['reward_last_on'])}, off "
        f"{number(run['reward_first_off'])} → {number(run['reward_last_off'])}.", "",
        "## Per step", "", markdown_steps(on, off), "",
        "## Reward per step", "", common.per_step_table(result["runs"], "train/reward_mean"),
    ])


if __name__ == "__main__":
    main()
