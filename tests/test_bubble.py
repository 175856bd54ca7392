"""The DP barrier with bubble drafting over real gloo ranks and the real store: drafting happens only
inside the bubble, samples are claimed once, partial drafts come back, a missing rank times out."""

import datetime
import time

import pytest
import torch.distributed as dist

from megatron_bubblespec.distributed import destroy_distributed, init_process_group
from megatron_bubblespec.distributed.launch import launch_local
from megatron_bubblespec.distributed.world import default_store
from megatron_bubblespec.sampling.requests import RolloutRequest
from megatron_bubblespec.rollout.reference import ReferenceEngine
from megatron_bubblespec.sampling import SamplingParams, sample_key
from megatron_bubblespec.speculative.bubble import BubbleDrafter
from megatron_bubblespec.speculative.claims import ClaimPolicy

from conftest import OtherEngineArrives

pytestmark = pytest.mark.slow   # multi-process or real-model runs: minutes on 2 cores

NEXT_SAMPLES, DRAFT_TOKENS = 256, 400  # far more than a bubble can draft: drafts end partial


NEXT_STEP = 8
SAMPLES = [(NEXT_STEP, i) for i in range(NEXT_SAMPLES)]


def _next_request(sample):
    step, i = sample
    return RolloutRequest(f"draft-{step}-{i}", [5 + i % 7, 9, 11], sample_key(1, step, i // 4, i % 4),
                          DRAFT_TOKENS)


def _barrier_worker(path, delays, timeout_s, order=None, in_flight=4, prefix=()):
    world = init_process_group(backend="gloo", timeout_s=60)
    engine = ReferenceEngine(path)
    drafter = BubbleDrafter(default_store(), world.world_size, engine, SamplingParams(1.0),
                            ClaimPolicy(chunk=2, in_flight=in_flight), timeout_s=timeout_s)
    dist.barrier()   # one start line: the delays below, not the engines' load times, order arrivals
    if delays[world.rank] is None:  # a rank that hangs: never reaches the barrier
        time.sleep(3.0)
        return None, None, None
    time.sleep(delays[world.rank])  # the rank's own rollout
    try:
        def next_request(sample):   # an earlier bubble's partial draft, extended
            request = _next_request(sample)
            request.response_prefix = list(prefix)
            return request

        drafts, stats = drafter.arrive_and_draft(7, order or SAMPLES, next_request,
                                                 weight_version=7)
        out = (drafts, stats, None)
    except TimeoutError as err:
        out = (None, None, str(err))
    if None not in delays:
        # rank 0 hosts the store: it must outlive every rank's last look at the barrier (under
        # load a slow rank's last engine step ends after rank 0 would have left)
        dist.barrier()
    destroy_distributed()
    return out


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return tiny_checkpoint("llama")


def test_fast_ranks_draft_only_inside_the_bubble(tiny):
    results = launch_local(_barrier_worker, 3, tiny, [0.0, 0.3, 2.5], 120.0)
    (d0, s0, _), (d1, s1, _), (d2, s2, _) = results
    assert s2.last_to_arrive and not d2 and s2.drafting_s == 0.0
    claimed = [d.sample_index for d in d0 + d1]
    assert len(claimed) == len(set(claimed)) and claimed  # nothing drafted twice, something drafted
    for stats in (s0, s1):
        step_time = stats.drafting_s / max(stats.engine_steps, 1)
        assert stats.drafting_s <= stats.idle_s + step_time   # only while waiting
        # Stopped within a few steps of the close (unbounded drafting would run on for the 400-token
        # budget, ~28 s); the slack covers 3 processes sharing 2 cores (0.7 s seen once).
        assert stats.overshoot_s <= 10 * step_time + 1.0
    assert s0.idle_s > s1.idle_s  # the first to arrive waited longest
    assert s0.claimed_samples + s1.claimed_samples <= NEXT_SAMPLES  # every sample claimed once at most
    # Partial drafts are kept: some draft is shorter than the budget (aborted mid-way).
    assert any(len(d.tokens) < DRAFT_TOKENS for d in d0 + d1)
    for d in d0 + d1:
        assert d.step == NEXT_STEP and d.weight_version == 7
        assert d.key == _next_request((d.step, d.sample_index)).key


def test_drafts_are_prefixes_of_the_plain_generation(tiny):
    results = launch_local(_barrier_worker, 2, tiny, [0.0, 1.5], 120.0)
    drafts = [d for d in results[0][0] if d.tokens]
    assert len(drafts) >= 2, "the 1.5 s bubble drafted (almost) nothing: nothing to compare"
    full = ReferenceEngine(tiny).generate([_next_request((d.step, d.sample_index)) for d in drafts],
                                          SamplingParams(1.0))
    assert len(full) == len(drafts)
    for d, f in zip(drafts, full):
        assert list(d.tokens) == f.token_ids[:len(d.tokens)]


def test_a_rank_that_never_arrives_times_out_with_a_clear_message(tiny):
    results = launch_local(_barrier_worker, 2, tiny, [0.0, None], 1.5)
    message = results[0][2]
    assert message is not None and "only 1 of 2 rollout engines" in message and "step 7" in message


def test_the_cursor_hands_out_samples_in_the_given_order(tiny):
    """The loop drafts round-robin over the ranks that will roll the samples out; here the order
    is reversed: whatever the bubble drafted comes from the end."""
    order = list(reversed(SAMPLES))
    (drafts, stats, _), _ = launch_local(_barrier_worker, 2, tiny, [0.0, 1.0], 120.0, order)
    assert drafts and stats.claimed_samples < NEXT_SAMPLES
    assert min(d.sample_index for d in drafts) >= NEXT_SAMPLES - stats.claimed_samples


def test_a_drafting_rank_keeps_its_full_batch_in_flight(tiny):
    """spec.draft_in_flight rows at once: every engine step drafts one token for each of them.
    The bubble counts what it prefilled (prompt + earlier draft) and what it added."""
    (drafts, stats, _), _ = launch_local(_barrier_worker, 2, tiny, [0.0, 3.0], 120.0, None, 16,
                                         (13, 17))
    assert stats.claimed_samples >= 16 and stats.engine_steps > 2
    assert stats.new_tokens >= 12 * stats.engine_steps  # ~16 rows per step, not 4
    assert all(d.tokens[:2] == (13, 17) for d in drafts)
    assert stats.new_tokens == stats.drafted_tokens - 2 * len(drafts)
    assert stats.prefill_tokens == (3 + 2) * stats.claimed_samples


def _paced_bubble(path, budget, step, prefix_len, arrive_after, computed=None):
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=10))
    drafter = BubbleDrafter(store, 2, None, SamplingParams(1.0),
                            ClaimPolicy(chunk=1, in_flight=12, prefill_budget=budget))
    drafter.computed = dict(computed or {})
    drafter.engine = OtherEngineArrives(ReferenceEngine(path), store, step, arrive_after)

    def next_request(sample):
        request = _next_request(sample)
        request.response_prefix = [13] * prefix_len
        return request

    samples = [(step + 1, i) for i in range(12)]
    drafts, stats = drafter.arrive_and_draft(step, samples, next_request, weight_version=step)
    return drafter, drafts, stats


