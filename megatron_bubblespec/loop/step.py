"""One synchronous step t on one rank: plan -> verify -> rollout -> bubble -> exchange -> learn ->
reshard.

Invariant (asserted): every token that reaches the learner at step t was drawn by the keyed
sampler from the weights of version t, either by the rollout engine or by the verifier; drafts are
only proposals, whatever version made them.

Each stage is one call in ``run_step``, given what it uses. Who does what: every rank of a model
replica verifies, learns and reshards (collectives, in the training layout); the replica's samples
are split round-robin over its rollout engines (``loop.layout``), each driven by its first rank
through the rollout and the bubble (the other ranks of a tensor-parallel engine follow it in
lockstep); the engines' results come back to every rank of the replica for learning. What is
drafted, verified, proposed and remembered is the replica's ``speculative.policy.DraftingPolicy``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_bubblespec.config import Config
from megatron_bubblespec.loop.layout import RolloutLayout
from megatron_bubblespec.loop.lockstep import follow
from megatron_bubblespec.loop.replica import Replica, RunState
from megatron_bubblespec.loop.rewarding import score_rewards
from megatron_bubblespec.loop.step_metrics import EngineRollout, bubble_metrics, engine_metrics
from megatron_bubblespec.sampling.requests import RolloutResult
from megatron_bubblespec.speculative.bubble import BubbleDrafter
from megatron_bubblespec.speculative.drafts import Draft, exchange
from megatron_bubblespec.speculative.policy import DraftingPolicy
from megatron_bubblespec.speculative.samples import StepPlan
from megatron_bubblespec.speculative.verifier import verify_drafts
from megatron_bubblespec.train.grpo import group_advantages
from megatron_bubblespec.train.onpolicy import check_on_policy
from megatron_bubblespec.train.batch import GRPOBatch, gather_responses
from megatron_bubblespec.train.draft_weights import k3


@dataclass
class StepOutput:
    rank_metrics: dict            # this DP rank's raw metrics (see metrics.aggregate)
    global_metrics: dict          # identical on every rank (trainer metrics)
    rollouts: dict[int, list[int]]  # global sample index -> response tokens


def run_step(rep: Replica, step: int) -> StepOutput:
    """Step ``step`` on this rank: the stages of docs/design/README.md, each one call."""
    cfg, policy, layout, version = rep.cfg, rep.policy, rep.layout, rep.state.weight_version
    plan = policy.plan(step, layout.dp_rank)        # the replica's samples and their drafts

    rep.beat(step, "verify")
    verified = verify_drafts(rep.verifier, plan.requests(cfg.rollout.max_new_tokens),
                             plan.drafts())                                         # 1 verify
    rep.beat(step, "rollout")
    mine = rollout(rep.engine if layout.leads_engine else rep.engine_shard, layout,
                   policy.with_pools(plan, verified.requests), rep.params, version)  # 2 rollout
    rep.beat(step, "bubble")
    drafted = bubble(rep.drafter, policy, step, version)                            # 3 bubble
    exchange_drafts(policy, step, drafted, rep.world_group)                        # 4 exchange
    results = collect_results(layout, rep.replica_group, mine)
    policy.remember(plan, results, group=_data_parallel_group())

    rep.beat(step, "learn")
    rewards, reward_s = score_rewards(rep.task, rep.replica_group, plan.samples, results)
    sync_metrics, train_metrics = learn(rep.trainer, rep.engine_shard, cfg, plan, results,
                                        rewards, version, rep.draft_weights)        # 5 learn
    rep.beat(step, "reshard")
    sync_metrics.update(reshard(rep.resharder, rep.engine_shard, rep.state,
                                cfg.rollout.sleep_during_train))                    # 6 reshard

    if mine is None:      # a follower of a tensor-parallel engine: its leader reports
        return StepOutput(None, train_metrics, {})
    if drafted is not None:
        mine.bubble = drafted[1]
    if layout.local_engine:   # the replica's bytes are counted once, by its engine 0
        sync_metrics.pop("sync/reshard_bytes")
    share = layout.share
    measured = cfg.spec.enabled and cfg.ablation.measure_proposal_cost
    metrics = engine_metrics(mine, share(verified.drafted), share(verified.settled(results)),
                             verified.seconds, share(rewards), sync_metrics, version,
                             {"train/reward_s": reward_s,
                              **({"spec/proposal_token_cost": rep.engine.spec_token_cost}
                                 if measured else {})})
    return StepOutput(metrics, train_metrics,
                      {s.index: list(r.token_ids) for s, r in zip(share(plan.samples),
                                                                  mine.results)})


def _check_engine_version(engine, version: int) -> None:
    if engine.weight_version != version:
        raise RuntimeError(f"rollout engine holds weight version {engine.weight_version}, the "
                           f"trainer {version}: its tokens would be off-policy (a reshard was "
                           "missed or failed)")


def rollout(engine, layout: RolloutLayout, requests, params, version: int) -> EngineRollout | None:
    """Stage 2: each engine (weights of version t) completes its share of the replica's samples
    from their fixed prefixes.

    Engine leaders (``engine``: the engine they drive) return their share's results. The other
    ranks of a tensor-parallel engine (``engine``: their shard) run the leader's engine calls on
    their shard (this rollout, then the bubble's drafting) until the leader releases them, and
    return None."""
    if not layout.leads_engine:
        from megatron_bubblespec.distributed.vllm_groups import engine_cpu_group

        group = engine_cpu_group()
        follow(engine, dist.get_process_group_ranks(group)[0], group)
        return None
    _check_engine_version(engine, version)
    start = time.perf_counter()
    results = engine.generate(layout.share(requests), params)
    return EngineRollout(results, time.perf_counter() - start, engine.last_engine_steps)


def bubble(drafter: BubbleDrafter | None, policy: DraftingPolicy, step: int,
           version: int) -> tuple[list[Draft], dict] | None:
    """Stage 3 (engine leaders, the ranks with a drafter): draft the coming steps' samples while
    waiting at the DP barrier -> the new drafts and the bubble's metrics.

    The bubble drafts step t+1 (t+k with ``ablation.draft_lookahead``) first and, with
    ``spec.draft_horizon`` H > 1, the steps after it too: a step may hold fewer samples than the
    engine serves at about the cost of one engine step, so the later steps' samples fill the
    drafting batch and a long bubble drafts several steps ahead. A partial draft is extended by
    the newer policy (the old draft is the request's prefix); with ``spec.refresh_drafts``, a
    complete one made by older weights is drafted again once nothing else is left."""
    if drafter is None:
        return None
    samples = policy.to_draft(step, version)
    drafts, stats = drafter.arrive_and_draft(step, samples, policy.drafting_request, version)
    drafter.engine.release()
    return drafts, bubble_metrics(stats, bool(samples))


def exchange_drafts(policy: DraftingPolicy, step: int, drafted, group) -> None:
    """Stage 4: all-gather the engines' new drafts over the world, and queue every engine's drafts
    by step on every rank (the same queue everywhere)."""
    if not policy.drafted_steps(step):   # the same on every rank: collective or nothing
        return
    policy.absorb(exchange(drafted[0] if drafted else [], group=group))


def collect_results(layout: RolloutLayout, group,
                    mine: EngineRollout | None) -> list[RolloutResult]:
    """The replica's engines' shares -> every rank of the replica, in sample order."""
    shares: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(shares, (layout.local_engine, mine.results if mine else None),
                           group=group)
    by_engine = dict((e, results) for e, results in shares if results is not None)
    return layout.merge([by_engine[e] for e in range(layout.engines_per_replica)])


def _data_parallel_group():
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group()


def learn(trainer, engine, cfg: Config, plan: StepPlan, results: list[RolloutResult], rewards,
          version: int, probe=None) -> tuple[dict, dict]:
    """Stage 5: group advantages -> GRPO step on Megatron; engine-vs-Megatron gap (from the
    step's own forward, weights of ``version``) and policy drift (one more forward with the new
    weights). ``engine`` (this rank's engine or shard) sleeps meanwhile when the config asks;
    ``probe`` (``ablation.measure_draft_weights``) also measures extrapolated drafting weights.

    The learner reads the engine's tokens and nothing else of it: the GRPO ratio's old logprobs
    are the step's own Megatron forward's (``train.batch``), so the weights do not depend on the
    engine steps a token's engine logprob came from (wherever those round differently). The engine's
    logprobs feed the on-policy check (at T = 1, the logits the engine reports) and, only with
    ``train.tis_cap``, the correction that reads them."""
    advantages = group_advantages(torch.tensor([x.total for x in rewards]),
                                  cfg.rollout.samples_per_prompt,
                                  scale_by_std=cfg.train.normalize_advantage_std)
    engine_logprobs = [r.logprobs for r in results]
    batch = GRPOBatch.from_responses([list(s.prompt.token_ids) for s in plan.samples],
                                     [r.token_ids for r in results], engine_logprobs, advantages)
    if cfg.rollout.sleep_during_train:   # the KV cache (and at level 2 the weights) freed
        engine.sleep(cfg.rollout.sleep_level)
    trainer.restore_training_state()     # after train.offload_during_rollout
    if probe is not None:   # ablation.measure_draft_weights: W_t, for the next step's comparison
        probe.before_step(trainer)
    metrics, before, raw_before = trainer.train_step(batch)   # Megatron's logprobs, weights t
    gap = check_on_policy(engine_logprobs, gather_responses(raw_before, batch.response_mask),
                          cfg.model.dtype, step=plan.step, weight_version=version)
    after = trainer.logprobs(batch.tokens, batch.response_mask)
    mask = batch.response_mask
    # k3 estimator of KL(pi_t || pi_t+1) on tokens drawn from pi_t: non-negative, unbiased.
    drift = k3(after, before, mask)
    measured = {} if probe is None else probe.measure(trainer, batch.tokens, mask, after)
    if cfg.train.offload_during_rollout:
        trainer.offload_training_state()     # the engines get the GPU until the next step
    return {"sync/logprob_abs_diff": gap, "policy/drift_kl": drift, **measured}, metrics


def reshard(resharder, engine, state: RunState, asleep: bool) -> dict:
    """Stage 6: Megatron shards -> full HF tensors -> the engine (this rank's own engine or shard:
    every rank of a TP engine loads its shard); weight version t -> t+1."""
    if asleep:
        engine.wake_up(["weights"])
    state.weight_version += 1
    stats = resharder.sync(engine, state.weight_version)
    if asleep:
        engine.wake_up(["kv_cache"])
    _check_engine_version(engine, state.weight_version)
    return {"sync/reshard_s": stats.seconds, "sync/reshard_bytes": stats.bytes}


def gather_step(rep: Replica, out: StepOutput):
    """Every rank's StepOutput -> rank 0 (the engine leaders', in engine order; None elsewhere)."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (rep.layout.engine_index, out), group=rep.world_group)
    if dist.get_rank() != 0:
        return None
    return [o for _, o in sorted(everyone, key=lambda pair: pair[0]) if o.rank_metrics is not None]
