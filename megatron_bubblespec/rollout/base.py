"""The rollout engine protocol: requests (prompt, key, fixed prefix) -> keyed generation -> results.

Every engine draws every token with the keyed sampler, keyed by its draw word
(``sampling.draw_words``: its absolute response position, or the tokens before it), so two
engines holding the same weights produce the same tokens for the same keys, and a request that
starts from an already-fixed response prefix (tokens accepted by verification) continues exactly
as an uninterrupted generation would.

Engines are preemptible: ``add`` requests, advance them with ``step`` (one engine forward pass for
every active request), ``abort`` to stop and collect the partial outputs. ``generate`` is the same
loop run to completion. The bubble drafter calls ``step`` between checks of the DP barrier.

Accounting: the prefill forward emits a request's first token; every later forward that gives it
tokens is one *decode step* (the paper's metric). A speculative-continuation forward that accepts
several tokens is still one decode step. Logprobs are ``log_softmax`` of the raw logits (the policy
at T = 1, before temperature and truncation), for every response token, prefix included.
"""

from __future__ import annotations

import abc
from typing import Iterable

import torch

from megatron_bubblespec.sampling import SamplingParams
from megatron_bubblespec.sampling.requests import RolloutRequest, RolloutResult
from megatron_bubblespec.speculative.continuation import ContinuationSettings
from megatron_bubblespec.speculative.rules import KEYED, RuleChoice


class RolloutEngine(abc.ABC):
    """Keyed generation with preemptible stepping and in-place weight updates.

    A subclass implements the five abstract methods; the other members have defaults that say
    what an engine without that ability does (nothing, or an error naming the engine and the fix).
    """

    weight_version: int = 0          # the policy version held; set only by ``update_weights``
    last_engine_steps: int = 0       # engine steps (forward passes) of the last ``generate``
    # what the engine proposes from and how much (``speculative.continuation``); None: no
    # speculation
    continuation: ContinuationSettings | None = None

    @property
    def spec_token_cost(self) -> float | None:
        """What one proposed token costs, as a fraction of a decode step: speculative
        continuation sizes its proposals by it (None: always ``k`` tokens);
        ``measure_proposal_cost`` sets it."""
        return self.continuation.token_cost if self.continuation is not None else None

    @abc.abstractmethod
    def add(self, requests: Iterable[RolloutRequest], params: SamplingParams) -> None:
        """Queue requests; they start on the next ``step``."""

    @abc.abstractmethod
    def step(self) -> list[RolloutResult]:
        """One engine step for every active request; returns the requests that finished in it."""

    @abc.abstractmethod
    def abort(self, request_ids: Iterable[str] | None = None) -> list[RolloutResult]:
        """Stop the given (default: all) unfinished requests and return their partial outputs."""

    @abc.abstractmethod
    def has_unfinished(self) -> bool:
        """Whether any added request is still queued or running."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       version: int | None = None) -> None:
        """Load HF-layout tensors in place (no restart); caches that depend on weights are reset.
        The engine then holds weight version ``version`` (None: the next one): only this call
        changes ``weight_version``, so the loop's version check compares two owners' counts.
        An implementation ends with ``self._loaded(version)``."""

    def _loaded(self, version: int | None) -> None:
        self.weight_version = self.weight_version + 1 if version is None else version

    def generate(self, requests: Iterable[RolloutRequest],
                 params: SamplingParams) -> list[RolloutResult]:
        """Run requests to completion; results in request order."""
        requests = list(requests)
        self.add(requests, params)
        done = {}
        self.last_engine_steps = 0
        while self.has_unfinished():
            self.last_engine_steps += 1
            for result in self.step():
                done[result.request_id] = result
        return [done[r.request_id] for r in requests]

    def verify(self, requests: list[RolloutRequest], drafts: list[list[int]],
               params: SamplingParams, rule: RuleChoice = KEYED):
        """One forward over prompt + prefix + draft per request -> ``speculative.Verdict``: how much
        of each draft the policy accepts under ``rule`` (``spec.verifier: engine`` before the
        rollout, ``speculative.EngineVerifier``). Engines that cannot raise NotImplementedError."""
        raise NotImplementedError(
            f"{type(self).__name__} does not verify drafts before the rollout: use "
            "spec.verifier=megatron, or spec.verifier=engine with rollout.engine=reference "
            "(on vLLM, spec.verifier=engine verifies each request's draft inside the rollout)")

    def measure_proposal_cost(self, rows: int, verify_steps: int = 8, repeats: int = 2,
                              seed: int = 0) -> float:
        """Time what one proposed token costs at ``rows`` requests, set ``spec_token_cost`` to it
        and return it (``ablation.measure_proposal_cost``). Engines that cannot raise."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot measure its proposal token cost: use "
            "rollout.engine=vllm, or set spec.proposal_token_cost instead")

    def sleep(self, level: int = 1) -> None:
        """Free the engine's accelerator memory while the trainer runs
        (``rollout.sleep_during_train``); ``wake_up`` gives it back. Engines without a sleep
        mode raise: nothing would be freed, and the trainer would run out of the memory it was
        promised."""
        raise RuntimeError(self._no_sleep_mode())

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Reallocate what ``sleep`` freed: ``["weights"]`` before a weight update,
        ``["kv_cache"]`` after it, or everything (None)."""
        raise RuntimeError(self._no_sleep_mode())

    def _no_sleep_mode(self) -> str:
        return (f"{type(self).__name__} has no sleep mode (it frees no memory while the trainer "
                "runs): set rollout.sleep_during_train=false, or use rollout.engine=vllm on a GPU")

    def release(self) -> None:
        """The caller is done with the engine for this step (after the rollout and the bubble).
        A tensor-parallel engine lets its other ranks go; a single engine has nothing to do."""

    def shutdown(self) -> None:
        """Free the engine's resources now, before the process groups are destroyed; idempotent.
        Nothing to do for an engine that holds only tensors."""

    @property
    def dtype(self) -> str | None:
        """The engine's compute dtype (``"float32"``, ``"bfloat16"``, ...); None when unknown."""
        return None

    @property
    def prefix_caching(self) -> bool | None:
        """Whether KV computed for one request is reused by later ones with the same prefix;
        None for an engine that has no prefix cache to switch."""
        return None
