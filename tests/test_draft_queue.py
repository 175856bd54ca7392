"""The draft queue: what each bubble drafts (steps, order, complete drafts), absorbing exchanged
drafts, and its checkpoint form."""

import pytest

from megatron_bubblespec.data.lookahead import LookaheadSampler
from megatron_bubblespec.speculative.drafts import Draft
from megatron_bubblespec.speculative.queue import DraftQueue, drafting_order


def _queue(lookahead=1, horizon=1, steps=10, budget=4, order="engines"):
    return DraftQueue(budget=budget, eos_token_ids=(2,), vocab_size=100, lookahead=lookahead,
                      horizon=horizon, num_steps=steps, order=order)


def test_drafting_order_alternates_over_the_ranks():
    batch = LookaheadSampler(0, 64, 4, dp_size=2, samples_per_prompt=2).batch(3)
    order = drafting_order(batch)
    assert sorted(order) == list(range(batch.num_samples))
    owners = [0 if order[i] in batch.rank_sample_range(0) else 1 for i in range(len(order))]
    assert owners == [0, 1] * (batch.num_samples // 2)


def test_draft_targets_stop_at_the_runs_last_step():
    assert _queue(1, 1).target_steps(3) == [4]
    assert _queue(1, 3).target_steps(3) == [4, 5, 6]
    assert _queue(2, 2).target_steps(3) == [5, 6]
    assert _queue(1, 3).target_steps(7) == [8, 9]
    assert _queue(1, 3).target_steps(9) == []


def test_a_draft_is_complete_at_eos_or_at_the_budget():
    def draft(*tokens):
        return Draft(1, 0, 1, 0, tokens)

    queue = _queue()
    assert not queue.is_complete(None)
    assert not queue.is_complete(draft())
    assert not queue.is_complete(draft(5, 6, 7))      # aborted mid-way: a later bubble extends it
    assert queue.is_complete(draft(5, 6, 2))          # ended with EOS
    assert queue.is_complete(draft(5, 6, 7, 8))       # ran to the draft budget


def test_the_queue_absorbs_exchanged_drafts_and_lists_what_is_left():
    """Complete drafts leave the to-draft list, partial ones stay (to be extended), a newer draft
    replaces the one it extends, a wrong key is dropped, and the queue survives a checkpoint."""
    sampler = LookaheadSampler(0, 64, 2, dp_size=2, samples_per_prompt=2)
    batches = [sampler.batch(4), sampler.batch(5)]
    queue = _queue(1, 2)
    keys = {(b.step, g): 1000 * b.step + g for b in batches for g in range(b.num_samples)}
    order = [(b.step, g) for b in batches for g in drafting_order(b)]
    assert queue.left_to_draft(batches) == order
    with pytest.warns(UserWarning, match="carries key"):
        kept = queue.absorb([Draft(4, 0, keys[4, 0], 3, (5, 2)),        # complete: EOS
                             Draft(4, 1, keys[4, 1], 3, (5, 6)),        # partial
                             Draft(5, 2, keys[5, 2], 3, (7, 8, 9, 9)),  # complete: budget
                             Draft(5, 3, 12345, 3, (7,))], keys)        # wrong key: dropped
    assert kept == 3 and len(queue) == 3
    assert queue.left_to_draft(batches) == [s for s in order if s not in {(4, 0), (5, 2)}]
    queue.absorb([Draft(4, 1, keys[4, 1], 4, (5, 6, 7))], keys)          # extended by a newer policy
    assert queue.get(4, 1).tokens == (5, 6, 7) and queue.get(4, 1).weight_version == 4
    restored = _queue(1, 2)
    restored.load_state_dict(queue.state_dict())
    assert restored.state_dict() == queue.state_dict() and restored.get(4, 1) == queue.get(4, 1)
    assert set(queue.pop(4)) == {0, 1} and queue.pop(4) == {} and len(queue) == 1


def test_the_stragglers_order_extends_the_running_drafts_first_longest_first():
    """Within each step: partial drafts by length (ties in engine order), then the undrafted
    samples round-robin over the engines; complete drafts are left out in either order; the
    steps keep their order."""
    sampler = LookaheadSampler(0, 64, 4, dp_size=2, samples_per_prompt=2)
    batches = [sampler.batch(4), sampler.batch(5)]
    keys = {(b.step, g): 1000 * b.step + g for b in batches for g in range(b.num_samples)}
    engines, stragglers = _queue(1, 2, budget=8), _queue(1, 2, budget=8, order="stragglers")
    drafts = [Draft(4, 1, keys[4, 1], 3, (5, 6)), Draft(4, 6, keys[4, 6], 3, (5, 6, 7, 8)),
              Draft(4, 3, keys[4, 3], 3, (5, 6)), Draft(4, 2, keys[4, 2], 3, (5, 2)),
              Draft(5, 7, keys[5, 7], 3, (9,))]
    for queue in (engines, stragglers):
        queue.absorb(drafts, keys)
    round_robin = {b.step: [g for g in drafting_order(b) if (b.step, g) != (4, 2)]
                   for b in batches}
    assert engines.left_to_draft(batches) == [(s, g) for s in (4, 5) for g in round_robin[s]]
    ties = [g for g in round_robin[4] if g in (1, 3)]
    undrafted = [g for g in round_robin[4] if g not in (1, 3, 6)]
    assert stragglers.left_to_draft(batches) == (
        [(4, 6)] + [(4, g) for g in ties] + [(4, g) for g in undrafted]
        + [(5, 7)] + [(5, g) for g in round_robin[5] if g != 7])


def test_refresh_lists_complete_drafts_of_older_weights_last_nearest_step_longest_first():
    """With refresh, once the partial and undrafted samples are listed, the complete drafts made
    by weights older than the bubble's follow, step by step, longest first; the complete drafts
    the bubble's own weights made, and every complete draft without refresh, are left out."""
    sampler = LookaheadSampler(0, 64, 2, dp_size=2, samples_per_prompt=2)
    batches = [sampler.batch(4), sampler.batch(5)]
    keys = {(b.step, g): 1000 * b.step + g for b in batches for g in range(b.num_samples)}
    plain, refresh = _queue(1, 2, budget=8), _queue(1, 2, budget=8)
    refresh.refresh = True
    drafts = [Draft(4, 0, keys[4, 0], 2, (5, 2)),                   # complete, old weights
              Draft(4, 1, keys[4, 1], 2, (5, 6, 7, 2)),             # complete, old, longer
              Draft(4, 2, keys[4, 2], 3, (5, 6, 2)),                # complete, this bubble's weights
              Draft(4, 3, keys[4, 3], 1, (5, 6)),                   # partial: extended, not refreshed
              Draft(5, 0, keys[5, 0], 1, (5, 6, 7, 8, 9, 9, 9, 9))]  # complete at the budget
    for queue in (plain, refresh):
        queue.absorb(drafts, keys)
    left = plain.left_to_draft(batches, weight_version=3)
    assert left == plain.left_to_draft(batches) == refresh.left_to_draft(batches)
    assert refresh.left_to_draft(batches, weight_version=3) == left + [(4, 1), (4, 0), (5, 0)]
    assert refresh.left_to_draft(batches, weight_version=2) == left + [(5, 0)]


def test_an_unknown_draft_order_is_refused():
    with pytest.raises(ValueError, match="draft order 'longest'"):
        DraftQueue(budget=4, eos_token_ids=(2,), vocab_size=100, order="longest")


# ------------------------------------------------------------------------------ drafting policy

class _Task:
    """Prompt i is [10 + i, 11 + i, 12 + i] with uid "p<i>"; EOS is 2."""

    name, size, eos_token_ids = "counting", 64, (2,)

    def prompt(self, index):
        from megatron_bubblespec.data.tasks import Prompt

        return Prompt(f"p{index}", index, [10 + index, 11 + index, 12 + index], "0")


def _policy(*overrides):
    from pathlib import Path

    from megatron_bubblespec.config import load_config
    from megatron_bubblespec.speculative.policy import DraftingPolicy
    from megatron_bubblespec.speculative.previous_epoch import ResponseMemory
    from megatron_bubblespec.speculative.samples import SampleBook

    cfg = load_config(Path(__file__).parents[1] / "configs" / "tiny.yaml",
                      ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=2",
                       "spec.max_draft_tokens=6", *overrides])
    sampler = LookaheadSampler(cfg.run.seed, _Task.size, 4, dp_size=2, samples_per_prompt=2)
    queue = DraftQueue.from_config(cfg, _Task.eos_token_ids, vocab_size=100)
    return DraftingPolicy(cfg, SampleBook(_Task(), sampler, cfg.run.seed), queue,
                          ResponseMemory())


