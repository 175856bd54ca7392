"""The keying study's drafts and rollouts -> each draft's margins (W_t drafting again, the gap
between its two best perturbed scores recorded at every token) -> where the rollouts leave their
drafts, and what forks drafted at the drafts' lowest margins would cover (the study behind
docs/results/fork-study.md).

A keyed draw takes the token with the best perturbed score (logits / T + the keyed noise). When
the policy moves from W_t to W_{t+1}, a response leaves its W_t draft where the scores' change
reorders the two best tokens, so most likely where their gap, the margin, was small. A fork is a
second draft of the same sample: the draft's first q tokens, the runner-up at q, and what W_t
draws after it. If the rollout takes the runner-up at q, the fork is its draft from there on.

For each pair (t, t + 1) of the keying study (``scripts/keying_study.py``) and one keying:

1. W_t drafts every sample again, recording each draw's runner-up and margin, and W_{t+1} rolls
   it out again (each rollout's length and accepted prefix must equal the study's row; the
   script counts those that do not);
2. the study's replay walks each rollout with its draft and records every place it left the
   draft: the margin there, its rank among the draft's margins, and whether it took the
   runner-up;
3. for the ``--samples`` longest drafts of each step (the drafts most likely to hold the step's
   straggler), W_t drafts ``--forks`` forks at the draft's lowest margins, each up to
   ``--fork-tokens`` tokens past its fork token, and, as a bound, one fork where the rollout in
   fact first left the draft, with the rollout's token;
4. the replay walks each of those rollouts again with the forks as further texts (``replay``'s
   ``forks``) and counts the engine steps.

    TORCHDYNAMO_DISABLE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv/bin/python \\
        scripts/fork_study.py --study runs/keying-study/study --out runs/fork-study
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np

from megatron_bubblespec.config import load_config
from megatron_bubblespec.machine import machine_info
from megatron_bubblespec.models.architecture import load_checkpoint
from megatron_bubblespec.rollout.torch_llama import TorchLlama
from megatron_bubblespec.sampling import SamplingParams
from megatron_bubblespec.sampling.draw_words import Keying
from megatron_bubblespec.speculative.bubble import common_prefix


def _keying_study():
    """scripts/keying_study.py as a module (its generation, replay and weights)."""
    path = Path(__file__).with_name("keying_study.py")
    spec = importlib.util.spec_from_file_location("keying_study", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


study = _keying_study()


def lowest_margins(margins: list[float], count: int) -> list[int]:
    """The places of the ``count`` smallest margins (ties: the earlier place), in place order."""
    order = sorted(range(len(margins)), key=lambda q: (margins[q], q))
    return sorted(order[:count])


def margin_rank(margins: list[float], q: int) -> float:
    """The share of the draft's places with a smaller margin than place ``q`` (0: the smallest)."""
    return sum(m < margins[q] for m in margins) / len(margins)


def fork_prefixes(draft: list[int], runners_up: list[tuple[int, float]],
                  places: list[int]) -> list[list[int]]:
    """The forks' starts: the draft's first q tokens and the runner-up at q, for each place q."""
    return [draft[:q] + [runners_up[q][0]] for q in places]


def steps_with(draft, rollout, forks, cfg, cap, divergences=None) -> dict:
    """The study's replay at the run's match lengths (see ``keying_study.replay``)."""
    return study.replay(draft, rollout, cap=cap, min_match=cfg.spec.min_match,
                        max_match=cfg.spec.max_match, forks=forks, divergences=divergences)


