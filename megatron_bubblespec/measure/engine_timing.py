"""Engine + prompt plan -> warm-up and timed add/step runs (engines in ABBA turns) -> summary rows.

The timing half of ``engine_bench``: the prompts of every run, one run's add + step loop and its
accounting, a phase's runs, the per-(engine, batch size) rows and the keyed / plain comparison.
"""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from megatron_bubblespec.machine import load_average

if TYPE_CHECKING:   # torch and the engines are imported when used
    from megatron_bubblespec.rollout.base import RolloutEngine
    from megatron_bubblespec.sampling import SamplingParams

PROMPTS = ("random", "gsm8k")
FIRST_PROMPT_TOKEN = 3       # prompts avoid the low ids (pad / bos / eos of the tiny and HF models)


def _prompts(vocab_size: int, batch: int, prompt_len: int, seed: int, run: int) -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(seed * 1_000_003 + batch * 1009 + run)
    high = max(vocab_size, FIRST_PROMPT_TOKEN + 1)
    prompts = torch.randint(FIRST_PROMPT_TOKEN, high, (batch, prompt_len), generator=generator)
    return prompts.tolist()


def _gsm8k_prompts(model: str | Path, path: Path, seed: int) -> Callable[[int], list[list[int]]]:
    """``take(n)``: the chat-template token ids of the next ``n`` GSM8K training questions, in a
    seeded shuffled order (no question twice before all were used)."""
    import torch

    from megatron_bubblespec.data.tasks import GSM8KTask

    if str(model) == "smollm2":
        from megatron_bubblespec.models.smollm2 import load_tokenizer

        tokenizer = load_tokenizer()
    elif str(model) == "tiny":
        raise ValueError("--prompts gsm8k needs a model with a tokenizer and a chat template "
                         "(smollm2 or an HF directory), not the tiny random model")
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    task = GSM8KTask("train", tokenizer)
    order = torch.randperm(task.size, generator=torch.Generator().manual_seed(seed)).tolist()
    cursor = 0

    def take(n: int) -> list[list[int]]:
        nonlocal cursor
        picked = [order[(cursor + i) % task.size] for i in range(n)]
        cursor += n
        return [list(task.prompt(index).token_ids) for index in picked]

    return take


def prompt_plan(prompts: str, model: str | Path, path: Path, vocab_size: int,
                batch_sizes: Sequence[int], prompt_len: int, repeats: int,
                seed: int) -> dict[int, list[list[list[int]]]]:
    """batch size -> the prompts of its warm-up run and of each timed run (the same for every
    engine)."""
    if prompts == "random":
        return {b: [_prompts(vocab_size, b, prompt_len, seed, run) for run in range(repeats + 1)]
                for b in batch_sizes}
    if prompts != "gsm8k":
        raise ValueError(f"unknown prompts {prompts!r}: choose from {PROMPTS}")
    take = _gsm8k_prompts(model, path, seed)
    return {b: [take(b) for _ in range(repeats + 1)] for b in batch_sizes}


def time_run(engine: RolloutEngine, prompts: list[list[int]], new_tokens: int,
             params: SamplingParams, *, seed: int, tag: str) -> dict[str, Any]:
    """One add + step loop to completion -> add time, every step's time, the results' accounting."""
    from megatron_bubblespec.sampling.requests import RolloutRequest
    from megatron_bubblespec.sampling import sample_key

    requests = [RolloutRequest(f"bench-{tag}-{i}", prompt, sample_key(seed, 0, tag, i),
                               new_tokens) for i, prompt in enumerate(prompts)]
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        cpu_start = time.process_time()
        start = time.perf_counter()
        engine.add(requests, params)
        add_s = time.perf_counter() - start
        step_s: list[float] = []
        results = []
        while engine.has_unfinished():
            t0 = time.perf_counter()
            results += engine.step()
            step_s.append(time.perf_counter() - t0)
        total_s = time.perf_counter() - start
        cpu_s = time.process_time() - cpu_start
    finally:
        if gc_was_enabled:
            gc.enable()
    by_id = {r.request_id: r for r in results}
    missing = [r.request_id for r in requests if r.request_id not in by_id]
    if missing:
        raise RuntimeError(f"engine finished without results for {missing}")
    results = [by_id[r.request_id] for r in requests]
    bad = [(r.request_id, len(r.token_ids), r.finish_reason) for r in results
           if len(r.token_ids) != new_tokens or r.finish_reason != "length"]
    if bad:
        raise RuntimeError(f"requests did not generate exactly {new_tokens} tokens: {bad[:4]}")
    decode_steps = sorted({r.decode_steps for r in results})
    if len(decode_steps) != 1:
        raise RuntimeError(f"requests of one batch took different decode steps: {decode_steps}")
    n_decode = decode_steps[0]
    n_prefill = len(step_s) - n_decode
    if n_prefill < 1:
        raise RuntimeError(f"{len(step_s)} engine steps for {n_decode} decode steps")
    return {"add_s": add_s, "step_s": step_s, "prefill_steps": n_prefill,
            "prefill_s": sum(step_s[:n_prefill]), "decode_step_s": step_s[n_prefill:],
            "decode_steps": n_decode, "total_s": total_s, "cpu_s": cpu_s,
            "prompt_tokens": sum(len(p) for p in prompts),
            "generated_tokens": sum(len(r.token_ids) for r in results)}


