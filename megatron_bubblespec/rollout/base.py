"""The rollout engine protocol: requests (prompt, key, fixed prefix) -> keyed generation -> results.

Every engine draws every token with the keyed sampler at its absolute response position, so two
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


class RolloutEngine(abc.ABC):
    """Keyed generation with preemptible stepping and in-place weight updates."""

    weight_version: int = 0
    last_engine_steps: int = 0   # engine steps (forward passes) of the last ``generate``

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
        changes ``weight_version``, so the loop's version check compares two owners' counts."""

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
