"""Verifiers: (requests, drafts) -> ``VerifiedDrafts``: the requests the engine continues from,
drafted and accepted tokens, seconds.

One interface and one result, chosen once by ``speculative.factory.build_verifier``; the loop never
branches on the rule or the place:

* ``speculative.megatron_verifier.MegatronVerifier`` (``spec.verifier: megatron``): the training
ranks
  that already hold the step's weights run one forward over prompt + prefix + draft, keyed argmax
  per position (vocab-parallel over TP). Every rank of the replica calls it (collective; under
  expert parallelism every rank of the TP x EP group, drafts or not: ``every_step``).
* ``EngineVerifier`` (``spec.verifier: engine`` on the reference engine): the rollout engine
  verifies with its own forward before the rollout, with any rule the engine implements (the
  ablation rules, residual and lenient, need the drafting policy's distributions).
* ``InRolloutVerifier`` (``spec.verifier: engine`` on vLLM, the default): nothing runs before
  the rollout;
  each request carries its draft into the engine, which proposes it whole after the prefill and
  verifies it in its keyed spec-decode step (``speculative.pool.Continuation``). The prompt is
  prefilled once, the accepted prefix never twice, and the accepted tokens are settled from the
  responses (``VerifiedDrafts.settled``).

``verify_drafts`` is the step's verify stage: only the requests that have a draft go to the
verifier. ``VerifiedDrafts.of`` turns a rule's ``speculative.verify.Verdict`` into the requests the
engine continues from: prompt + the verified tokens as a fixed response prefix.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Protocol, Sequence

import torch

from megatron_bubblespec.sampling import SamplingParams
from megatron_bubblespec.sampling.requests import RolloutRequest, RolloutResult
from megatron_bubblespec.speculative.rules import KEYED, RuleChoice
from megatron_bubblespec.speculative.validate import request_draft
from megatron_bubblespec.speculative.verify import Verdict


@dataclass
class VerifiedDrafts:
    """What the verify stage hands the rollout: a list of requests, in their order, with how much
    of each one's draft was verified (the step-level record; a rule's tensors are ``Verdict``)."""

    requests: list[RolloutRequest]   # what the engine continues from
    drafted: list[int]               # draft tokens per request, as proposed (0: no draft)
    accepted: list[int | None]       # accepted draft tokens; None: the rollout settles it
    seconds: float = 0.0             # wall time spent verifying before the rollout

    @classmethod
    def of(cls, requests: Sequence[RolloutRequest], drafts: Sequence[Sequence[int]],
           verdict: Verdict, start: float) -> VerifiedDrafts:
        """A rule's verdict on ``drafts`` (begun at ``start``, ``time.perf_counter``)."""
        return cls(apply_verification(requests, verdict, drafts), [len(d) for d in drafts],
                   verdict.accepted.tolist(), time.perf_counter() - start)

    def settled(self, results: Sequence[RolloutResult]) -> list[int]:
        """``accepted``, with the drafts verified inside the rollout settled from its
        ``results`` (one per request, in order)."""
        return [accepted_in_rollout(request, result.token_ids) if accepted is None else accepted
                for request, accepted, result in zip(self.requests, self.accepted, results)]


class Verifier(Protocol):
    every_step: bool   # called even when no request has a draft (a collective with its peers)

    def verify(self, requests: Sequence[RolloutRequest],
               drafts: Sequence[Sequence[int]]) -> VerifiedDrafts:
        """One draft (possibly empty) per request -> what the engine continues from."""


def verify_drafts(verifier: Verifier | None, requests: Sequence[RolloutRequest],
                  drafts: Sequence[Sequence[int]]) -> VerifiedDrafts:
    """The verify stage: the requests with a (non-empty) draft go to ``verifier``; the others go
    to the engine unchanged, which draws the same first token the verifier would have."""
    drafted = [i for i, draft in enumerate(drafts) if draft]
    out = VerifiedDrafts(list(requests), [0] * len(requests), [0] * len(requests))
    if not drafted and not (verifier is not None and verifier.every_step):
        return out
    checked = verifier.verify([requests[i] for i in drafted], [list(drafts[i]) for i in drafted])
    out.seconds = checked.seconds
    for i, request, n, accepted in zip(drafted, checked.requests, checked.drafted,
                                       checked.accepted):
        out.requests[i], out.drafted[i], out.accepted[i] = request, n, accepted
    return out


class EngineVerifier:
    """Verification by the rollout engine's own forward, with any rule the engine implements."""

    every_step = False

    def __init__(self, engine, params: SamplingParams, rule: RuleChoice = KEYED):
        self.engine, self.params, self.rule = engine, params, rule

    def verify(self, requests, drafts) -> VerifiedDrafts:
        start = time.perf_counter()
        drafts = [list(d) for d in drafts]
        result = self.engine.verify(list(requests), drafts, self.params, rule=self.rule)
        return VerifiedDrafts.of(requests, drafts, result, start)


class InRolloutVerifier:
    """Keyed verification inside the vLLM rollout: each request takes its (checked) draft along.

    A draft holding an id outside the vocabulary is dropped and one longer than the budget is cut
    (``speculative.validate``, with a warning), as the Megatron verifier does. The draft is stored
    in response positions (after the request's fixed prefix), which is how the engine compares
    it."""

    every_step = False

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def verify(self, requests, drafts) -> VerifiedDrafts:
        carried = []
        for request, draft in zip(requests, drafts):
            draft = request_draft(request, draft, self.vocab_size)
            carried.append(replace(request, draft=list(request.response_prefix) + draft
                                   if draft else []))
        return VerifiedDrafts(carried, [len(d) for d in drafts], [None] * len(carried))


def accepted_in_rollout(request: RolloutRequest, tokens: Sequence[int]) -> int:
    """Draft tokens the engine accepted: the response's longest common prefix with the draft
    (a keyed draw that disagrees ends the draft; the response is the keyed draws)."""
    n = 0
    for drafted, drawn in zip(request.draft, tokens):
        if drafted != drawn:
            break
        n += 1
    return max(0, n - len(request.response_prefix))


def apply_verification(requests: Sequence[RolloutRequest], result: Verdict,
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