def test_a_prefill_budget_fills_the_drafting_batch_over_short_engine_steps(tiny):
    """spec.draft_prefill_tokens: each engine step of the bubble takes new requests only up to
    the budget (prompt + earlier draft, 3 + 20 tokens each here: 3 per step at 50), so the step
    in flight when the barrier closes is short; without a budget all 12 go into the first step.
    What this engine drafted itself counts as computed: extending it costs (almost) nothing."""
    _, _, unpaced = _paced_bubble(tiny, 0, 7, 20, 6)
    drafter, drafts, paced = _paced_bubble(tiny, 50, 7, 20, 6)
    assert drafter.engine.per_step == [3, 3, 3, 3, 0, 0]
    assert paced.claimed_samples == unpaced.claimed_samples == 12
    assert paced.prefill_tokens == unpaced.prefill_tokens == 12 * 23
    assert len(drafts) == 12 and paced.engine_steps == 6
    # the next bubble (step 8) extends these drafts: it ran prompt + draft of each already
    computed = drafter.computed
    assert sorted(computed) == [(8, i) for i in range(12)]
    assert all(computed[(8, d.sample_index)] == 3 + len(d.tokens) for d in drafts)
    again, _, _ = _paced_bubble(tiny, 50, 7, 20, 3, computed)
    assert again.engine.per_step[0] == 12   # estimated prefill: 0 tokens each
    later, _, _ = _paced_bubble(tiny, 50, 8, 20, 3, computed)
    assert later.engine.per_step[0] == 3    # other samples: nothing computed for them
    assert {s for s, _ in later.computed} == {9}   # step 8's samples are due now: forgotten
