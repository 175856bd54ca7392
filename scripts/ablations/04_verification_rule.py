"""Study 4: the verification rule. Keyed coupling (ablation.rule=keyed: accept while the target's
keyed draw equals the draft token; exact) against standard speculative sampling (ablation.rule=residual:
accept with min(1, p/q), resample from the residual; exact in distribution but not token-identical
to the plain run) and SPEC-RL's lenient rule (ablation.rule=lenient; inexact).

The non-keyed rules need the drafts' distributions, which only the reference engine keeps, and
verify without speculative continuation: every run of the study, the off run included, uses
rollout.engine=reference and ablation.speculative_continuation=false. The table shows acceptance and
speed; token mismatch against the off run and the reward curves show what inexactness costs. On
configs/tiny.yaml the runs use runner.LEARNING (lr 3e-3, 60 steps) unless --lr / --steps say
otherwise. The residual and lenient rules verify in the reference engine (which keeps the drafting
policy's distributions); the keyed rule verifies on Megatron as in BubbleSpec, or in the engine
too with --keyed-verifier engine. SPEC-RL's lenience is ablation.lenience (a dotted override).

    python scripts/ablations/04_verification_rule.py [--config configs/tiny.yaml] [--steps N]
        [--rules keyed,residual,lenient] [--keyed-verifier megatron|engine]
        [dotted overrides...]
"""

from __future__ import annotations

import report
import runner
from megatron_bubblespec.metrics.formatting import count, number, percent

STUDY = "04_verification_rule"
TITLE = "Verification rule: keyed coupling vs residual vs lenient"
COLUMNS = (*report.DEFAULT_COLUMNS,
           report.Column("mismatched samples", "token_mismatch_samples", count),
           report.Column("reward off first", "reward_first_off", number),
           report.Column("reward off last", "reward_last_off", number))
ENGINE = ("rollout.engine=reference", "ablation.speculative_continuation=false")


def main(argv=None) -> None:
    p = runner.parser(__doc__)
    p.add_argument("--rules", type=runner.csv(str), default=["keyed", "residual", "lenient"],
                   help="values of ablation.rule (default %(default)s)")
    p.add_argument("--keyed-verifier", choices=("megatron", "engine"), default="megatron",
                   help="where the keyed rule verifies: Megatron (BubbleSpec's verifier, default) "
                        "or the reference engine, where the other rules always verify")
    args = p.parse_args(argv)
    runner.learning_defaults(args, curve=True)
    args.overrides = [*ENGINE, *args.overrides]
    lenience = runner.load(args.config, runner.base_overrides(args)).ablation.lenience
    labels = {"keyed": f"keyed ({args.keyed_verifier} verifier)",
              "residual": "residual (engine verifier)",
              "lenient": f"lenient x{lenience:g} (engine verifier)"}
    variants = [runner.Variant(labels[rule], [f"ablation.rule={rule}"] + (
        [f"spec.verifier={args.keyed_verifier}"] if rule == "keyed" else []))
        for rule in args.rules]
    result = runner.run_study(STUDY, args, variants)
    report.finish(result, TITLE, COLUMNS, panels=[
        report.bars("accept_rate", "accept rate (accepted / drafted tokens)", percent),
        report.bars("decode_steps_ratio", "decode steps on / off (steps >= 1)"),
        report.bars("throughput_ratio_with_verify", "throughput on vs off, incl. verify"),
        report.bars("token_mismatch", "token mismatch vs off run (tokens)", count),
        report.curves("train/reward_mean", "reward per step"),
        report.curves("spec/accept_rate", "accept rate per step", off=False),
    ], extra=[
        "## Reward per step", "",
        report.per_step_table(result["runs"], "train/reward_mean"),
    ])


if __name__ == "__main__":
    main()
