"""Verifiers: (requests, drafts) -> (``Verification``, seconds), on Megatron or inside an engine.

One interface, chosen once by ``build_verifier``; the loop never branches on the rule or the place:

* ``MegatronDraftVerifier`` (``spec.verifier: megatron``, the default): the training ranks that
  already hold the step's weights run one forward over prompt + prefix + draft, keyed argmax per
  position (vocab-parallel over TP). Every rank of the replica calls it (collective).
* ``EngineVerifier`` (``spec.verifier: engine``): the rollout engine verifies with its own forward;
  the reference engine is the one that also implements the ablation rules (residual, lenient),
  which need the drafting policy's distributions.

``apply_verification`` turns a verification into the requests the engine continues from: prompt +
the verified tokens as a fixed response prefix.
"""

from __future__ import annotations

import time
from typing import Protocol, Sequence

import torch

from megatron_bubblespec.sampling import SamplingParams
from megatron_bubblespec.sampling.requests import RolloutRequest
from megatron_bubblespec.spec.verify import Verification


class Verifier(Protocol):
    def verify(self, requests: Sequence[RolloutRequest],
               drafts: Sequence[Sequence[int]]) -> tuple[Verification, float]:
        """One draft (possibly empty) per request -> the verification and its wall time."""


class MegatronDraftVerifier:
    """Keyed verification by this rank's Megatron model piece (any TP/PP; collective)."""

    def __init__(self, verifier, params: SamplingParams, micro_batch_size: int | None):
        self.verifier, self.params, self.micro_batch_size = verifier, params, micro_batch_size

    def verify(self, requests, drafts) -> tuple[Verification, float]:
        start = time.perf_counter()
        result = self.verifier.verify(list(requests), [list(d) for d in drafts], self.params,
                                      micro_batch_size=self.micro_batch_size)
        return result, time.perf_counter() - start


class EngineVerifier:
    """Verification by the rollout engine's own forward, with any rule the engine implements."""

    def __init__(self, engine, params: SamplingParams, rule: str = "keyed",
                 lenience: float = 1.0):
        self.engine, self.params, self.rule, self.lenience = engine, params, rule, lenience

    def verify(self, requests, drafts) -> tuple[Verification, float]:
        start = time.perf_counter()
        result = self.engine.verify(list(requests), [list(d) for d in drafts], self.params,
                                    rule=self.rule, lenience=self.lenience)
        return result, time.perf_counter() - start


def build_verifier(cfg, params: SamplingParams, *, model=None, spec=None,
                   engine=None) -> Verifier | None:
    """The run's verifier: Megatron's (``model``, ``spec``) for the keyed rule with
    ``spec.verifier: megatron``, else ``engine``'s; None when BubbleSpec is off."""
    s = cfg.spec
    if not s.enabled:
        return None
    if s.rule == "keyed" and s.verifier == "megatron":
        from megatron_bubblespec.spec.megatron_verifier import MegatronVerifier

        return MegatronDraftVerifier(MegatronVerifier(model, spec), params,
                                     cfg.train.micro_batch_size)
    if engine is None:
        raise ValueError(f"spec.verifier={s.verifier!r} with spec.rule={s.rule!r} verifies in the "
                         "rollout engine, and this rank has none; use spec.verifier=megatron with "
                         "spec.rule=keyed, or parallel.tensor=parallel.pipeline=1")
    return EngineVerifier(engine, params, rule=s.rule, lenience=s.lenience)


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
