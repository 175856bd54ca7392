"""Study 6: speculative continuation after a divergence (spec.speculative_continuation on / off).

With continuation on, a sample whose draft was rejected keeps proposing tokens from its prompt's
draft pool (the drafts of its sibling samples and its own, re-aligned on a suffix match), so drafts
keep saving decode steps past the first divergence; off, the engine decodes everything after the
accepted prefix one token per step. Both share one plain synchronous baseline run. Exactness holds
either way: token mismatch must be 0. The runs use the reference engine (rollout.engine=reference,
unless overridden): the vLLM engine does not implement continuation and would ignore the flag.

    python scripts/ablations/06_continuation.py [--config configs/tiny.yaml] [--steps N]
        [--continuation true,false] [dotted overrides...]
"""

from __future__ import annotations

import common
from megatron_bubblespec.metrics.formatting import count, percent

STUDY = "06_continuation"
TITLE = "Speculative continuation after divergence"


def main(argv=None) -> None:
    p = common.parser(__doc__)
    p.add_argument("--continuation", type=common.csv(str), default=["true", "false"],
                   help="values of spec.speculative_continuation (default %(default)s)")
    args = p.parse_args(argv)
    if not any(o.startswith("rollout.engine=") for o in args.overrides):
        # continuation is implemented in the reference engine; vLLM continues plainly
        args.overrides.append("rollout.engine=reference")
    common.learning_defaults(args)
    variants = [common.Variant(f"continuation {v}", [f"spec.speculative_continuation={v}"])
                for v in args.continuation]
    result = common.run_study(STUDY, args, variants)
    common.finish(result, TITLE, extra=[
        "## Decode steps per step", "",
        common.per_step_table(result["runs"], "rollout/decode_steps", count), "",
        "## Decode steps saved per step (1 - decode steps / plain decode steps of the same "
        "responses)", "",
        common.per_step_table(result["runs"], "spec/decode_steps_saved_frac", percent, off=False),
    ])


if __name__ == "__main__":
    main()
