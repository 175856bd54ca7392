"""Study 7: learning rate against acceptance. The drafts of step t were made by the policy of step
t - 1; the further one update moves the policy (policy drift, the KL between consecutive policies),
the sooner the updated policy's keyed draw departs from a draft. Sweeps train.lr (each learning
rate has its own off run) and plots acceptance against the measured drift.

    python scripts/ablations/07_lr_vs_acceptance.py [--config configs/tiny.yaml] [--steps N]
        [--lrs 1e-5,1e-4,1e-3,3e-3] [dotted overrides...]
"""

from __future__ import annotations

import report
import runner
from megatron_bubblespec.metrics.formatting import count, percent, scientific

STUDY = "07_lr_vs_acceptance"
TITLE = "Learning rate vs acceptance"


def main(argv=None) -> None:
    p = runner.parser(__doc__)
    p.add_argument("--lrs", type=runner.csv(float), default=[1e-5, 1e-4, 1e-3, 3e-3],
                   help="values of train.lr (default %(default)s)")
    args = p.parse_args(argv)
    runner.learning_defaults(args, lr=False)
    variants = [runner.Variant(f"lr {scientific(lr)}", [f"train.lr={lr!r}"]) for lr in args.lrs]
    result = runner.run_study(STUDY, args, variants)
    report.finish(result, TITLE, panels=[
        report.scatter("policy_drift_kl_mean", "accept_rate", "acceptance vs policy drift",
                       "policy drift KL per step (mean)", "accept rate", logx=True),
        report.scatter("policy_drift_kl_mean", "accepted_prefix_mean",
                       "accepted prefix vs policy drift", "policy drift KL per step (mean)",
                       "accepted prefix (tokens)", logx=True),
        report.bars("decode_steps_ratio", "decode steps on / off (steps >= 1)"),
        report.curves("spec/accept_rate", "accept rate per step", off=False),
        report.curves("policy/drift_kl", "policy drift KL per step", off=False),
        report.bars("token_mismatch", "token mismatch vs off run (tokens)", count),
    ], extra=[
        "## Accept rate per step", "",
        report.per_step_table(result["runs"], "spec/accept_rate", percent, off=False), "",
        "## Policy drift KL per step", "",
        report.per_step_table(result["runs"], "policy/drift_kl", scientific, off=False),
    ])


if __name__ == "__main__":
    main()