def _quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default) of a non-empty sequence."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarise(engine_name: str, dtype: str, batch: int, new_tokens: int,
              runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row: ``prompt_len`` is the mean prompt length (exact for random prompts) and
    ``prefill_tokens`` the median over runs of the batch's prompt tokens."""
    decode = [t for run in runs for t in run["decode_step_s"]]
    total = statistics.median(run["total_s"] for run in runs)
    prefill = statistics.median(run["prefill_s"] for run in runs)
    prefill_tokens = statistics.median(run["prompt_tokens"] for run in runs)
    generated = runs[0]["generated_tokens"]
    prompt_len = prefill_tokens / batch
    return {
        "engine": engine_name, "dtype": dtype, "batch_size": batch, "repeats": len(runs),
        "prompt_len": int(prompt_len) if prompt_len == int(prompt_len) else prompt_len,
        "new_tokens": new_tokens,
        "prefill_tokens": prefill_tokens,
        "prefill_s": prefill,
        "prefill_tokens_per_s": prefill_tokens / prefill,
        "prefill_engine_steps": runs[0]["prefill_steps"],
        "decode_step_median_s": statistics.median(decode),
        "decode_step_p90_s": _quantile(decode, 0.9),
        "decode_step_mean_s": statistics.fmean(decode),
        "decode_step_min_s": min(decode),
        "decode_step_samples": len(decode),
        "decode_steps": runs[0]["decode_steps"],
        "engine_steps": len(runs[0]["step_s"]),
        "generated_tokens": generated,
        "total_s": total,
        "tokens_per_s": generated / total,
        "cpu_s": statistics.median(run["cpu_s"] for run in runs),
        "tokens_per_cpu_s": generated / statistics.median(run["cpu_s"] for run in runs),
        "loadavg_1_5_15": load_average(),   # when the row's last run ended
        "runs": [{"add_s": run["add_s"], "prefill_s": run["prefill_s"],
                  "decode_step_s": run["decode_step_s"], "total_s": run["total_s"],
                  "cpu_s": run["cpu_s"], "prompt_tokens": run["prompt_tokens"]}
                 for run in runs],
    }


def compare_keyed_plain(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per batch size with a ``vllm`` and a ``plain`` row: keyed / plain tokens/s (of the rows'
    medians), the median over runs of the paired ratio plain run time / keyed run time (run ``r``
    of both engines ran back to back on the same prompts), and keyed / plain tokens per CPU
    second (the process's CPU time: on a shared machine it follows the work done, where wall
    time follows the other processes too)."""
    plain = {r["batch_size"]: r for r in rows if r["engine"] == "plain"}
    out = []
    for keyed in (r for r in rows if r["engine"] == "vllm"):
        other = plain.get(keyed["batch_size"])
        if other is None:
            continue
        paired = [p["total_s"] / k["total_s"] for k, p in zip(keyed["runs"], other["runs"])]
        out.append({"batch_size": keyed["batch_size"],
                    "keyed_tokens_per_s": keyed["tokens_per_s"],
                    "plain_tokens_per_s": other["tokens_per_s"],
                    "keyed_over_plain": keyed["tokens_per_s"] / other["tokens_per_s"],
                    "paired_run_ratio_median": statistics.median(paired),
                    "keyed_over_plain_cpu": keyed["tokens_per_cpu_s"] / other["tokens_per_cpu_s"],
                    "keyed_decode_step_median_s": keyed["decode_step_median_s"],
                    "plain_decode_step_median_s": other["decode_step_median_s"],
                    "loadavg_1_5_15": keyed["loadavg_1_5_15"]})
    return out


def time_phase(engines: dict[str, RolloutEngine], plan: dict[int, list[list[list[int]]]],
               new_tokens: int, params: SamplingParams, seed: int,
               say: Callable[[str], None], dtypes: dict[str, str]) -> list[dict[str, Any]]:
    """Per batch size: a warm-up run of every engine, then the timed runs, the engines taking
    turns in ABBA order (run r of every engine on the same prompts)."""
    rows = []
    kinds = list(engines)
    for batch, run_prompts in plan.items():
        say(f"{', '.join(kinds)}: batch {batch} (1 warm-up + {len(run_prompts) - 1} timed runs"
            + (" each, interleaved)" if len(kinds) > 1 else ")"))
        for kind in kinds:
            time_run(engines[kind], run_prompts[0], new_tokens, params, seed=seed,
                     tag=f"{kind}-b{batch}-warmup")
        runs: dict[str, list] = {kind: [] for kind in kinds}
        for run in range(1, len(run_prompts)):
            for kind in (kinds if run % 2 else kinds[::-1]):
                runs[kind].append(time_run(engines[kind], run_prompts[run], new_tokens, params,
                                           seed=seed, tag=f"{kind}-b{batch}-r{run}"))
        rows += [summarise(kind, dtypes[kind], batch, new_tokens, runs[kind]) for kind in kinds]
    return rows
