"""Study 2: the draft budget, spec.max_draft_tokens (tokens drafted per sample), spec.draft_chunk
(samples a fast rank claims from the shared cursor at a time), spec.draft_horizon (steps a
bubble drafts ahead) and ablation.draft_order (which samples it drafts first).

A larger token budget lets a draft cover more of a response but spends the bubble on fewer
samples; a larger chunk makes fewer claims but leaves the cursor's tail less evenly shared; a
longer horizon fills the drafting batch with later steps' samples (older drafts by the time they
are verified) once the next step's are all in flight; the order ``stragglers`` extends the partial
drafts still running first, longest first (the likely stragglers), ``engines`` deals them
round-robin over the engines. Each knob is swept around the config's values of the others
(``--full-grid``: every combination; the order only when ``--draft-order`` names values). Spec
keys do not change the plain run, so all variants share one off run.

    python scripts/ablations/02_draft_budget.py [--config configs/tiny.yaml] [--steps N]
        [--max-draft-tokens 8,24,48] [--draft-chunk 1,2,4] [--draft-horizon 1,2,3]
        [--draft-order engines,stragglers] [--full-grid]
        [dotted overrides...]
"""

from __future__ import annotations

import itertools

import report
import runner
from megatron_bubblespec.metrics.formatting import count, number, percent

STUDY = "02_draft_budget"
TITLE = "Draft budget: tokens per draft, draft chunk, horizon and order"
COLUMNS = (report.Column("drafted tok", "drafted_tokens", count),
           report.Column("accepted tok", "accepted_tokens", count),
           *report.DEFAULT_COLUMNS)


def main(argv=None) -> None:
    p = runner.parser(__doc__)
    p.add_argument("--max-draft-tokens", type=runner.csv(int), default=[8, 24, 48],
                   help="values of spec.max_draft_tokens (default %(default)s)")
    p.add_argument("--draft-chunk", type=runner.csv(int), default=[1, 2, 4],
                   help="values of spec.draft_chunk (default %(default)s)")
    p.add_argument("--draft-horizon", type=runner.csv(int), default=[1, 2, 3],
                   help="values of spec.draft_horizon (default %(default)s)")
    p.add_argument("--draft-order", type=runner.csv(str), default=[],
                   help="values of ablation.draft_order (default: the config's only), e.g. "
                        "engines,stragglers")
    p.add_argument("--full-grid", action="store_true",
                   help="every combination of the knobs instead of one knob at a time")
    args = p.parse_args(argv)
    runner.learning_defaults(args)
    cfg = runner.load(args.config, runner.base_overrides(args))
    spec = cfg.spec
    base = (spec.max_draft_tokens, spec.draft_chunk, spec.draft_horizon, cfg.ablation.draft_order)
    if args.full_grid:
        grid = list(itertools.product(args.max_draft_tokens, args.draft_chunk, args.draft_horizon,
                                      args.draft_order or [base[3]]))
    else:
        grid = [(m, *base[1:]) for m in args.max_draft_tokens]
        grid += [(base[0], c, *base[2:]) for c in args.draft_chunk]
        grid += [(*base[:2], h, base[3]) for h in args.draft_horizon]
        grid += [(*base[:3], o) for o in args.draft_order]
    grid = list(dict.fromkeys(grid))
    named = bool(args.draft_order)  # name the order only in a study that varies it
    variants = [runner.Variant(f"{m} tok, chunk {c}, horizon {h}"
                               + (f", order {o}" if named or o != base[3] else ""),
                               [f"spec.max_draft_tokens={m}", f"spec.draft_chunk={c}",
                                f"spec.draft_horizon={h}", f"ablation.draft_order={o}"])
                for m, c, h, o in grid]
    result = runner.run_study(STUDY, args, variants)
    report.finish(result, TITLE, COLUMNS, panels=[
        report.bars("accept_rate", "accept rate (accepted / drafted tokens)", percent),
        report.bars("accepted_tokens", "accepted tokens (all steps)", count),
        report.bars("decode_steps_ratio", "decode steps on / off (steps >= 1)"),
        report.bars("throughput_ratio_with_verify", "throughput on vs off, incl. verify"),
        report.bars("bubble_utilization", "share of the bubble spent drafting", percent),
        report.bars("accepted_prefix_mean", "accepted prefix per drafted sample (tokens)", number),
    ], extra=[
        "## Drafted tokens per step", "",
        report.per_step_table(result["runs"], "spec/drafted_tokens", count, off=False),
    ])


if __name__ == "__main__":
    main()
