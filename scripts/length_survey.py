"""Candidate tasks x sampling settings -> SmolLM2's responses on vLLM -> how long-tailed their lengths
are, by prompt, and the bubble they would leave (the table behind configs/longtail.yaml).

For each candidate (``task:temperature:top_p``, e.g. ``gsm8k:1.0:1.0``) the first ``--prompts``
prompts of the task are answered ``--samples`` times each with the project's keyed engine at a
budget of ``--max-new-tokens``. Per candidate it reports the length quantiles, the share of
responses that reach the budget (a loop, not an answer: the budget should rarely bind), the share
of the length variance that prompt identity explains (between-prompt variance / total: the signal
a drafting order can use), the mean reward, and the bubble a synchronous step would leave: the
prompts dealt to ``--ranks`` data-parallel ranks of ``--groups`` prompts each, a rank's rollout as
long as its longest response (decode steps), the bubble = 1 - mean(rank) / max(rank), averaged
over random deals.

    TORCHDYNAMO_DISABLE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv/bin/python \\
        scripts/length_survey.py --out results/length-survey gsm8k:1.0:1.0 gsm8k:0.7:1.0
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from megatron_bubblespec.data.tasks import make_task
from megatron_bubblespec.machine import machine_info
from megatron_bubblespec.models.smollm2 import load_tokenizer, smollm2_checkpoint
from megatron_bubblespec.rollout.vllm_engine import VLLMEngine
from megatron_bubblespec.sampling import SamplingParams, sample_key
from megatron_bubblespec.sampling.requests import RolloutRequest

TASKS = {"gsm8k": dict(name="gsm8k", split="train"), "arithmetic": dict(name="arithmetic_word")}


def candidate(spec: str) -> tuple[str, float, float]:
    task, temperature, top_p = spec.split(":")
    if task not in TASKS:
        raise SystemExit(f"unknown task {task!r}: choose from {sorted(TASKS)}")
    return task, float(temperature), float(top_p)


def survey(engine, task, params, prompts: int, samples: int, budget: int, seed: int):
    """Per prompt, the lengths and rewards of its samples (all requests in one batch)."""
    picked = [task.prompt(index) for index in range(prompts)]
    requests = [RolloutRequest(f"{prompt.uid}-{s}", prompt.token_ids,
                               sample_key(seed, 0, prompt.uid, s), budget,
                               eos_token_ids=task.eos_token_ids)
                for prompt in picked for s in range(samples)]
    results = engine.generate(requests, params)
    lengths = [len(r.token_ids) for r in results]
    rewards = [task.reward(picked[i // samples], r.token_ids).total
               for i, r in enumerate(results)]
    return (np.asarray(lengths).reshape(prompts, samples),
            np.asarray(rewards).reshape(prompts, samples))


def bubble(lengths: np.ndarray, ranks: int, groups: int, deals: int, seed: int) -> float:
    """Mean over random deals of 1 - mean(rank time) / max(rank time), a rank's time its longest
    response (the engine decodes its batch until the last sample ends)."""
    rng = np.random.default_rng(seed)
    need = ranks * groups
    out = []
    for _ in range(deals):
        picked = rng.choice(len(lengths), size=need, replace=need > len(lengths))
        per_rank = lengths[picked].reshape(ranks, -1).max(axis=1)
        out.append(1.0 - per_rank.mean() / per_rank.max())
    return float(np.mean(out))


def summary(lengths: np.ndarray, rewards: np.ndarray, budget: int, ranks: list[int], groups: int,
            seed: int) -> dict:
    flat = lengths.ravel()
    total = flat.var()
    between = lengths.mean(axis=1).var()
    q = np.quantile(flat, [0.5, 0.9, 0.99])
    return {"mean": float(flat.mean()), "p50": float(q[0]), "p90": float(q[1]),
            "p99": float(q[2]), "max": int(flat.max()),
            "at_budget": float((flat >= budget).mean()),
            "prompt_share_of_variance": float(between / total) if total else 0.0,
            "reward_mean": float(rewards.mean()),
            "bubble": {str(n): bubble(lengths, n, groups, deals=2000, seed=seed) for n in ranks}}


def markdown(rows: list[dict], args) -> str:
    head = ("| candidate (task, T, top-p) | mean | p50 | p90 | p99 | max | at budget | "
            "prompt's share of variance | reward | "
            + " | ".join(f"bubble, {n} ranks" for n in args.ranks) + " |")
    lines = [head, "|" + "---|" * (9 + len(args.ranks))]
    for r in rows:
        s = r["summary"]
        lines.append(f"| {r['candidate']} | {s['mean']:.0f} | {s['p50']:.0f} | {s['p90']:.0f} | "
                     f"{s['p99']:.0f} | {s['max']} | {s['at_budget']:.1%} | "
                     f"{s['prompt_share_of_variance']:.1%} | {s['reward_mean']:.3f} | "
                     + " | ".join(f"{s['bubble'][str(n)]:.1%}" for n in args.ranks) + " |")
    lines.append("")
    lines.append(f"{args.prompts} prompts x {args.samples} samples, budget {args.max_new_tokens}; "
                 f"bubble: ranks of {args.groups} prompt(s) each.")
    return "\n".join(lines) + "\n"


def resummarize(args) -> None:
    """survey.json's lengths -> survey.md with this invocation's ranks and groups (rewards kept)."""
    saved = json.loads((args.out / "survey.json").read_text())
    for key in ("prompts", "samples", "max_new_tokens", "seed"):   # as measured
        setattr(args, key, saved["settings"][key])
    for row in saved["rows"]:
        lengths = np.asarray(row["lengths"])
        row["summary"]["bubble"] = {str(n): bubble(lengths, n, args.groups, deals=2000,
                                                   seed=args.seed) for n in args.ranks}
    saved["settings"].update(ranks=args.ranks, groups=args.groups)
    (args.out / "survey.json").write_text(json.dumps(saved) + "\n")
    (args.out / "survey.md").write_text(markdown(saved["rows"], args))
    print(markdown(saved["rows"], args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("candidates", nargs="*", type=candidate, help="task:temperature:top_p")
    parser.add_argument("--out", type=Path, required=True, help="directory for survey.json/.md")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4],
                        help="data-parallel sizes to deal the prompts to (one bubble column each)")
    parser.add_argument("--groups", type=int, default=1, help="prompts per rank and step")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--summarize", action="store_true",
                        help="recompute the table from --out's survey.json (no engine)")
    parser.add_argument("--kv-cache-gb", type=float, default=6.0,
                        help="room for every request at full length (SmolLM2: 46 kB a token), "
                             "so that none is preempted and recomputed")
    args = parser.parse_args()
    if args.summarize:
        resummarize(args)
        return
    if not args.candidates:
        parser.error("name at least one candidate (task:temperature:top_p)")
    tokenizer = load_tokenizer()
    engine = VLLMEngine(smollm2_checkpoint(), max_model_len=args.max_new_tokens + 512,
                        seed=args.seed, kv_cache_memory_bytes=int(args.kv_cache_gb * 1e9))
    rows = []
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "candidates")}
    try:
        for task_name, temperature, top_p in args.candidates:
            label = f"{task_name}, {temperature:g}, {top_p:g}"
            print(label, flush=True)
            task = make_task(**TASKS[task_name], tokenizer=tokenizer)
            params = SamplingParams(temperature, top_p=top_p)
            lengths, rewards = survey(engine, task, params, args.prompts, args.samples,
                                      args.max_new_tokens, args.seed)
            rows.append({"candidate": label, "lengths": lengths.tolist(),
                         "summary": summary(lengths, rewards, args.max_new_tokens, args.ranks,
                                            args.groups, args.seed)})
            # written after every candidate: a stopped survey keeps what it measured
            (args.out / "survey.json").write_text(json.dumps(
                {"machine": machine_info(), "settings": settings, "rows": rows}) + "\n")
            (args.out / "survey.md").write_text(markdown(rows, args))
    finally:
        engine.shutdown()
    print(markdown(rows, args))


if __name__ == "__main__":
    main()
