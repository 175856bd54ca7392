"""vLLM's sampled tokens per batch row -> each request's ``Continuation`` -> next step's proposals.

vLLM's ``custom_class`` speculative method builds ``PoolProposer(vllm_config)`` inside the model
runner and calls ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, ...)`` after every
engine step; it returns one list of proposed token ids per batch row (empty allowed). The call
carries no request ids, so the proposer keeps the runner that built it (found by walking up the
call frames of ``__init__``) and reads ``runner.input_batch.req_ids`` and each request's sampling
params. A request takes part when its ``extra_args[POOL_ARGS_KEY]`` holds the prompt's drafts,
the proposal sources and the continuation options, or its own draft to verify (``spec.verifier:
engine``: proposed first, up to ``VLLM_MAX_SPEC_TOKENS`` a step, so the engine verifies it in its
own forward); the proposals and the adaptive pause are
``speculative.pool.Continuation``'s, the same object the reference engine uses, so both engines
propose the same tokens.

Each row's sampled tokens settle the proposal made for it one step earlier: all but the last were
accepted (vLLM's greedy rejection sampler, run on the keyed tokens, see ``vllm_patches``), counted
up to the response's first EOS. The engine collects the totals per source with ``pop_counts``
(through ``collective_rpc``) when a request finishes or is aborted.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from megatron_bubblespec.sampling.requests import settle_eos
from megatron_bubblespec.speculative.continuation import ContinuationSettings
from megatron_bubblespec.speculative.pool import Continuation, Siblings

POOL_ARGS_KEY = "bubblespec_pool"


def pool_extra_args(prompt_len: int, settings: ContinuationSettings, drafts: list[list[int]],
                    draft: list[int] = (), draft_k: int | None = None,
                    history: list[list[int]] = (), own_draft: int | None = None) -> dict:
    """What a request carries in ``SamplingParams.extra_args[POOL_ARGS_KEY]`` (``prompt_len``:
    the prompt's length without the response prefix that vLLM receives as part of it;
    ``settings``: the engine's, whose sources, match lengths, k and token cost it proposes by;
    ``draft``: the sample's own draft to verify, in response positions, ``draft_k`` of its tokens a
    step; ``history``: the prompt's earlier responses; ``own_draft``: the place of the sample's
    own draft in ``drafts``)."""
    return {"prompt_len": int(prompt_len), "drafts": [list(d) for d in drafts],
            "k": int(settings.k), "suffix_k": int(settings.suffix_k),
            "min_match": int(settings.min_match),
            "max_match": int(settings.max_match), "sources": list(settings.sources),
            "draft": [int(t) for t in draft], "draft_k": draft_k,
            "token_cost": settings.token_cost, "history": [list(h) for h in history],
            "own_draft": own_draft}


@dataclass
class _Request:
    continuation: Continuation
    eos_token_ids: frozenset[int]
    prompt_len: int
    siblings: Siblings    # the registry of its prompt's shared index
    pending: list[int] = field(default_factory=list)   # proposed for the step now running
    written: int = 0      # response tokens in the prompt's index (up to the first EOS)
    ended: bool = False   # an EOS was written


def _model_runner():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    frame = inspect.currentframe()
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, GPUModelRunner):
            return candidate
        frame = frame.f_back
    raise RuntimeError("PoolProposer must be built by vLLM's model runner (speculative_config "
                       "method 'custom_class')")


class PoolProposer:
    """vLLM ``custom_class`` proposer over each request's draft pool (see the module doc)."""

    def __init__(self, vllm_config) -> None:
        from megatron_bubblespec.rollout import vllm_patches

        vllm_patches.install()   # the runner builds its logits processors after its proposer
        self.runner = _model_runner()
        self.requests: dict[str, _Request] = {}
        self.finished: dict[str, dict] = {}   # request id -> source -> (proposed, accepted)
        # the prompts' shared indexes, one registry per request settings (match lengths, sources)
        self.siblings: dict[tuple, Siblings] = {}

    def load_model(self, *args, **kwargs) -> None:
        """Nothing to load (vLLM's CPU runner calls this for every proposer)."""

    def _request(self, request_id: str) -> _Request | None:
        state = self.requests.get(request_id)
        if state is not None:
            return state
        cached = self.runner.requests.get(request_id)
        params = cached.sampling_params if cached is not None else None
        pool_args = (params.extra_args or {}).get(POOL_ARGS_KEY) if params is not None else None
        if not pool_args:
            return None
        # vLLM's prompt holds the response prefix too
        prompt = cached.prompt_token_ids[:pool_args["prompt_len"]]
        settings = (pool_args["min_match"], pool_args["max_match"], tuple(pool_args["sources"]),
                    pool_args["suffix_k"])
        if settings not in self.siblings:
            self.siblings[settings] = Siblings(*settings)
        siblings = self.siblings[settings]
        pool = siblings.pool(request_id, prompt, pool_args["drafts"], pool_args.get("history", ()),
                             pool_args.get("own_draft"))
        draft = pool_args.get("draft") or ()
        if not pool and not draft:
            siblings.leave(request_id)
            return None
        state = _Request(Continuation(pool, pool_args["k"], draft, pool_args.get("draft_k"),
                                      token_cost=pool_args.get("token_cost")),
                         frozenset(params.stop_token_ids or ()), len(prompt), siblings)
        self.requests[request_id] = state
        return state

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, **_) -> list[list[int]]:
        self._retire()   # before anyone joins a prompt's index: finished requests leave it
        batch = self.runner.input_batch
        rows = list(enumerate(batch.req_ids[:len(sampled_token_ids)]))
        # every sample's new tokens first (request-id order), then the proposals: each sees its
        # siblings' texts as of this step, whatever the batch's row order
        for row, request_id in sorted(rows, key=lambda r: r[1]):
            state = self._request(request_id)
            if state is None or not sampled_token_ids[row] or state.ended:
                continue
            start = state.prompt_len + state.written
            new = token_ids_cpu[row, start:int(num_tokens_no_spec[row])].tolist()
            kept, state.ended = settle_eos(new, state.eos_token_ids)   # none after an EOS
            state.continuation.pool.extend(new[:kept])
            state.written += kept
        proposals: list[list[int]] = []
        for row, request_id in rows:
            state = self._request(request_id)
            sampled = sampled_token_ids[row]
            if state is None or not sampled:   # no pool, or a prefill chunk that emitted nothing
                proposals.append([])
                continue
            if state.pending:
                # accepted proposal tokens the response keeps: none after its first EOS
                accepted, _ = settle_eos(state.pending[:len(sampled) - 1], state.eos_token_ids)
                state.continuation.record(state.pending, accepted)
            n_tokens = int(num_tokens_no_spec[row])
            generated = n_tokens - int(batch.num_prompt_tokens[row])
            max_tokens = self.runner.requests[request_id].sampling_params.max_tokens
            text = token_ids_cpu[row, :state.prompt_len + state.written]   # as written (a view)
            state.pending = state.continuation.propose(text, max_tokens - generated - 1)
            proposals.append(list(state.pending))
        self._retire()
        return proposals

    def _retire(self) -> None:
        """Move the totals of requests the runner no longer holds to ``finished``."""
        for request_id in [r for r in self.requests if r not in self.runner.requests]:
            self.finished[request_id] = self._leave(request_id)

    def _leave(self, request_id: str) -> dict[str, tuple[int, int]]:
        state = self.requests.pop(request_id)
        state.siblings.leave(request_id)
        return state.continuation.by_source()

    def pop_counts(self, request_ids) -> dict[str, dict[str, tuple[int, int]]]:
        """Per request id, (proposed, accepted) tokens per source, forgetting them (finished or
        aborted requests)."""
        counts = {}
        for request_id in request_ids:
            done = self.finished.pop(request_id, None)
            if request_id in self.requests:
                done = self._leave(request_id)
            if done is not None:
                counts[request_id] = done
        return counts

