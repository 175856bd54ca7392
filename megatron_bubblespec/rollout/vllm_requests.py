"""One request's cumulative vLLM outputs -> its new tokens, logprobs and decode steps -> its result.

vLLM returns every request's output so far at each step (``RequestOutput``, one completion).
``LiveRequest`` keeps what has been taken: the tokens generated after the fixed response prefix
with their raw logprobs (NaN for a drafting request, which asks for none), the prefix's logprobs
(from ``prompt_logprobs``, requested only for a rollout's prefix), and the engine steps that gave
the request tokens (decode steps = those minus the prefill's). A request whose prefix already
ends the response (EOS, or the whole budget) is still submitted for the prefix's logprobs, and its
generated token is dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_bubblespec.sampling.requests import RolloutRequest, RolloutResult, settle_eos

_FINISH_REASONS = {"stop": "eos", "length": "length", "abort": "aborted"}


@dataclass
class LiveRequest:
    request: RolloutRequest
    vllm_id: str                          # vLLM's internal id (external id + random suffix)
    prefix_complete: bool                 # the prefix already ends the response: drop new tokens
    prefix_logprobs: list[float] | None = None
    token_ids: list[int] = field(default_factory=list)   # generated after the prefix
    logprobs: list[float] = field(default_factory=list)
    emitting_steps: int = 0
    pooled: bool = False                  # proposes from a draft pool (speculative continuation)
    continuation: dict = field(default_factory=dict)   # source -> (proposed, accepted), at its end

    def absorb(self, output) -> None:
        """Take the new tokens / logprobs of one (cumulative) RequestOutput."""
        prefix = self.request.response_prefix
        if prefix and self.prefix_logprobs is None and output.prompt_logprobs is not None:
            n_prompt = len(self.request.prompt_token_ids)
            entries = output.prompt_logprobs[n_prompt:n_prompt + len(prefix)]
            if len(entries) == len(prefix):
                self.prefix_logprobs = [entry[token].logprob
                                        for entry, token in zip(entries, prefix)]
        completion = output.outputs[0]
        token_ids = list(completion.token_ids)
        if len(token_ids) <= len(self.token_ids):
            return
        self.emitting_steps += 1
        for position in range(len(self.token_ids), len(token_ids)):
            token = token_ids[position]
            self.token_ids.append(token)
            self.logprobs.append(math.nan if completion.logprobs is None   # not asked for
                                 else completion.logprobs[position][token].logprob)

    def result(self, vllm_reason: str | None) -> RolloutResult:
        """The whole response, prefix included (``vllm_reason``: vLLM's finish reason, None or
        ``"abort"`` for an aborted request)."""
        request = self.request
        prefix = list(request.response_prefix)
        reason = _FINISH_REASONS.get(vllm_reason or "abort", "aborted")
        if self.prefix_complete and reason != "aborted":
            generated, generated_logprobs = [], []
            reason = "eos" if settle_eos(prefix, request.eos_token_ids)[1] else "length"
            decode_steps = 0
        else:
            generated, generated_logprobs = self.token_ids, self.logprobs
            decode_steps = max(0, self.emitting_steps - 1)
        prefix_logprobs = self.prefix_logprobs
        if prefix_logprobs is None:  # not asked for, or aborted before the prefill finished
            prefix_logprobs = [math.nan] * len(prefix)
        return RolloutResult(request.request_id, prefix + generated,
                             list(prefix_logprobs) + generated_logprobs, decode_steps, reason,
                             sum(p for p, _ in self.continuation.values()),
                             sum(a for _, a in self.continuation.values()), self.continuation)
