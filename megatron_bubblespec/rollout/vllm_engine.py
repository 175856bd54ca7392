"""Requests -> vLLM (prompt + prefix, key in extra_args) -> keyed processor picks tokens -> results.

vLLM runs the model, the KV cache, batching and prefix caching; the *choice* of every token is ours:
the keyed logits processor (``keyed_processor``) forces each row's token to the project's keyed
draw at the row's draw word (its response position, or its context), and vLLM's own sampler,
run greedy (T = 0), merely picks it. Tokens therefore equal plain keyed decoding of the weights.
``keyed=False`` leaves the processor out (vLLM's own sampler: the benchmark's baseline).

Essentials:

* Per-request data travels in ``vllm.SamplingParams.extra_args``: the sample key, the position
  offset (length of the response prefix) and our temperature / top-k / top-p / keying
  (``keyed_processor.EXTRA_ARGS_KEY``), and with speculative continuation or draft verification
  what the request proposes from (``vllm_proposer.POOL_ARGS_KEY``).
* Continuation: a request with a ``response_prefix`` is submitted as prompt + prefix with offset
  ``len(prefix)``; the prefix's logprobs come from ``prompt_logprobs`` (requested only then; vLLM
  skips *reading* the prefix cache for such requests), generated tokens' logprobs from vLLM's raw
  logprobs (``logprobs=0`` returns the sampled token's). Logprobs = log_softmax of the raw logits.
* Step-wise control goes through ``llm.llm_engine`` (add_request / step / abort_request), one vLLM
  request per sample, outputs CUMULATIVE (``vllm_requests.LiveRequest`` takes what is new).
* EOS: ``stop_token_ids = request.eos_token_ids`` with ``ignore_eos=True``, so no tokenizer or
  generation-config EOS is used; ``max_tokens = max_new_tokens - len(prefix)``.
* Weights: ``collective_rpc`` streams the caller's (name, tensor) iterator into
  ``worker.reload_weights(weights_iterator=...)`` on every worker
  (``model.load_weights`` fails on CPU, where weights are repacked after loading), then the prefix
  cache is ALWAYS reset (otherwise cached KV blocks of the old weights are reused).
* Environment (set before vLLM is imported, never overriding what the user set): in-process engine
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), V1 model runner (``VLLM_USE_V2_MODEL_RUNNER=0``), caches
  under ``cache_dir("vllm")``; without CUDA also ``TORCHDYNAMO_DISABLE=1`` plus an eager model
  (vllm-cpu also needs float32, head_dim >= 32 and an explicit ``kv_cache_memory_bytes``).
* Rows independent of their engine step, on CPU: ``VLLM_CPU_ATTN_SPLIT_KV=0`` (set even over the
  user's value) and ``vllm_cpu_rows`` (a step of under four rows computed in a block of four), so
  a position's logits are the same bits in a decode step, a verify step, alone or in company.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable

import torch

from megatron_bubblespec import logs
from megatron_bubblespec.cache import cache_dir
from megatron_bubblespec.config.load import VLLM_MAX_SPEC_TOKENS
from megatron_bubblespec.config.schema import RolloutConfig
from megatron_bubblespec.rollout.base import RolloutEngine
from megatron_bubblespec.rollout.proposal_cost import measure_proposal_cost
from megatron_bubblespec.rollout.vllm_proposer import POOL_ARGS_KEY, PoolProposer, pool_extra_args
from megatron_bubblespec.rollout.vllm_requests import LiveRequest
from megatron_bubblespec.sampling import SamplingParams
from megatron_bubblespec.sampling.requests import RolloutRequest, RolloutResult, settle_eos
from megatron_bubblespec.speculative.continuation import ContinuationSettings, off
from megatron_bubblespec.speculative.sources import has_sources

BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"
CPU_SPLIT_KV_ENV = "VLLM_CPU_ATTN_SPLIT_KV"
# vLLM would otherwise reserve most of the host's RAM: the schema's rollout.kv_cache_mb
DEFAULT_CPU_KV_CACHE_BYTES = RolloutConfig.kv_cache_mb << 20
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def prepare_environment(in_process: bool = True, batch_invariant: bool = False) -> None:
    """Set the variables vLLM reads at import / engine start, keeping any value already set
    except the CPU attention split, which exactness needs off.

    Model Runner V2 (vLLM's GPU default from 0.32 on) has a different logits-processor interface
    (``apply(logits, ctx)`` with ``ctx.pos`` and no ``update_state``) and rejects V1 processors, so
    ``VLLM_USE_V2_MODEL_RUNNER=0`` keeps the V1 runner that ``KeyedLogitsProcessor`` is written for.
    ``batch_invariant`` (``rollout.batch_invariant``) sets ``VLLM_BATCH_INVARIANT=1``: see
    ``check_batch_invariance``.
    """
    if batch_invariant:
        os.environ[BATCH_INVARIANT_ENV] = "1"   # asked for in the config: it wins over the shell
    defaults = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": lambda: "0" if in_process else "1",
        "VLLM_USE_V2_MODEL_RUNNER": lambda: "0",
        "VLLM_CACHE_ROOT": lambda: str(cache_dir("vllm")),
        "TORCHINDUCTOR_CACHE_DIR": lambda: str(cache_dir("vllm", "inductor")),
    }
    if not torch.cuda.is_available():
        # vllm-cpu: vLLM decorates helpers with torch.compile when its modules are imported;
        # compiling them delays the first generate and buys nothing for small batches.
        defaults["TORCHDYNAMO_DISABLE"] = lambda: "1"
        # vllm-cpu splits a one-position query's context over the threads and sums the parts, so
        # a decode row would round otherwise than the same position in a verify row: exactness
        # of BubbleSpec on and off needs every row summed one way (docs/results/identity.md).
        os.environ[CPU_SPLIT_KV_ENV] = "0"
    for name, value in defaults.items():
        if name not in os.environ:
            os.environ[name] = value()


def check_batch_invariance() -> None:
    """Raise unless vLLM's batch-invariant mode is really on in this process (CUDA only).

    With ``VLLM_BATCH_INVARIANT=1`` vLLM swaps in kernels whose result for a row does not depend on
    the batch around it (no split-K matmuls, fixed-order reductions, one attention split), so a
    draft verified inside a spec-decode step (k + 1 positions of a request in one forward) gets the
    logits, bit for bit, that decoding it one token a step would give: in bfloat16 the keyed draws,
    and so the tokens, of BubbleSpec on and off are then identical, near-ties included. vLLM reads
    the variable when its attention modules are imported, so it must be set before the first vLLM
    import of the process (``prepare_environment``, called by the launcher and the engine).
    """
    import sys

    from vllm import envs

    cached = [name for name, module in list(sys.modules.items())
              if name.startswith("vllm.") and getattr(module, "is_batch_invariant", None) is False]
    if not envs.VLLM_BATCH_INVARIANT or cached:
        raise RuntimeError(
            f"rollout.batch_invariant: vLLM was imported before {BATCH_INVARIANT_ENV}=1 was set "
            f"({', '.join(cached) or 'vllm.envs'} read it as 0), so its kernels are the "
            f"batch-dependent ones; export {BATCH_INVARIANT_ENV}=1 before starting the job")


def _refuse_batch_invariance_without_gpu(batch_invariant: bool) -> None:
    if batch_invariant and not torch.cuda.is_available():
        raise RuntimeError("batch_invariant (rollout.batch_invariant) uses vLLM's "
                           "batch-invariant CUDA kernels and this process has no GPU: set "
                           "rollout.batch_invariant=false")


def _llm_arguments(model_path: Path, dtype: str | None, kv_cache_memory_bytes: int | None,
                   skip_tokenizer_init: bool | None, **options: Any) -> dict[str, Any]:
    """``vllm.LLM``'s arguments: ``options`` (seed, prefix caching, tensor parallelism: always
    passed; the others only when set) plus this machine's defaults. CPU: float32 (bfloat16 dies
    with SIGILL on vllm-cpu), a fixed KV cache (``DEFAULT_CPU_KV_CACHE_BYTES``), an eager model.
    ``skip_tokenizer_init`` defaults to "the directory has no tokenizer files"."""
    on_cpu = not torch.cuda.is_available()
    if skip_tokenizer_init is None:
        skip_tokenizer_init = not any((model_path / f).is_file() for f in _TOKENIZER_FILES)
    if on_cpu and kv_cache_memory_bytes is None:
        kv_cache_memory_bytes = DEFAULT_CPU_KV_CACHE_BYTES
    always = ("seed", "enable_prefix_caching", "tensor_parallel_size")
    kwargs: dict[str, Any] = dict(
        model=str(model_path), dtype=dtype or ("float32" if on_cpu else "auto"),
        skip_tokenizer_init=skip_tokenizer_init, use_tqdm_on_load=logs.verbose(),
        logprobs_mode="raw_logprobs",
        **{name: value for name, value in options.items() if name in always or value is not None})
    if kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
    if on_cpu:
        # With dynamo disabled vLLM still asks torch.compile for an AOT artefact of the model
        # and fails ("aot_compile is not supported"): run the model eagerly.
        kwargs["enforce_eager"] = True
    elif options.get("tensor_parallel_size", 1) > 1 and _is_moe(model_path):
        # vLLM's expert parallelism: each GPU of the engine holds whole experts, its share of
        # them, instead of a tensor-parallel slice of every expert
        kwargs["enable_expert_parallel"] = True
    return kwargs


def _is_moe(model_path: Path) -> bool:
    from megatron_bubblespec.models.architecture import check_checkpoint

    return check_checkpoint(model_path).is_moe


def _speculative_config(spec_k: int) -> dict[str, Any]:
    """vLLM's spec-decode step with ``PoolProposer`` proposing, patched to verify keyed tokens."""
    from megatron_bubblespec.rollout import vllm_patches

    vllm_patches.install()
    return {"method": "custom_class", "model": f"{PoolProposer.__module__}.PoolProposer",
            "num_speculative_tokens": int(spec_k)}


