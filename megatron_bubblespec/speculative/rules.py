"""Verification rules by name -> what settles drafts under each, its parameters and which verifiers
run it: the one place a rule is registered (``ablation.rule``, its parameters ``ablation.<name>``).

A rule is one function over the target's logits (and, when it reads them, the drafting policy's
probabilities). Verifiers receive a ``RuleChoice``, the rule's name with its parameter values, and
call ``settle``; none of them knows a rule by name. Only the keyed rule is exact token for token and
runs everywhere: inside the vLLM rollout (its rejection sampler made keyed), in the reference
engine and in the Megatron verifier. Every other rule runs in the reference engine only
(``rollout.engine=reference``, ``spec.verifier=engine``), which keeps the drafting policy's weights
for the rules that read its distributions.

Adding a rule: a function with ``settle``'s signature (``speculative.verify`` holds the shared
settlement step) and one ``register(Rule(...))`` below; a parameter is an ``ablation`` key of the
same name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megatron_bubblespec.registry import Registry
from megatron_bubblespec.speculative.verify import (Verdict, verify_keyed, verify_lenient,
                                             verify_residual)

EVERYWHERE = ("vllm", "reference", "megatron")   # the keyed rule's verifiers
REFERENCE_ONLY = ("reference",)


@dataclass(frozen=True)
class Rule:
    """A verification rule: ``settle(target_logits, draft_probs, draft, draft_lens, keys,
    words, params, eos_token_ids, **parameters) -> Verdict`` (``words``: the rows' draw words)."""

    name: str
    settle: Callable[..., Verdict]
    exact: bool                       # the verified tokens are plain keyed decoding's
    reads_draft_probs: bool           # needs the drafting policy's distributions (draft_probs)
    parameters: tuple[str, ...] = ()  # ablation.<name> keys it takes
    verifiers: tuple[str, ...] = REFERENCE_ONLY
    summary: str = ""


RULES = Registry("verification rule")


def register(rule: Rule) -> Rule:
    return RULES.register(rule.name, rule)


@dataclass(frozen=True)
class RuleChoice:
    """A rule with its parameter values: what a verifier is handed."""

    name: str = "keyed"
    parameters: tuple[tuple[str, float], ...] = ()

    @property
    def rule(self) -> Rule:
        return RULES.entry(self.name)

    def settle(self, target_logits, draft_probs, draft, draft_lens, keys, words, params,
               eos_token_ids=()) -> Verdict:
        return self.rule.settle(target_logits, draft_probs, draft, draft_lens, keys,
                                words, params, eos_token_ids, **dict(self.parameters))


KEYED = RuleChoice("keyed")


def rule_from_config(cfg) -> RuleChoice:
    """The run's ``ablation.rule`` with its parameters read from ``ablation``."""
    rule = RuleChoice(cfg.ablation.rule).rule
    return RuleChoice(rule.name, tuple((p, getattr(cfg.ablation, p)) for p in rule.parameters))


def _keyed(target_logits, draft_probs, draft, draft_lens, keys, words, params,
           eos_token_ids=()) -> Verdict:
    return verify_keyed(target_logits, draft, draft_lens, keys, words, params,
                        eos_token_ids)


register(Rule("keyed", _keyed, exact=True, reads_draft_probs=False, verifiers=EVERYWHERE,
              summary="accept while the keyed draw equals the draft token: token-identical to "
                      "plain keyed decoding"))
register(Rule("residual", verify_residual, exact=True, reads_draft_probs=True,
              summary="standard speculative sampling: exact in distribution, not token for token"))
register(Rule("lenient", verify_lenient, exact=False, reads_draft_probs=True,
              parameters=("lenience",),
              summary="SPEC-RL's rule, accepting u <= lenience * p/q: biased towards the draft"))