def test_a_complete_draft_is_drafted_again_as_a_draft_to_verify_not_a_prefix():
    """spec.refresh_drafts with the engine verifier: a complete draft goes to the engine as the
    draft it verifies and proposes from (no prefix: the newer weights may diverge from it); a
    partial one stays the prefix to extend; with the Megatron verifier nothing is refreshed."""
    policy = _policy("spec.verifier=engine")
    assert policy.queue.refresh and not _policy().queue.refresh
    assert not _policy("spec.verifier=engine", "spec.refresh_drafts=false").queue.refresh
    keys = policy.book.keys(1)
    policy.absorb([Draft(1, 0, keys[1, 0], 0, (20, 21, 2)), Draft(1, 1, keys[1, 1], 0, (20, 21))])
    complete, partial = policy.drafting_request((1, 0)), policy.drafting_request((1, 1))
    assert complete.draft == [20, 21, 2] and complete.response_prefix == []
    assert complete.proposals.drafts == [[20, 21, 2]] and complete.proposals.own == 0
    assert partial.response_prefix == [20, 21] and partial.draft == []
    assert complete.drafting and partial.drafting


def test_the_policy_plans_each_sample_once_with_its_key_prompt_and_draft():
    from megatron_bubblespec.sampling import sample_key

    policy = _policy()
    book = policy.book
    keys = book.keys(1)
    with pytest.warns(UserWarning, match="sample 1 of step 1 carries key"):
        kept = policy.absorb([Draft(1, 0, keys[(1, 0)], 0, (7, 8)),
                              Draft(1, 1, keys[(1, 1)] + 1, 0, (3,))])   # a wrong key: dropped
    assert kept == 1
    plan = policy.plan(1, dp_rank=0)
    batch = book.batch(1)
    assert [s.index for s in plan.samples] == list(batch.rank_sample_range(0))
    for s in plan.samples:
        slot = batch.slot(s.index)
        assert s.prompt.index == slot.prompt_index and s.sample_index == slot.sample_index
        assert s.key == sample_key(policy.book.seed, 1, s.prompt.uid, s.sample_index)
    assert plan.drafts()[:2] == [(7, 8), ()]
    request = plan.requests(48)[0]
    assert (request.request_id, request.key, request.prompt_token_ids) == \
        ("s1-0", plan.samples[0].key, list(plan.samples[0].prompt.token_ids))
    assert policy.plan(1, dp_rank=0).drafts() == [()] * 4              # the queue gave them out
    policy.absorb([Draft(1, 5, keys[(1, 5)], 0, (9,))])
    assert policy.plan(1, dp_rank=1).drafts() == [(), (9,), (), ()]