def _reload_weights_on_worker(worker, weights) -> None:
    """Runs on each vLLM worker (module level, so it pickles for multi-process executors);
    ``weights``: (name, tensor) pairs, an iterator in process, a list across processes, or a
    name -> tensor mapping."""
    pairs = weights.items() if isinstance(weights, dict) else weights
    worker.reload_weights(weights_iterator=iter(pairs))


def _pop_continuation_counts(worker,
                             vllm_ids: list[str]) -> dict[str, dict[str, tuple[int, int]]]:
    """Runs on each vLLM worker: the proposer's totals for these requests (see ``PoolProposer``)."""
    return worker.model_runner.drafter.pop_counts(vllm_ids)


class VLLMEngine(RolloutEngine):
    """Keyed rollouts on vLLM (CPU via vllm-cpu, or CUDA), preemptible and weight-updatable.

    ``distributed_executor_backend="external_launcher"`` makes every torchrun rank build its own
    engine over the already-initialised process group (TP > 1 in the SPMD style). Extra keyword
    arguments go to ``vllm.LLM``.

    ``keyed=False`` leaves the keyed processor out: vLLM's own sampler draws every token at
    the requests' temperature / top-k / top-p (the same prompts, token counts and logprobs).
    Its tokens are not the keyed draws, so drafts cannot be verified against them: it is the
    plain-vLLM baseline of the engine benchmark, not a rollout engine for training.

    ``continuation`` (``speculative.continuation.ContinuationSettings``; none: no speculation): with
    ``enabled`` requests propose up to ``k`` tokens per engine step from their ``sources``
    (``speculative.pool``: the prompt's bubble drafts, the prompt, their own text; n-grams of
    ``min_match`` .. ``max_match`` tokens), verified exactly inside vLLM's spec-decode step
    (``vllm_proposer``, ``vllm_patches``); with a ``token_cost`` each request chooses how many to
    propose from its acceptance (``speculative.pool.Continuation``).

    ``continuation.verify_drafts`` (``spec.verifier: engine``): a request's own ``draft`` is
    proposed after its prefill, whole or ``VLLM_MAX_SPEC_TOKENS`` (vLLM's rejection sampler's
    limit) tokens a step, and verified by the same keyed spec-decode step, in the engine's own
    forward: the prompt is prefilled once and the accepted prefix is never prefilled again.

    ``continuation.reuse_draft_kv`` (``ablation.reuse_draft_kv``): a weight update keeps the
    prefix cache. Every request's cached KV is salted: a rollout request's with the weight
    version, so it only ever meets KV of the weights it runs on (as after a cache reset); a
    drafting request's (``RolloutRequest.drafting``) with one salt for all versions, so a later
    bubble extends a partial draft on the KV of its prompt and earlier tokens instead of
    prefilling them again.

    ``batch_invariant`` (``rollout.batch_invariant``, CUDA): vLLM's batch-invariant kernels, so
    that drafts verified in a spec-decode step draw the tokens of one-token decoding in bfloat16
    too (``check_batch_invariance``).
    """

    def __init__(self, model_path: str | Path, *, keyed: bool = True, dtype: str | None = None,
                 kv_cache_memory_bytes: int | None = None, max_model_len: int | None = None,
                 seed: int = 0, enable_prefix_caching: bool = True,
                 tensor_parallel_size: int = 1, distributed_executor_backend: str | None = None,
                 skip_tokenizer_init: bool | None = None, in_process: bool = True,
                 gpu_memory_utilization: float | None = None,
                 continuation: ContinuationSettings | None = None, batch_invariant: bool = False,
                 **llm_kwargs: Any) -> None:
        """Start an engine on the HF directory ``model_path`` (the options: see the class)."""
        _refuse_batch_invariance_without_gpu(batch_invariant)
        prepare_environment(in_process=in_process, batch_invariant=batch_invariant)
        from vllm import LLM

        if batch_invariant:
            check_batch_invariance()
        self.continuation = continuation = continuation or off()
        if not keyed and (continuation.enabled or continuation.verify_drafts):
            raise ValueError("speculative continuation and draft verification force keyed "
                             "tokens: they need keyed=True")
        self.keyed, self.batch_invariant = keyed, batch_invariant
        # drafting requests get logprobs too: only to inspect what a draft was computed on (the
        # KV it met), as a draft itself is its tokens only
        self.drafting_logprobs = False
        self.model_path = Path(model_path)
        kwargs = _llm_arguments(
            self.model_path, dtype, kv_cache_memory_bytes, skip_tokenizer_init, seed=seed,
            enable_prefix_caching=enable_prefix_caching, tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
            distributed_executor_backend=distributed_executor_backend)
        if keyed:
            from megatron_bubblespec.rollout.keyed_processor import KeyedLogitsProcessor

            kwargs["logits_processors"] = [KeyedLogitsProcessor]
        if continuation.enabled or continuation.verify_drafts:
            kwargs["speculative_config"] = _speculative_config(continuation.k)
        if not torch.cuda.is_available():
            from megatron_bubblespec.rollout import vllm_cpu_rows, vllm_moe_reload

            vllm_moe_reload.install()   # weight updates of CPU MoE layers repack the experts
            if keyed:   # a one-row step rounds as a step of many rows (plain vLLM: as it is)
                vllm_cpu_rows.install()
        self.llm = LLM(**{**kwargs, **llm_kwargs})
        self._engine = self.llm.llm_engine
        self.max_model_len = self._engine.model_config.max_model_len
        self.weight_version = 0
        self._live: dict[str, LiveRequest] = {}
        self._in_process = self._workers_in_process()

    @property
    def dtype(self) -> str:
        return str(self._engine.model_config.dtype).removeprefix("torch.")

    @property
    def prefix_caching(self) -> bool:
        return bool(self._engine.vllm_config.cache_config.enable_prefix_caching)

    # -------------------------------------------------------------------------------- requests

    def _vllm_params(self, request: RolloutRequest, params: SamplingParams, prefix_complete: bool):
        from vllm import SamplingParams as VLLMSamplingParams

        n_prefix = len(request.response_prefix)
        max_tokens = 1 if prefix_complete else request.max_new_tokens - n_prefix
        if not self.keyed:   # vLLM's own sampler
            return VLLMSamplingParams(
                n=1, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                max_tokens=max_tokens, stop_token_ids=list(request.eos_token_ids),
                ignore_eos=True, logprobs=0, prompt_logprobs=0 if n_prefix else None,
                detokenize=False)
        return VLLMSamplingParams(
            n=1, temperature=0.0,   # greedy: vLLM's sampler takes the token the processor forced
            max_tokens=max_tokens,
            stop_token_ids=list(request.eos_token_ids), ignore_eos=True,
            # a drafting request asks for none: vLLM's logprobs of a spec-decode step take two
            # more full-vocabulary copies of its logits, and a batch of drafts needs none
            logprobs=None if request.drafting and not self.drafting_logprobs else 0,
            prompt_logprobs=0 if n_prefix and not request.drafting else None,
            detokenize=False, extra_args=self._extra_args(request, params, prefix_complete))

    def _extra_args(self, request: RolloutRequest, params: SamplingParams,
                    prefix_complete: bool) -> dict[str, Any]:
        """The request's key for the keyed processor and, when it proposes, its pool for the
        proposer."""
        from megatron_bubblespec.rollout.keyed_processor import EXTRA_ARGS_KEY, keyed_extra_args

        extra_args = {EXTRA_ARGS_KEY: keyed_extra_args(params, request.key,
                                                       len(request.response_prefix))}
        proposals, c = request.proposals, self.continuation
        pooled = c.enabled and has_sources(c.sources, proposals.drafts, proposals.history)
        if not prefix_complete and (pooled or request.draft):
            extra_args[POOL_ARGS_KEY] = pool_extra_args(
                len(request.prompt_token_ids), c if c.enabled else replace(c, sources=()),
                proposals.drafts if pooled else [], draft=request.draft,
                draft_k=VLLM_MAX_SPEC_TOKENS, history=proposals.history if pooled else [],
                own_draft=proposals.own if pooled else None)
        return extra_args

    def add(self, requests: Iterable[RolloutRequest], params: SamplingParams) -> None:
        requests = list(requests)
        complete = self._check_new(requests)   # everything checked before anything is submitted
        for request, prefix_complete in zip(requests, complete):
            prompt = {"prompt_token_ids": list(request.prompt_token_ids)
                      + list(request.response_prefix)}
            if self.continuation.reuse_draft_kv:
                prompt["cache_salt"] = ("drafts" if request.drafting
                                        else f"weights-{self.weight_version}")
            vllm_params = self._vllm_params(request, params, prefix_complete)
            vllm_id = self._engine.add_request(request.request_id, prompt, vllm_params)
            self._live[request.request_id] = LiveRequest(
                request, vllm_id, prefix_complete,
                pooled=POOL_ARGS_KEY in (vllm_params.extra_args or {}))

    def _check_new(self, requests: list[RolloutRequest]) -> list[bool]:
        """Refuse clashing ids, an EOS inside a prefix and a draft this engine cannot verify;
        per request, whether its prefix already ends the response."""
        ids = [r.request_id for r in requests]
        clash = sorted(set(ids) & set(self._live)) or sorted({i for i in ids if ids.count(i) > 1})
        if clash:
            raise ValueError(f"request ids already in use: {clash}; ids must be unique among "
                             "unfinished requests")
        complete = []
        for request in requests:
            prefix = request.response_prefix
            kept, ended = settle_eos(prefix, request.eos_token_ids)
            if kept < len(prefix):
                raise ValueError(f"request {request.request_id!r}: EOS inside the response "
                                 f"prefix at position {kept - 1}; a prefix may only end with EOS")
            complete.append(len(prefix) >= request.max_new_tokens or ended)
            if request.draft and not self.continuation.verify_drafts:
                raise ValueError(f"request {request.request_id!r} carries a draft to verify, and "
                                 "this engine was built without verify_drafts (spec."
                                 "verifier: engine); verify it first, or build the engine so")
        return complete

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def measure_proposal_cost(self, rows: int, verify_steps: int = 8, repeats: int = 2,
                              seed: int = 0) -> float:
        """Measure what one proposed token costs at ``rows`` requests and propose by it from now
        on (``rollout.proposal_cost``: how, and why it never changes a token)."""
        return measure_proposal_cost(self, self._engine.model_config.get_vocab_size(), rows,
                                     verify_steps, repeats, seed)

    def step(self) -> list[RolloutResult]:
        if self._in_process:
            _require_vllm_parallel_state()
        ended = []
        for output in self._engine.step():
            live = self._live.get(output.request_id)
            if live is None:
                continue
            live.absorb(output)
            if output.finished:
                del self._live[output.request_id]
                ended.append((live, output.outputs[0].finish_reason))
        self._collect_continuation([live for live, _ in ended])
        return [live.result(reason) for live, reason in ended]

    def abort(self, request_ids: Iterable[str] | None = None) -> list[RolloutResult]:
        ids = list(self._live if request_ids is None else
                   dict.fromkeys(i for i in request_ids if i in self._live))
        if not ids:
            return []
        self._engine.abort_request([self._live[i].vllm_id for i in ids], internal=True)
        ended = [self._live.pop(i) for i in ids]
        self._collect_continuation(ended)
        return [live.result("abort") for live in ended]

    def _collect_continuation(self, ended: list[LiveRequest]) -> None:
        """Fetch the proposer's (proposed, accepted) totals of requests that just ended."""
        pooled = {live.vllm_id: live for live in ended if live.pooled}
        if not pooled:
            return
        counts = self.llm.collective_rpc(_pop_continuation_counts, args=(list(pooled),))[0]
        for vllm_id, live in pooled.items():
            live.continuation = dict(counts.get(vllm_id, {}))

    def shutdown(self) -> None:
        """Stop the engine core now (idempotent). vLLM's teardown also destroys the default
        torch.distributed group when it shares it, so call this after the job's last collective
        and before destroying the process groups (at interpreter exit it would fail instead)."""
        core = getattr(self.llm.llm_engine, "engine_core", None)
        if core is not None:
            core.shutdown()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       version: int | None = None) -> None:
        """Stream (name, tensor) pairs into vLLM's in-place reload, one tensor at a time.

        With in-process workers (the default, and ``external_launcher``) the iterator itself goes
        to ``reload_weights``, so no more than the caller's current bucket is held at once. A
        multi-process executor pickles its arguments: there the tensors cross as one list.
        """
        if self._live:
            raise RuntimeError(f"update_weights with {len(self._live)} unfinished requests: "
                               "abort or finish them first")
        hf_config = self.llm.llm_engine.model_config.hf_config
        tied = getattr(hf_config, "tie_word_embeddings", False)
        weights = _with_tied_lm_head(named_tensors, tied)
        if not self._workers_in_process():
            weights = list(weights)
        self.llm.collective_rpc(_reload_weights_on_worker, args=(weights,))
        # with reuse_draft_kv the salts (cache_salt) keep rollouts off KV of other weights
        if not self.continuation.reuse_draft_kv and not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after the weight update")
        self._loaded(version)

    def sleep(self, level: int = 1) -> None:
        """Free this engine's GPU memory while Megatron trains (``rollout.sleep_during_train``;
        the engine must be built with ``enable_sleep_mode=True``): level 1 drops the KV cache and
        moves the weights to the host, level 2 drops both; either clears the prefix cache, drafts'
        KV kept by ``reuse_draft_kv`` included. No request may be running."""
        if self._live:
            raise RuntimeError(f"sleep with {len(self._live)} unfinished requests: abort or "
                               "finish them first")
        if not torch.cuda.is_available():
            raise RuntimeError("vLLM's sleep mode frees CUDA memory; there is no GPU here")
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Reallocate what ``sleep`` freed: ``["weights"]`` before a weight update,
        ``["kv_cache"]`` after it, or everything (None)."""
        self.llm.wake_up(tags)

    def _workers_in_process(self) -> bool:
        core = getattr(self._engine.engine_core, "engine_core", None)   # in-process client only
        executor = getattr(core, "model_executor", None)
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        return isinstance(executor, UniProcExecutor)


def _require_vllm_parallel_state() -> None:
    """vLLM keeps its distributed groups per process, and an in-process engine's teardown (its
    ``shutdown``, or its garbage collection) destroys them for every other engine that shares the
    process: name that instead of failing deep inside the worker."""
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if not model_parallel_is_initialized():
        raise RuntimeError(
            "vLLM's distributed state in this process is gone: another in-process VLLMEngine was "
            "shut down or garbage-collected while this one was still in use. Keep every engine of "
            "a process alive until the last one is done (or start a new engine after the other "
            "one is gone).")


def _with_tied_lm_head(named_tensors: Iterable[tuple[str, torch.Tensor]], tied: bool):
    """The pairs as they come, plus ``lm_head.weight`` = the embedding when the model ties them.

    vLLM's layer-wise reload loads the LM head as its own module: with tied embeddings and no
    lm_head tensor it keeps the OLD head ("ParallelLMHead: Failed to load weights"), so the engine
    would sample from a stale policy. The tie is sent explicitly, right after the embedding.
    """
    sent_head = False
    for name, tensor in named_tensors:
        sent_head |= name == "lm_head.weight"
        yield name, tensor
        if tied and name == "model.embed_tokens.weight" and not sent_head:
            sent_head = True
            yield "lm_head.weight", tensor
