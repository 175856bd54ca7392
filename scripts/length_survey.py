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
over random deals. And what the text is like, for a job that stands for real RL:

* token entropy: per response token, the entropy of the distribution it was drawn from
  (softmax(logits / T) after top-k / top-p, in nats; transformers recomputes the logits), its mean,
  median, 80th percentile and the share under 0.01 nats (real chain-of-thought: over half under
  0.01, p80 0.67 on Qwen3-8B, arXiv 2506.01939);
* the long responses (the longest tenth, which set a step's length): the share of their 8-grams
  that occurred earlier in the same response (loops recur, reasoning and noise do not), and the
  text of the three longest, to read.

    TORCHDYNAMO_DISABLE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv/bin/python \\
        scripts/length_survey.py --out results/length-survey gsm8k:1.0:1.0 gsm8k:0.7:1.0
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from megatron_bubblespec.data.registry import make_task
from megatron_bubblespec.data.tasks import score
from megatron_bubblespec.machine import machine_info
from megatron_bubblespec.models.smollm2 import load_tokenizer, smollm2_checkpoint
from megatron_bubblespec.rollout.vllm_engine import VLLMEngine
from megatron_bubblespec.sampling import SamplingParams, sample_key
from megatron_bubblespec.sampling.keyed import truncation_mask
from megatron_bubblespec.sampling.requests import RolloutRequest

TASKS = {"gsm8k": dict(name="gsm8k", split="train"), "arithmetic": dict(name="arithmetic"),
         "code": dict(name="code")}


def candidate(text: str) -> tuple[str, float, float]:
    task, temperature, top_p = text.split(":")
    if task not in TASKS:
        raise SystemExit(f"unknown task {task!r}: choose from {sorted(TASKS)}")
    return task, float(temperature), float(top_p)


ENTROPY_CHUNK = 256    # logits rows whose entropy is taken at once (a row is the vocabulary)
REPEAT_N = 8           # n-gram length of the repetition measure
TEXTS = 3              # longest responses whose text is kept


def survey(engine, task, params, prompts: int, samples: int, budget: int, seed: int):
    """Per prompt, the lengths and rewards of its samples (all requests in one batch), and every
    (prompt tokens, response tokens) pair in the same order."""
    picked = [task.prompt(index) for index in range(prompts)]
    requests = [RolloutRequest(f"{prompt.uid}-{s}", prompt.token_ids,
                               sample_key(seed, 0, prompt.uid, s), budget,
                               eos_token_ids=task.eos_token_ids)
                for prompt in picked for s in range(samples)]
    results = engine.generate(requests, params)
    lengths = [len(r.token_ids) for r in results]
    rewards = [x.total for x in score(task, [picked[i // samples] for i in range(len(results))],
                                      [r.token_ids for r in results])]
    pairs = [(list(picked[i // samples].token_ids), list(r.token_ids))
             for i, r in enumerate(results)]
    return (np.asarray(lengths).reshape(prompts, samples),
            np.asarray(rewards).reshape(prompts, samples), pairs)


@torch.no_grad()
def token_entropies(model, pairs, params: SamplingParams) -> np.ndarray:
    """Every response token's sampling entropy in nats (see the module doc), all responses."""
    out = []
    for prompt, response in pairs:
        if not response:
            continue
        ids = torch.tensor([prompt + response])
        logits = model(ids).logits[0, len(prompt) - 1:len(prompt) + len(response) - 1].float()
        for rows in logits.split(ENTROPY_CHUNK):
            scaled = rows / params.temperature
            scaled = scaled.masked_fill(~truncation_mask(scaled, params), float("-inf"))
            logp = torch.log_softmax(scaled, dim=-1)
            out.append(-(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1).numpy())
    return np.concatenate(out) if out else np.zeros(0)


def recurring_share(tokens: list[int], n: int = REPEAT_N) -> float:
    """The share of a response's n-grams that occurred earlier in it."""
    seen, again = set(), 0
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    for gram in grams:
        again += gram in seen
        seen.add(gram)
    return again / len(grams) if grams else 0.0


def text_summary(pairs, entropies: np.ndarray, tokenizer) -> dict:
    """The entropy quantiles and the longest tenth's repetition and texts."""
    by_length = sorted(pairs, key=lambda p: len(p[1]), reverse=True)
    longest = by_length[:max(1, len(pairs) // 10)]
    return {"entropy_mean": float(entropies.mean()), "entropy_p50": float(np.median(entropies)),
            "entropy_p80": float(np.quantile(entropies, 0.8)),
            "entropy_under_0.01": float((entropies < 0.01).mean()),
            "long_recurring_8grams": float(np.mean([recurring_share(r) for _, r in longest])),
            "long_texts": [tokenizer.tokenizer.decode(r) for _, r in by_length[:TEXTS]]}


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
    texts = [r for r in rows if "text" in r]
    if texts:
        lines += ["", "| candidate | token entropy: mean | p50 | p80 | under 0.01 nats | "
                  f"longest tenth: {REPEAT_N}-grams seen before in the response |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['candidate']} | {t['entropy_mean']:.2f} | {t['entropy_p50']:.3f} | "
                  f"{t['entropy_p80']:.2f} | {t['entropy_under_0.01']:.1%} | "
                  f"{t['long_recurring_8grams']:.1%} |" for r in texts for t in [r["text"]]]
        for r in texts:
            lines += ["", f"The longest responses of {r['candidate']} (their first 400 "
                      "characters):", ""]
            lines += ["> " + text[:400].replace("\n", " ") for text in r["text"]["long_texts"]]
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
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer()
    engine = VLLMEngine(smollm2_checkpoint(), max_model_len=args.max_new_tokens + 512,
                        seed=args.seed, kv_cache_memory_bytes=int(args.kv_cache_gb * 1e9))
    model = AutoModelForCausalLM.from_pretrained(smollm2_checkpoint(), dtype=torch.float32)
    rows = []
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "candidates")}
    try:
        for task_name, temperature, top_p in args.candidates:
            label = f"{task_name}, {temperature:g}, {top_p:g}"
            print(label, flush=True)
            task = make_task(**TASKS[task_name], tokenizer=tokenizer)
            params = SamplingParams(temperature, top_p=top_p)
            lengths, rewards, pairs = survey(engine, task, params, args.prompts, args.samples,
                                             args.max_new_tokens, args.seed)
            entropies = token_entropies(model, pairs, params)
            rows.append({"candidate": label, "lengths": lengths.tolist(),
                         "summary": summary(lengths, rewards, args.max_new_tokens, args.ranks,
                                            args.groups, args.seed),
                         "text": text_summary(pairs, entropies, tokenizer)})
            # written after every candidate: a stopped survey keeps what it measured
            (args.out / "survey.json").write_text(json.dumps(
                {"machine": machine_info(), "settings": settings, "rows": rows}) + "\n")
            (args.out / "survey.md").write_text(markdown(rows, args))
    finally:
        engine.shutdown()
    print(markdown(rows, args))


if __name__ == "__main__":
    main()
