"""A sample to generate and what came of it: the types shared by the rollout engines, the verifiers,
the bubble drafter and the loop (below all of them, so none imports another to name a request).

A request is one sample: prompt, the sample's key, its response budget, an optional response
prefix already fixed by verification, its EOS ids, what it may propose from while it decodes
(``Proposals``, speculative continuation), its own draft when the engine verifies it
(``spec.verifier: engine``), and whether it is a bubble's drafting request. A result is the whole
response (prefix included) with one logprob per token.
``settle_eos`` is the one rule, used by every engine and verifier, for where a response ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Sequence


def settle_eos(tokens: Sequence[int], eos_token_ids: Collection[int]) -> tuple[int, bool]:
    """Where a response ends: (how many of ``tokens`` it keeps, whether an EOS ended it).

    The first token in ``eos_token_ids`` (the request's own EOS ids) ends the response: it is kept,
    everything after it is dropped. Without one, every token is kept and the response is open.
    """
    for index, token in enumerate(tokens):
        if token in eos_token_ids:
            return index + 1, True
    return len(tokens), False


@dataclass
class Proposals:
    """What a decoding sample may propose from (``speculative.pool``): its prompt's drafts, the
    place of its own draft among them, and its prompt's responses from the last time it was rolled
    out."""

    drafts: list[list[int]] = field(default_factory=list)
    own: int | None = None
    history: list[list[int]] = field(default_factory=list)


@dataclass
class RolloutRequest:
    """One sample to generate: prompt, its key, and an optional already-fixed response prefix."""

    request_id: str
    prompt_token_ids: list[int]
    key: int                                    # sample key (signed int64), see sampling.sample_key
    max_new_tokens: int                         # response budget, prefix included
    response_prefix: list[int] = field(default_factory=list)
    eos_token_ids: tuple[int, ...] = ()
    proposals: Proposals = field(default_factory=Proposals)
    draft: list[int] = field(default_factory=list)  # its own draft, verified inside the engine's forward
    # a bubble's drafting request: a draft is its tokens only, so no logprobs are wanted (an
    # engine may return NaN), and it may reuse KV its prompt and prefix got under earlier weights
    # (a draft is only a proposal); a rollout request never does either
    drafting: bool = False

    def __post_init__(self):
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: empty prompt")
        if len(self.response_prefix) > self.max_new_tokens:
            raise ValueError(f"request {self.request_id!r}: prefix of {len(self.response_prefix)} "
                             f"tokens exceeds max_new_tokens={self.max_new_tokens}")


@dataclass
class RolloutResult:
    request_id: str
    token_ids: list[int]           # the whole response, prefix included
    logprobs: list[float]          # one per response token
    decode_steps: int              # forward passes after prefill that gave this request tokens
    finish_reason: str             # "eos" | "length" | "aborted"
    proposed_tokens: int = 0       # speculative continuation: tokens proposed (all sources)
    accepted_tokens: int = 0       # ... and accepted by the keyed rule
    by_source: dict[str, tuple[int, int]] = field(default_factory=dict)  # source -> (proposed, accepted)

    @property
    def finished(self) -> bool:
        return self.finish_reason != "aborted"
