"""Config -> the run's verifier (Megatron's, the engine's before the rollout, or inside it).

Apart from ``speculative.verifier`` so that the verifiers' module and the Megatron verifier, which
returns its ``VerifiedDrafts``, do not import each other.
"""

from __future__ import annotations

from megatron_bubblespec.sampling import SamplingParams
from megatron_bubblespec.speculative.megatron_verifier import MegatronVerifier
from megatron_bubblespec.speculative.rules import rule_from_config
from megatron_bubblespec.speculative.verifier import EngineVerifier, InRolloutVerifier, Verifier


def build_verifier(cfg, params: SamplingParams, *, model=None, arch=None,
                   engine=None) -> Verifier | None:
    """The run's verifier: Megatron's (``model``, ``arch``) for the keyed rule with
    ``spec.verifier: megatron``, else the engine's (inside the rollout on vLLM, ``engine`` before
    it on the reference engine); None when BubbleSpec is off."""
    s, a = cfg.spec, cfg.ablation
    if not s.enabled:
        return None
    if s.verifier == "engine" and cfg.rollout.engine == "vllm":
        return InRolloutVerifier(arch.vocab_size)
    rule = rule_from_config(cfg)
    if "megatron" in rule.rule.verifiers and s.verifier == "megatron":
        return MegatronVerifier(model, arch, params, cfg.train.micro_batch_size)
    if engine is None:
        raise ValueError(f"spec.verifier={s.verifier!r} with ablation.rule={a.rule!r} verifies "
                         "in the rollout engine, and this rank has none; use spec.verifier=megatron with "
                         "ablation.rule=keyed, or parallel.tensor=parallel.pipeline=1")
    return EngineVerifier(engine, params, rule=rule)