def study_pair(pair: dict, keying: str, load, cfg, args) -> dict:
    """One pair: margins, divergences, forks and their replays (see the module doc)."""
    r = cfg.rollout
    keying_state = study.keying_factory(keying)
    params = SamplingParams(r.temperature, r.top_k, r.top_p)
    stored = pair["keyings"][keying]
    prompts, keys, eos = pair["prompts"], pair["keys"], tuple(pair["eos"])
    # one model at a time (each holds a KV cache for every sample)
    t0 = time.time()
    rollouts = study.generate(load(pair["after"]), prompts, keys, eos, params, r.max_new_tokens,
                              keying_state)
    print(f"  rollouts: {time.time() - t0:.0f} s", flush=True)
    model, runners_up = load(pair["before"]), [[] for _ in prompts]
    drafts = study.generate(model, prompts, keys, eos, params, r.max_new_tokens, keying_state,
                            runners_up=runners_up)
    print(f"  drafts: {time.time() - t0:.0f} s", flush=True)
    # the study's rows again: each rollout's length and accepted prefix
    differ = sum((len(o), common_prefix(d, o)) != (row["tokens"], row["prefix"])
                 for d, o, row in zip(drafts, rollouts, stored["rows"]))

    divergences = []   # one per place a rollout left its draft
    for s, (draft, rollout) in enumerate(zip(drafts, rollouts)):
        events: list = []
        steps_with(draft, rollout, [], cfg, args.cap, divergences=events)
        margins = [m for _, m in runners_up[s]]
        first = common_prefix(draft, rollout)
        for _, q, token in events:
            if q >= len(margins):
                continue
            divergences.append({"sample": s, "place": q, "margin": margins[q],
                                "rank": margin_rank(margins, q),
                                "runner_up": token == runners_up[s][q][0], "first": q == first})

    group = r.prompts_per_step * r.samples_per_prompt
    chosen = []
    for g in range(0, len(drafts), group):
        members = sorted(range(g, min(g + group, len(drafts))), key=lambda s: -len(drafts[s]))
        chosen += members[:args.samples]
    planned = []   # (the fork's start, its sample, margin | bound)
    for s in chosen:
        margins = [m for _, m in runners_up[s]]
        # the last draw has no draft token after it to fork from
        planned += [(start, s, "margin") for start in fork_prefixes(
            drafts[s], runners_up[s], lowest_margins(margins[:-1], args.forks))]
        first = common_prefix(drafts[s], rollouts[s])
        if first < min(len(drafts[s]), len(rollouts[s])):
            planned.append((drafts[s][:first] + [rollouts[s][first]], s, "bound"))
    starts, owners, kinds = (list(column) for column in zip(*planned)) if planned else ([],) * 3
    budgets = [min(r.max_new_tokens, len(x) + args.fork_tokens) for x in starts]
    fork_texts = study.generate(model, [prompts[o] for o in owners], [keys[o] for o in owners],
                                eos, params, budgets, keying_state, prefixes=starts)

    samples = []
    for s in chosen:
        mine = [i for i, o in enumerate(owners) if o == s]
        margin = [fork_texts[i] for i in mine if kinds[i] == "margin"]
        bound = [fork_texts[i] for i in mine if kinds[i] == "bound"]
        samples.append({
            "sample": s, "draft": len(drafts[s]), "tokens": len(rollouts[s]),
            "fork_tokens": sum(len(fork_texts[i]) - len(starts[i]) + 1 for i in mine
                               if kinds[i] == "margin"),
            "none": steps_with(drafts[s], rollouts[s], [], cfg, args.cap),
            "forks": steps_with(drafts[s], rollouts[s], margin, cfg, args.cap),
            "bound": steps_with(drafts[s], rollouts[s], bound, cfg, args.cap),
            "longest": len(rollouts[s]) == max(len(rollouts[x]) for x in range(
                s - s % group, min(s - s % group + group, len(rollouts))))})
    return {"before": pair["before"], "after": pair["after"], "rows_differ": differ,
            "divergences": divergences, "samples": samples,
            "margins": [[round(m, 4) for _, m in rows] for rows in runners_up]}


def summary(pairs: list[dict], forks: int) -> dict:
    events = [e for p in pairs for e in p["divergences"]]
    first = [e for e in events if e["first"]]
    all_margins = np.concatenate([np.array(m, dtype=float) for p in pairs for m in p["margins"]
                                  if m])
    samples = [s for p in pairs for s in p["samples"]]
    stragglers = [s for s in samples if s["longest"]]

    def steps(rows, kind):
        return sum(r[kind]["steps"] for r in rows)

    # of the first divergences, those at one of the draft's ``forks`` lowest margins
    at_lowest = sum(e["place"] in lowest_margins(p["margins"][e["sample"]][:-1], forks)
                    for p in pairs for e in p["divergences"] if e["first"])

    return {
        "divergences": len(events), "first_divergences": len(first),
        "single_token_share": float(np.mean(np.isinf(all_margins))),
        "margin_median_finite": float(np.median(all_margins[np.isfinite(all_margins)])),
        "margin_median_at_divergence": float(np.median([e["margin"] for e in events])),
        "margin_median_at_first": float(np.median([e["margin"] for e in first])),
        "rank_median_at_first": float(np.median([e["rank"] for e in first])),
        "runner_up_share": sum(e["runner_up"] for e in events) / max(len(events), 1),
        "runner_up_share_first": sum(e["runner_up"] for e in first) / max(len(first), 1),
        "first_at_lowest_margins": at_lowest / max(len(first), 1),
        "forked_samples": len(samples), "stragglers": len(stragglers),
        "steps": {k: steps(samples, k) for k in ("none", "forks", "bound")},
        "straggler_steps": {k: steps(stragglers, k) for k in ("none", "forks", "bound")},
        "tokens": sum(s["tokens"] for s in samples),
        "fork_tokens": sum(s["fork_tokens"] for s in samples),
    }