def test_continuation_pools_a_prompts_drafts_and_a_partial_draft_is_extended():
    policy = _policy()
    keys = policy.book.keys(1)
    policy.absorb([Draft(1, 0, keys[(1, 0)], 0, (7, 8)), Draft(1, 1, keys[(1, 1)], 0, (7, 2)),
                   Draft(1, 2, keys[(1, 2)], 0, (4,))])
    # samples 0 and 1 share a prompt (2 samples per prompt); 2 has a prompt of its own
    # round-robin over the replicas; sample 1's draft ran to EOS: complete, not drafted again
    assert [g for _, g in policy.to_draft(0)][:4] == [0, 4, 5, 2]
    request = policy.drafting_request((1, 0))
    assert request.drafting and request.response_prefix == [7, 8] and request.max_new_tokens == 6
    assert policy.drafting_request((1, 3)).response_prefix == []
    plan = policy.plan(1, dp_rank=0)
    requests = policy.with_pools(plan, plan.requests(48))
    assert [r.proposals.drafts for r in requests] == [[[7, 8], [7, 2]], [[7, 8], [7, 2]],
                                                      [[4]], [[4]]]
    assert [r.proposals.own for r in requests] == [0, 1, 0, None]
    off = _policy("ablation.speculative_continuation=false")
    assert all(r.proposals == plan.requests(48)[0].proposals
               for r in off.with_pools(plan, plan.requests(48)))


