"""Verifiers: (requests, drafts) -> (the requests the engine continues from, accepted tokens, seconds).

One interface, chosen once by ``build_verifier``; the loop never branches on the rule or the place:

* ``MegatronDraftVerifier`` (``spec.verifier: megatron``, the default): the training ranks that
  already hold the step's weights run one forward over prompt + prefix + draft, keyed argmax per
  position (vocab-parallel over TP). Every rank of the replica calls it (collective).
* ``EngineVerifier`` (``spec.verifier: engine`` on the reference engine): the rollout engine
  verifies with its own forward before the rollout, with any rule the engine implements (the
  ablation rules, residual and lenient, need the drafting policy's distributions).
* ``InRolloutVerifier`` (``spec.verifier: engine`` on vLLM): nothing runs before the rollout;
  each request carries its draft into the engine, which proposes it whole after the prefill and
  verifies it in its keyed spec-decode step (``spec.pool.Continuation``). The prompt is prefilled
  once, the accepted prefix never twice, and the accepted tokens are settled from the responses
  (``accepted_in_rollout``).

``apply_verification`` turns a verification into the requests the engine continues from: prompt +
the verified tokens as a fixed response prefix.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Protocol, Sequence

import torch

from megatron_bubblespec.sampling import SamplingParams
from megatron_bubblespec.sampling.requests import RolloutRequest
from megatron_bubblespec.spec.validate import request_draft
from megatron_bubblespec.spec.verify import Verification


@dataclass
class Checked:
    """A verifier's answer for the drafted requests, in their order."""

    requests: list[RolloutRequest]   # what the engine continues from
    accepted: list[int | None]       # accepted draft tokens; None: the rollout settles it
    seconds: float                   # wall time spent verifying before the rollout


class Verifier(Protocol):
    def verify(self, requests: Sequence[RolloutRequest],
               drafts: Sequence[Sequence[int]]) -> Checked:
        """One draft (possibly empty) per request -> what the engine continues from."""


def _checked(requests, drafts, result: Verification, start: float) -> Checked:
    return Checked(apply_verification(requests, result, drafts), result.accepted.tolist(),
                   time.perf_counter() - start)


class MegatronDraftVerifier:
    """Keyed verification by this rank's Megatron model piece (any TP/PP; collective)."""

    def __init__(self, verifier, params: SamplingParams, micro_batch_size: int | None):
        self.verifier, self.params, self.micro_batch_size = verifier, params, micro_batch_size

    def verify(self, requests, drafts) -> Checked:
        start = time.perf_counter()
        drafts = [list(d) for d in drafts]
        result = self.verifier.verify(list(requests), drafts, self.params,
                                      micro_batch_size=self.micro_batch_size)
        return _checked(requests, drafts, result, start)


class EngineVerifier:
    """Verification by the rollout engine's own forward, with any rule the engine implements."""

    def __init__(self, engine, params: SamplingParams, rule: str = "keyed",
                 lenience: float = 1.0):
        self.engine, self.params, self.rule, self.lenience = engine, params, rule, lenience

    def verify(self, requests, drafts) -> Checked:
        start = time.perf_counter()
        drafts = [list(d) for d in drafts]
        result = self.engine.verify(list(requests), drafts, self.params, rule=self.rule,
                                    lenience=self.lenience)
        return _checked(requests, drafts, result, start)


class InRolloutVerifier:
    """Keyed verification inside the vLLM rollout: each request takes its (checked) draft along.

    A draft holding an id outside the vocabulary is dropped and one longer than the budget is cut
    (``spec.validate``, with a warning), as the Megatron verifier does. The draft is stored in
    response positions (after the request's fixed prefix), which is how the engine compares it."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def verify(self, requests, drafts) -> Checked:
        carried = []
        for request, draft in zip(requests, drafts):
            draft = request_draft(request, draft, self.vocab_size)
            carried.append(replace(request, draft=list(request.response_prefix) + draft
                                   if draft else []))
        return Checked(carried, [None] * len(carried), 0.0)


def accepted_in_rollout(request: RolloutRequest, tokens: Sequence[int]) -> int:
    """Draft tokens the engine accepted: the response's longest common prefix with the draft
    (a keyed draw that disagrees ends the draft; the response is the keyed draws)."""
    n = 0
    for drafted, drawn in zip(request.draft, tokens):
        if drafted != drawn:
            break
        n += 1
    return max(0, n - len(request.response_prefix))


def build_verifier(cfg, params: SamplingParams, *, model=None, spec=None,
                   engine=None) -> Verifier | None:
    """The run's verifier: Megatron's (``model``, ``spec``) for the keyed rule with
    ``spec.verifier: megatron``, else the engine's (inside the rollout on vLLM, ``engine`` before
    it on the reference engine); None when BubbleSpec is off."""
    s, a = cfg.spec, cfg.ablation
    if not s.enabled:
        return None
    if s.verifier == "engine" and cfg.rollout.engine == "vllm":
        return InRolloutVerifier(spec.vocab_size)
    if a.rule == "keyed" and s.verifier == "megatron":
        from megatron_bubblespec.spec.megatron_verifier import MegatronVerifier

        return MegatronDraftVerifier(MegatronVerifier(model, spec), params,
                                     cfg.train.micro_batch_size)
    if engine is None:
        raise ValueError(f"spec.verifier={s.verifier!r} with ablation.rule={a.rule!r} verifies in the "
                         "rollout engine, and this rank has none; use spec.verifier=megatron with "
                         "ablation.rule=keyed, or parallel.tensor=parallel.pipeline=1")
    return EngineVerifier(engine, params, rule=a.rule, lenience=a.lenience)


def apply_verification(requests: Sequence[RolloutRequest], result: Verification,
                       drafts: Sequence[Sequence[int]]) -> list[RolloutRequest]:
    """Each request with its verified tokens (accepted draft + the target's next token) as its
    fixed response prefix, cut to its budget."""
    width = max(map(len, drafts), default=0)
    padded = torch.tensor([list(d) + [0] * (width - len(d)) for d in drafts], dtype=torch.int64)
    fixed = []
    for r, tokens in zip(requests, result.tokens(padded.reshape(len(drafts), width))):
        fixed.append(RolloutRequest(r.request_id, r.prompt_token_ids, r.key, r.max_new_tokens,
                                    response_prefix=list(r.response_prefix) +
                                    tokens[:r.max_new_tokens - len(r.response_prefix)],
                                    eos_token_ids=r.eos_token_ids))
    return fixed
