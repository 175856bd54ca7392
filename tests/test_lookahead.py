"""Lookahead sampler: determinism, epochs without repeats, straddling steps, DP rank blocks, global
sample numbering, settings errors, resume from a state dict."""

import pytest

from megatron_bubblespec.data.lookahead import LookaheadSampler, epoch_permutation

SHAPES = [(10, 4), (7, 6), (16, 8), (17, 8), (40, 8), (9, 9)]   # (num_prompts, prompts_per_step)


def _flat(sampler, steps):
    return [i for t in range(steps) for i in sampler.batch(t).prompt_indices]


def test_pinned_permutation():
    # The schedule of every run and checkpoint depends on these orders.
    assert epoch_permutation(0, 0, 10).tolist() == [0, 9, 1, 6, 3, 5, 4, 2, 8, 7]
    assert LookaheadSampler(0, 10, 4).batch(2).prompt_indices == (8, 7, 3, 0)


def test_deterministic_and_seeded():
    a = [LookaheadSampler(5, 50, 8, 2, 4).batch(t) for t in range(20)]
    b = [LookaheadSampler(5, 50, 8, 2, 4).batch(t) for t in range(20)]
    assert a == b
    other = [LookaheadSampler(6, 50, 8, 2, 4).batch(t).prompt_indices for t in range(20)]
    assert other != [x.prompt_indices for x in a]


@pytest.mark.parametrize("num_prompts,per_step", SHAPES)
def test_every_epoch_is_a_permutation(num_prompts, per_step):
    sampler = LookaheadSampler(1, num_prompts, per_step)
    steps = 12 * num_prompts // per_step + 1
    flat = _flat(sampler, steps)
    for epoch in range(len(flat) // num_prompts):
        block = flat[epoch * num_prompts:(epoch + 1) * num_prompts]
        assert sorted(block) == list(range(num_prompts)), epoch
    assert len({tuple(flat[e * num_prompts:(e + 1) * num_prompts]) for e in range(10)}) > 1


@pytest.mark.parametrize("num_prompts,per_step", SHAPES)
def test_steps_straddling_epochs_hold_no_prompt_twice(num_prompts, per_step):
    sampler = LookaheadSampler(2, num_prompts, per_step)
    straddling = 0
    for t in range(40):
        batch = sampler.batch(t)
        assert len(set(batch.prompt_indices)) == per_step
        assert batch.epoch == t * per_step // num_prompts
        straddling += (t * per_step) // num_prompts != ((t + 1) * per_step - 1) // num_prompts
    assert straddling > 0 or num_prompts % per_step == 0


def test_epoch_boundary_continues_seamlessly():
    sampler = LookaheadSampler(0, 10, 4)
    # Steps 0, 1 and half of 2 are epoch 0; the rest of step 2 starts epoch 1.
    first = _flat(sampler, 2) + list(sampler.batch(2).prompt_indices[:2])
    assert sorted(first) == list(range(10))
    assert sampler.batch(2).epoch == 0 and sampler.batch(3).epoch == 1
    assert not set(sampler.batch(2).prompt_indices[2:]) & set(sampler.batch(2).prompt_indices[:2])


def test_random_access_equals_sequential():
    for num_prompts, per_step in SHAPES:
        sequential = [LookaheadSampler(3, num_prompts, per_step).batch(t) for t in range(60)]
        reverse = LookaheadSampler(3, num_prompts, per_step)
        assert [reverse.batch(t) for t in reversed(range(60))][::-1] == sequential
        assert LookaheadSampler(3, num_prompts, per_step).batch(59) == sequential[59]


def test_rank_blocks_and_samples():
    batch = LookaheadSampler(0, 100, 6, dp_size=3, samples_per_prompt=4).batch(7)
    assert batch.prompts_per_rank == 2 and batch.num_samples == 24
    blocks = [batch.rank_prompt_indices(r) for r in range(3)]
    assert sum(blocks, ()) == batch.prompt_indices
    assert batch.rank_samples(1) == [(p, s) for p in blocks[1] for s in range(4)]
    assert [batch.rank_sample_range(r) for r in range(3)] == [range(0, 8), range(8, 16),
                                                            range(16, 24)]
    for rank in range(3):
        for g, pair in zip(batch.rank_sample_range(rank), batch.rank_samples(rank)):
            slot = batch.slot(g)
            assert slot.rank == rank and (slot.prompt_index, slot.sample_index) == pair
            assert batch.global_index(slot.position, slot.sample_index) == g
    with pytest.raises(ValueError, match="rank 3"):
        batch.rank_prompt_indices(3)
    with pytest.raises(ValueError, match="global sample index 24"):
        batch.slot(24)


def test_settings_errors():
    with pytest.raises(ValueError, match=r"prompts_per_step=6 .*dp_size=4"):
        LookaheadSampler(0, 100, 6, dp_size=4)
    with pytest.raises(ValueError, match="exceeds num_prompts=5"):
        LookaheadSampler(0, 5, 6)
    with pytest.raises(ValueError, match="samples_per_prompt must be >= 1"):
        LookaheadSampler(0, 5, 1, samples_per_prompt=0)
    with pytest.raises(ValueError, match="step must be >= 0"):
        LookaheadSampler(0, 5, 1).batch(-1)


def test_advance_peek_and_resume():
    run = LookaheadSampler(11, 13, 4, dp_size=2, samples_per_prompt=3)
    seen = []
    for t in range(5):
        batch = run.advance()
        assert batch.step == t and run.peek() == run.batch(t + 1)   # lookahead of step t
        seen.append(batch)
    state = run.state_dict()
    assert state["seed"] == 11 and state["next_step"] == 5
    later = [run.advance() for _ in range(20)]

    resumed = LookaheadSampler(0, 13, 4, dp_size=2, samples_per_prompt=3)
    resumed.load_state_dict(state)
    assert resumed.seed == 11 and resumed.next_step == 5
    assert [resumed.advance() for _ in range(20)] == later
    assert [resumed.batch(t) for t in range(5)] == seen


def test_resume_with_other_settings_is_refused():
    state = LookaheadSampler(0, 13, 4, dp_size=2).state_dict()
    with pytest.raises(ValueError, match="num_prompts: checkpoint 13 vs now 14"):
        LookaheadSampler(0, 14, 4, dp_size=2).load_state_dict(state)