def test_claims_fill_free_slots_and_pace_the_prefill():
    from megatron_bubblespec.speculative.claims import ClaimPolicy

    chunks = iter([[1, 2], [3, 4], [5, 6], [7]])

    def claim(policy, in_flight):
        return policy.claim(in_flight, lambda: next(chunks, None), lambda chunk: 10 * len(chunk))

    assert claim(ClaimPolicy(chunk=2, in_flight=5), 0) == [[1, 2], [3, 4], [5, 6]]
    assert claim(ClaimPolicy(chunk=2, in_flight=5), 4) == [[7]]       # one slot: a whole chunk
    assert claim(ClaimPolicy(chunk=2, in_flight=5), 0) == []           # the cursor ran dry
    chunks = iter([[1, 2], [3, 4], [5, 6]])
    paced = ClaimPolicy(chunk=2, in_flight=8, prefill_budget=25)
    assert claim(paced, 0) == [[1, 2], [3, 4]]   # 20 < 25 tokens: one more, then the budget
    assert claim(paced, 4) == [[5, 6]] and not paced.has_room(8) and paced.has_room(7)


def test_an_aborted_refresh_never_shortens_the_draft_it_agrees_with():
    """The bubble's results of refresh requests: finished -> the new draft (its tokens past the
    old draft's counted as new); cut by the barrier while still agreeing with the old draft ->
    nothing (the old draft stays); cut after diverging -> the new, partial draft."""
    from megatron_bubblespec.sampling.requests import RolloutResult
    from megatron_bubblespec.speculative.bubble import BubbleDrafter, BubbleStats

    drafter = BubbleDrafter(None, 2, None, None, None)
    old = (5, 6, 7, 8, 2)

    def result(rid, tokens, reason):
        return RolloutResult(rid, list(tokens), [0.0] * len(tokens), len(tokens), reason)

    pending = {f"r{i}": ((4, i), 100 + i, 0, 3, old) for i in range(3)}
    pending["x"] = ((4, 9), 109, 2, 3, ())                     # an extension, not a refresh
    stats = BubbleStats()
    drafts = drafter._collect([result("r0", (5, 6, 9, 2), "eos"),
                               result("r1", (5, 6, 7), "aborted"),
                               result("r2", (5, 6, 1), "aborted"),
                               result("x", (5, 6, 7), "aborted")], pending, 7, stats)
    assert [(d.sample_index, d.tokens, d.weight_version) for d in drafts] == [
        (0, (5, 6, 9, 2), 7), (2, (5, 6, 1), 7), (9, (5, 6, 7), 7)]
    assert stats.refreshed == 2 and stats.new_tokens == 2 + 1 + 1 and not pending