def report(study_json: dict) -> str:
    """The study's markdown tables: where the rollouts left their drafts, and the forks' replay."""
    pairs, forks = study_json["pairs"], study_json["forks"]
    total = summary(pairs, forks)
    lines = ["| pair | divergences (first) | places with one token in the nucleus | median "
             "margin: other places / at a divergence / at a first | median rank at a first | "
             "took the runner-up: all / first | first at the draft's "
             f"{forks} lowest margins | rows differing from the keying study |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for p in [*pairs, None]:
        t = summary([p], forks) if p else total
        name = f"{p['before']} -> {p['after']}" if p else "all"
        differ = p["rows_differ"] if p else sum(q["rows_differ"] for q in pairs)
        lines.append(f"| {name} | {t['divergences']} ({t['first_divergences']}) | "
                     f"{t['single_token_share']:.1%} | {t['margin_median_finite']:.2f} / "
                     f"{t['margin_median_at_divergence']:.2f} / {t['margin_median_at_first']:.2f}"
                     f" | {t['rank_median_at_first']:.3f} | {t['runner_up_share']:.1%} / "
                     f"{t['runner_up_share_first']:.1%} | {t['first_at_lowest_margins']:.1%} | "
                     f"{differ} |")
    lines += ["", "| replayed engine steps | forked drafts | of them each step's longest rollout |",
              "|---|---:|---:|"]
    for kind, what in (("none", "the draft alone"),
                       ("forks", f"with a fork at each of its {forks} lowest margins"),
                       ("bound", "with one fork where the rollout first left it (a bound)")):
        lines.append(f"| {what} | {total['steps'][kind]:,} | {total['straggler_steps'][kind]:,} |")
    lines.append(f"| responses; their tokens; fork tokens drafted | {total['forked_samples']}; "
                 f"{total['tokens']:,}; {total['fork_tokens']:,} | {total['stragglers']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--study", required=True, type=Path,
                        help="the keying study's --out (keying_study.json and weights/)")
    parser.add_argument("--keying", default="context2")
    parser.add_argument("--samples", type=int, default=1, help="forked drafts per step")
    parser.add_argument("--forks", type=int, default=4, help="forks per draft")
    parser.add_argument("--fork-tokens", type=int, default=256,
                        help="tokens a fork drafts past its fork token")
    parser.add_argument("--cap", type=int, default=None,
                        help="draft tokens an engine step proposes (default: the study's)")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--report", action="store_true",
                        help="print the tables of the study already in --out, measure nothing")
    args = parser.parse_args(argv)
    Keying.parse(args.keying)
    if args.report:
        print(report(json.loads((args.out / "fork_study.json").read_text())))
        return 0

    source = json.loads((args.study / "keying_study.json").read_text())
    args.cap = args.cap or source["cap"]
    run = Path(source["run"])
    cfg = load_config(run / "config.yaml")
    book = study.sample_book(cfg, load_checkpoint(study.version_dir(run, args.study, 0, cfg))[0])
    args.out.mkdir(parents=True, exist_ok=True)
    results, pairs, started = args.out / "fork_study.json", [], time.time()
    for pair in source["pairs"]:
        samples = study.pair_samples(book, pair["after"], pair["samples"])
        if len(samples) != pair["samples"]:
            raise SystemExit(f"pair {pair['before']}-{pair['after']}: {len(samples)} samples, "
                             f"the study had {pair['samples']}")
        pair = {**pair, "prompts": [list(s.prompt.token_ids) for s in samples],
                "keys": [s.key for s in samples], "eos": list(samples[0].eos_token_ids)}
        t0 = time.time()

        def load(version: int) -> TorchLlama:
            return TorchLlama(*load_checkpoint(study.version_dir(run, args.study, version, cfg)),
                              max_model_len=cfg.model.max_model_len)

        pairs.append(study_pair(pair, args.keying, load, cfg, args))
        print(f"pair {pair['before']}-{pair['after']}: {time.time() - t0:.0f} s, rows "
              f"differing from the study's: {pairs[-1]['rows_differ']}", flush=True)
        results.write_text(json.dumps(
            {"study": str(args.study), "keying": args.keying, "cap": args.cap,
             "samples": args.samples, "forks": args.forks, "fork_tokens": args.fork_tokens,
             "pairs": pairs, "summary": summary(pairs, args.forks),
             "seconds": round(time.time() - started, 1), "machine": machine_info()}, indent=1))
    print(report(json.loads(results.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
