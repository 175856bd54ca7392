"""A run config's ``spec.*`` and ``ablation.speculative_continuation`` / ``reuse_draft_kv`` -> one
``ContinuationSettings`` value -> both rollout engines.

The engines keep no speculative settings of their own: ``from_config`` is the one place that reads
them from the schema, and ``of`` gives what a config with some overrides would give, for code that
builds an engine without a run config (tests, benchmarks, scripts). An engine built with none runs
without speculation (``off()``), as a config with ``spec.enabled=false`` does.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ContinuationSettings:
    """What an engine proposes from while it decodes, how much, and how it verifies drafts."""

    enabled: bool              # speculative continuation: requests propose tokens a step
    k: int                     # the most tokens a request proposes a step (spec.spec_k)
    suffix_k: int              # ... from a suffix match, as long as it matched (spec.suffix_k)
    min_match: int             # the n-gram lengths a proposal matches (spec.min_match ..
    max_match: int             # spec.max_match)
    sources: tuple[str, ...]   # what a request proposes from (spec.proposal_sources)
    token_cost: float | None   # one proposed token's cost in decode steps; None: always k tokens
    verify_drafts: bool        # vLLM verifies requests' own drafts (spec.verifier=engine)
    reuse_draft_kv: bool       # vLLM keeps drafting requests' KV across weight updates

    @classmethod
    def from_config(cls, cfg) -> ContinuationSettings:
        s, a = cfg.spec, cfg.ablation
        return cls(enabled=s.enabled and a.speculative_continuation, k=s.spec_k,
                   suffix_k=s.suffix_k,
                   min_match=s.min_match, max_match=s.max_match,
                   sources=tuple(s.proposal_sources), token_cost=s.proposal_token_cost,
                   verify_drafts=s.enabled and s.verifier == "engine"
                   and cfg.rollout.engine == "vllm",
                   reuse_draft_kv=s.enabled and a.reuse_draft_kv)

    @classmethod
    def of(cls, *overrides: str) -> ContinuationSettings:
        """The settings of the schema's defaults with these ``key=value`` overrides."""
        from megatron_bubblespec.config import load_config

        return cls.from_config(load_config(None, list(overrides)))


def off() -> ContinuationSettings:
    """No speculation: what an engine built without settings runs."""
    return ContinuationSettings.of("spec.enabled=false")
