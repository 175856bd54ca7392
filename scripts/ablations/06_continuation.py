"""Study 6: speculative continuation after a divergence (ablation.speculative_continuation on / off),
and its proposal sources.

With continuation on, a sample whose draft was rejected keeps proposing tokens from its sources
(spec.proposal_sources; the schema's default: the other drafts of its prompt, and its own draft
re-aligned, each on a suffix match of at least spec.min_match tokens), so drafts keep saving
decode steps past the first divergence; off, the engine decodes everything after the accepted
prefix one token per step.
`--sources` adds one continuation-on variant per source set (`+` joins sources: `self+siblings`;
`all` is every source), each counted apart in the continuation columns. `--proposal-token-cost`
adds one continuation-on variant per cost (`null`: every sample with a match proposes
spec.spec_k tokens, adaptive k off; a number: each proposes the tokens that pay at its recent
acceptance). The history source proposes only when prompts recur within the run (pass
data.max_prompts=N, few enough prompts; say so in the table).
All variants share one plain synchronous baseline run (`--min-match` adds continuation-on
variants with other spec.min_match values; spec.* keys only, so they share it too). Exactness
holds either way: token mismatch must be 0. The runs use the config's rollout.engine: both
engines implement continuation (vLLM through rollout/vllm_proposer.py) and propose the same
tokens; pass rollout.engine=reference to run on the reference engine.

    python scripts/ablations/06_continuation.py [--config configs/tiny.yaml] [--steps N]
        [--continuation true,false] [--min-match 3] [--sources bubble,self,siblings,all]
        [--proposal-token-cost null,0.4]
        [dotted overrides...]
"""

from __future__ import annotations

import report
import runner
from megatron_bubblespec.speculative.sources import SOURCES
from megatron_bubblespec.metrics.formatting import count, percent

STUDY = "06_continuation"
TITLE = "Speculative continuation after divergence"


def main(argv=None) -> None:
    p = runner.parser(__doc__)
    p.add_argument("--continuation", type=runner.csv(str), default=["true", "false"],
                   help="values of ablation.speculative_continuation (default %(default)s)")
    p.add_argument("--min-match", type=runner.csv(int), default=[],
                   help="extra continuation-on variants, one per spec.min_match value (the "
                        "shortest suffix match that proposes; the config's is the default "
                        "variant's), e.g. 3")
    p.add_argument("--sources", type=runner.csv(str), default=[],
                   help="extra continuation-on variants, one per source set (sources joined "
                        f"by '+', or 'all' for {'+'.join(SOURCES)}), e.g. "
                        "bubble,self,siblings,all")
    p.add_argument("--proposal-token-cost", type=runner.csv(str), default=[],
                   help="extra continuation-on variants, one per spec.proposal_token_cost "
                        "(null: always spec.spec_k tokens, adaptive k off), e.g. null")
    args = p.parse_args(argv)
    runner.learning_defaults(args)
    variants = [runner.Variant(f"continuation {v}", [f"ablation.speculative_continuation={v}"])
                for v in args.continuation]
    variants += [runner.Variant(f"continuation true, min_match {m}",
                                ["ablation.speculative_continuation=true", f"spec.min_match={m}"])
                 for m in args.min_match]
    variants += [runner.Variant(f"continuation true, proposal_token_cost {c}",
                                ["ablation.speculative_continuation=true",
                                 f"spec.proposal_token_cost={c}"])
                 for c in args.proposal_token_cost]
    for sources in args.sources:
        chosen = SOURCES if sources == "all" else tuple(sources.split("+"))
        unknown = sorted(set(chosen) - set(SOURCES))
        if unknown:
            p.error(f"--sources {sources}: unknown {unknown}; choose from "
                    f"{', '.join(SOURCES)} or all")
        variants.append(runner.Variant(f"continuation from {sources}", [
            "ablation.speculative_continuation=true", f"spec.proposal_sources=[{','.join(chosen)}]"]))
    result = runner.run_study(STUDY, args, variants)
    columns = (*report.ACCEPT, *report.SPEED[:2], *report.ENGINE, *report.SPEED[2:],
               *report.STEADY, *report.BUBBLE, *report.COVERAGE, *report.CONTINUATION,
               report.SourcesColumn(), *report.EXACT, *report.TRAINING)
    report.finish(result, TITLE, columns, extra=[
        "## Decode steps per step", "",
        report.per_step_table(result["runs"], "rollout/decode_steps", count), "",
        "## Decode steps saved per step (1 - decode steps / plain decode steps of the same "
        "responses)", "",
        report.per_step_table(result["runs"], "spec/decode_steps_saved_frac", percent, off=False),
    ])


if __name__ == "__main__":
    main()
