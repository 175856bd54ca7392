"""An idle engine -> timed plain and all-accepted verify steps -> what one proposed token costs.

Speculative continuation sizes its proposals by this cost (``speculative.pool.Continuation``), as a
fraction of a decode step (``ablation.measure_proposal_cost``). ``rows`` random prompts are decoded
plainly, then again with their own responses as the only proposal source, so that every engine
step verifies ``k`` tokens per request and all are accepted: cost = (median verify step /
median plain step - 1) / proposed tokens per request and step. Prefill steps are left out; the two
passes alternate ``repeats`` times, so a change of the machine's load hits both. It costs some
engine time at start-up and its tokens are thrown away. Proposals never change a token, so a
measured cost changes how many engine steps a rollout takes, never what it generates.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch

from megatron_bubblespec.sampling import SamplingParams, sample_key
from megatron_bubblespec.sampling.requests import Proposals, RolloutRequest

PROMPT_TOKENS = 32
MAX_COST = 10.0   # a proposed token dearer than this many decode steps: proposals are off anyway


def measure_proposal_cost(engine, vocab_size: int, rows: int, verify_steps: int = 8,
                          repeats: int = 2, seed: int = 0) -> float:
    """Measure the cost on ``engine`` (speculative continuation on, no request running) at
    ``rows`` requests, set its ``spec_token_cost`` to it and return it."""
    settings = engine.continuation
    if settings is None or not settings.enabled:
        raise ValueError("measure_proposal_cost needs speculative continuation on "
                         "(ContinuationSettings.enabled)")
    if engine.has_unfinished():
        raise RuntimeError("measure_proposal_cost runs on an idle engine")
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab_size, (rows, PROMPT_TOKENS), generator=g).tolist()
    budget = (settings.k + 1) * verify_steps + 1
    # the own response as the only source, always k tokens
    engine.continuation = replace(settings, sources=("bubble",), token_cost=None)
    plain_steps, verify_steps_s, proposed = [], [], 0
    try:
        for repeat in range(repeats):
            steps, plain = _timed_pass(engine, f"plain{repeat}", prompts, [[]] * rows, budget,
                                       seed)
            plain_steps += steps
            steps, verified = _timed_pass(engine, f"verify{repeat}", prompts,
                                          [[list(r.token_ids)] for r in plain], budget, seed)
            verify_steps_s += steps
            proposed += sum(r.proposed_tokens for r in verified)
    finally:
        engine.continuation = settings
    proposed /= rows * len(verify_steps_s)
    ratio = statistics.median(verify_steps_s) / statistics.median(plain_steps)
    cost = min(max((ratio - 1) / max(proposed, 1e-9), 0.0), MAX_COST)
    engine.continuation = replace(settings, token_cost=cost)
    return cost


def _timed_pass(engine, tag: str, prompts, pools, budget: int, seed: int):
    """Decode every prompt with its pool: (the seconds of each decode step, the results)."""
    requests = [RolloutRequest(f"cost-{tag}-{i}", p, sample_key(seed, 0, i, 0), budget,
                               proposals=Proposals(pool))
                for i, (p, pool) in enumerate(zip(prompts, pools))]
    engine.add(requests, SamplingParams(1.0))
    steps, results = [], []
    while engine.has_unfinished():
        began = time.perf_counter()
        results += engine.step()
        steps.append(time.perf_counter() - began)
    prefill = len(steps) - max(r.decode_steps for r in results)
    return steps[prefill:], results

