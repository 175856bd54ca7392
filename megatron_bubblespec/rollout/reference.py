"""Reference engine: requests -> keyed generation on the plain-torch model -> results (the oracle).

Batched KV-cache decoding in float32 or float64, with the project's keyed sampler at absolute
response positions. Each ``step`` prefills newly added requests (their first token comes from the
prefill) and gives every running request one decode forward. With speculative continuation on, a
running request whose proposal index (``speculative.pool``) has a match proposes up to ``spec_k``
tokens, and the same forward verifies them with the keyed rule (``speculative.verify_keyed``):
rejected proposals cost nothing but the wasted columns, since the slot's length is simply not
advanced past them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch

from megatron_bubblespec.sampling.draw_words import ResponseWords
from megatron_bubblespec.models.architecture import load_checkpoint
from megatron_bubblespec.rollout.base import RolloutEngine
from megatron_bubblespec.rollout.reference_verify import verify_with_model
from megatron_bubblespec.sampling.requests import RolloutRequest, RolloutResult, settle_eos
from megatron_bubblespec.rollout.torch_llama import TorchLlama
from megatron_bubblespec.sampling import SamplingParams
from megatron_bubblespec.speculative.continuation import ContinuationSettings, off
from megatron_bubblespec.speculative.pool import Continuation, Siblings
from megatron_bubblespec.speculative.sources import has_sources
from megatron_bubblespec.speculative.rules import KEYED, RuleChoice
from megatron_bubblespec.speculative.verify import pad_words, verify_keyed
from megatron_bubblespec.tokens import pad_token_rows


@dataclass
class _Running:
    request: RolloutRequest
    params: SamplingParams
    slot: int
    response: list[int]
    logprobs: list[float] = field(default_factory=list)
    cached: int = 0            # tokens of prompt + response whose keys/values are in the slot
    decode_steps: int = 0
    continuation: Continuation | None = None
    finish_reason: str | None = None
    words: ResponseWords | None = None   # the draw words of the response's next tokens

    @property
    def context(self) -> list[int]:
        return self.request.prompt_token_ids + self.response


def _logprobs_of(logits: torch.Tensor, tokens: list[int]) -> list[float]:
    """log_softmax(logits[j])[tokens[j]] for logits [n, V], without a log-softmax copy of [n, V]."""
    if not tokens:
        return []
    logits = logits[:len(tokens)].float()
    chosen = logits.gather(-1, torch.tensor(tokens).view(-1, 1)).squeeze(-1)
    return (chosen - torch.logsumexp(logits, dim=-1)).tolist()


class ReferenceEngine(RolloutEngine):
    """The oracle: keyed generation on the plain-torch model, with verification before the
    rollout (``verify``); no sleep mode, no prefix cache."""

    def __init__(self, model_path: str | Path, *, dtype: torch.dtype = torch.float32,
                 max_model_len: int | None = None,
                 continuation: ContinuationSettings | None = None,
                 keep_previous_weights: bool = False):
        """``continuation``: what requests propose from (``speculative.continuation``; none:
        nothing); ``keep_previous_weights``: also hold the policy before the latest
        ``update_weights`` (``previous_model``), the drafting policy that the residual and lenient
        rules need."""
        arch, tensors = load_checkpoint(model_path)
        self.model = TorchLlama(arch, tensors, dtype=dtype, max_model_len=max_model_len)
        self.previous_model = (TorchLlama(arch, tensors, dtype=dtype, max_model_len=max_model_len)
                               if keep_previous_weights else None)
        self.continuation = c = continuation or off()
        self._waiting: list[tuple[RolloutRequest, SamplingParams]] = []
        self._running: dict[str, _Running] = {}
        self._siblings = Siblings(c.min_match, c.max_match, c.sources, c.suffix_k)

    @property
    def dtype(self) -> str:
        return str(self.model.dtype).removeprefix("torch.")

    # ------------------------------------------------------------------ protocol
    def add(self, requests: Iterable[RolloutRequest], params: SamplingParams) -> None:
        for request in requests:
            if request.request_id in self._running or any(
                    r.request_id == request.request_id for r, _ in self._waiting):
                raise ValueError(f"duplicate request id {request.request_id!r}")
            total = len(request.prompt_token_ids) + request.max_new_tokens
            if total > self.model.max_model_len:
                raise ValueError(f"request {request.request_id!r}: prompt + max_new_tokens = "
                                 f"{total} exceeds max_model_len={self.model.max_model_len}")
            self._waiting.append((request, params))

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def step(self) -> list[RolloutResult]:
        decoding = list(self._running.values())
        admitted = [self._admit(r, p) for r, p in self._waiting]
        self._waiting = []
        if admitted:
            self._prefill(admitted)
        if decoding:
            self._decode(decoding)
        # the step's texts go into the prompts' indexes before the next step's proposals (in
        # request-id order, as in the vLLM engine)
        for s in sorted(admitted + decoding, key=lambda s: s.request.request_id):
            if s.continuation is not None:
                s.continuation.pool.observe(s.context)
        return [self._finish(s) for s in list(self._running.values()) if s.finish_reason]

    def abort(self, request_ids: Iterable[str] | None = None) -> list[RolloutResult]:
        if request_ids is None:
            ids = set(self._running) | {r.request_id for r, _ in self._waiting}
        else:
            ids = set(request_ids)
        results = []
        for request, params in [(r, p) for r, p in self._waiting if r.request_id in ids]:
            results.append(RolloutResult(request.request_id, list(request.response_prefix), [],
                                         0, "aborted"))
        self._waiting = [(r, p) for r, p in self._waiting if r.request_id not in ids]
        for rid in [rid for rid in self._running if rid in ids]:
            self._running[rid].finish_reason = "aborted"
            results.append(self._finish(self._running[rid]))
        return results

    def update_weights(self, named_tensors, version: int | None = None) -> None:
        """Strict: a missing, unexpected, repeated or misshapen tensor is an error naming it, and
        the engine keeps its weights."""
        if self._running:
            raise RuntimeError("update_weights while requests are running would mix two policies "
                               "in one response; abort or finish them first")
        current = self.model.weights
        self.model.load(named_tensors)
        if self.previous_model is not None:
            self.previous_model.load(current.items())
        self._loaded(version)

    # ------------------------------------------------------------------ verification
    def verify(self, requests: list[RolloutRequest], drafts: list[list[int]],
               params: SamplingParams, rule: RuleChoice = KEYED):
        """One forward over prompt + prefix + draft per request -> ``speculative.Verdict``
        (``reference_verify``; rules that read the drafts' distributions need
        ``keep_previous_weights``)."""
        return verify_with_model(self.model, self.previous_model, requests, drafts, params, rule)

    # ------------------------------------------------------------------ internals
    def _admit(self, request: RolloutRequest, params: SamplingParams) -> _Running:
        state = _Running(request, params, self.model.cache.acquire(), list(request.response_prefix),
                         words=params.keying.tracker(request.prompt_token_ids,
                                                     request.response_prefix))
        proposals, c = request.proposals, self.continuation
        if c.enabled and has_sources(c.sources, proposals.drafts, proposals.history):
            pool = self._siblings.pool(request.request_id, request.prompt_token_ids,
                                       proposals.drafts, proposals.history, proposals.own)
            if pool:
                state.continuation = Continuation(pool, c.k, token_cost=c.token_cost)
            else:
                self._siblings.leave(request.request_id)
        self._running[request.request_id] = state
        return state

    def _prefill(self, states: list[_Running]) -> None:
        """One forward over prompt + fixed prefix: the prefix's logprobs and the first new token."""
        tokens, lengths = pad_token_rows([s.context for s in states])
        logits = self.model.forward(tokens, torch.tensor([s.slot for s in states]),
                                    torch.zeros_like(lengths), lengths)
        for row, s in enumerate(states):
            prompt_len = len(s.request.prompt_token_ids)
            s.logprobs = _logprobs_of(logits[row, prompt_len - 1:], s.response)
            s.cached = len(s.context)
        ready = [row for row, s in enumerate(states) if not self._check_done(s)]
        if ready:
            last = logits[torch.tensor(ready), (lengths - 1)[ready]].unsqueeze(1)
            self._emit([states[row] for row in ready], last, [[] for _ in ready])

    def _decode(self, states: list[_Running]) -> None:
        proposals = []
        for s in states:
            budget = s.request.max_new_tokens - len(s.response) - 1
            proposals.append(s.continuation.propose(s.context, budget)
                             if s.continuation is not None else [])
        rows = [[s.context[-1]] + p for s, p in zip(states, proposals)]
        tokens, lengths = pad_token_rows(rows)
        starts = torch.tensor([s.cached for s in states])
        logits = self.model.forward(tokens, torch.tensor([s.slot for s in states]), starts, lengths)
        for s in states:
            s.decode_steps += 1
        self._emit(states, logits, proposals)

    def _emit(self, states: list[_Running], logits: torch.Tensor, proposals: list[list[int]]):
        """Keyed verification of the proposals (plain decoding when there are none)."""
        draft, lens = pad_token_rows(proposals, width=logits.shape[1] - 1)
        words = [pad_words(s.words.ahead(p), logits.shape[1]) for s, p in zip(states, proposals)]
        result = verify_keyed(logits, draft, lens,
                              torch.tensor([s.request.key for s in states]),
                              torch.tensor(words, dtype=torch.int64),
                              self._same_params(states),
                              [s.request.eos_token_ids for s in states])
        for row, (s, proposal) in enumerate(zip(states, proposals)):
            n = int(result.accepted[row])
            new = proposal[:n] + ([int(result.next_token[row])]
                                  if int(result.next_token[row]) >= 0 else [])
            if s.continuation is not None:
                s.continuation.record(proposal, n)
            for tok, logprob in zip(new, _logprobs_of(logits[row], new)):
                if self._check_done(s):
                    break
                s.response.append(tok)
                s.logprobs.append(logprob)
                s.words.extend((tok,))
            s.cached = len(s.context) - 1  # the newest token is fed (and cached) next step
            self._check_done(s)

    @staticmethod
    def _same_params(states: list[_Running]) -> SamplingParams:
        params = {s.params for s in states}
        if len(params) != 1:
            raise ValueError("one engine step serves one SamplingParams; got several")
        return params.pop()

    @staticmethod
    def _check_done(s: _Running) -> bool:
        if settle_eos(s.response, s.request.eos_token_ids)[1]:
            s.finish_reason = "eos"
        elif len(s.response) >= s.request.max_new_tokens:
            s.finish_reason = "length"
        return s.finish_reason is not None

    def _finish(self, s: _Running) -> RolloutResult:
        del self._running[s.request.request_id]
        self.model.cache.release(s.slot)
        c = s.continuation
        if c is not None:
            self._siblings.leave(s.request.request_id)
        return RolloutResult(s.request.request_id, s.response, s.logprobs, s.decode_steps,
                             s.finish_reason, c.proposed if c else 0, c.accepted if c else 0,
                             c.by_source() if c else {})
