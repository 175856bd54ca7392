"""Draft packing, the DP all-gather exchange over gloo, and the filters that drop bad drafts."""

import warnings

import pytest
import torch

from megatron_bubblespec.distributed import destroy_distributed, init_process_group
from megatron_bubblespec.distributed.launch import launch_local
from megatron_bubblespec.spec.drafts import Draft, exchange, pack, select_drafts, unpack

DRAFTS = [Draft(0, -5, 3, (1, 2, 3)), Draft(7, 2**62, 3, ()), Draft(2, 9, 2, tuple(range(40)))]


def test_pack_round_trip():
    assert unpack(pack(DRAFTS)) == DRAFTS
    assert unpack(pack([])) == []


@pytest.mark.parametrize("mangle", [
    lambda t: t[:-5],                                     # truncated
    lambda t: torch.cat([t[:1], torch.tensor([-1]), t[2:]]),  # negative sample index
    lambda t: torch.cat([t[:4], torch.tensor([10**6]), t[5:]]),  # absurd length
])
def test_malformed_packs_warn_and_keep_only_what_parses(mangle):
    with pytest.warns(UserWarning):
        out = unpack(mangle(pack(DRAFTS)))
    assert all(d in DRAFTS for d in out)


def test_garbage_never_raises():
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(200):
            size = int(torch.randint(0, 30, (1,), generator=g))
            assert isinstance(unpack(torch.randint(-50, 50, (size,), generator=g)), list)


def test_select_keeps_mine_and_drops_bad_ones():
    expected = {0: -5, 2: 9, 5: 11}
    drafts = [Draft(0, -5, 3, (1, 2, 3)),        # kept
              Draft(7, 2**62, 3, (4,)),          # another rank's sample: silently ignored
              Draft(5, 12, 3, (1,)),             # wrong key: dropped
              Draft(2, 9, 2, (1, 500)),          # token outside the vocabulary: dropped
              Draft(0, -5, 3, (9,))]             # second draft for sample 0: dropped
    with pytest.warns(UserWarning) as caught:
        kept = select_drafts(drafts, expected, vocab_size=100, max_tokens=10)
    assert set(kept) == {0} and kept[0].tokens == (1, 2, 3)
    assert len(caught) == 3
    long = select_drafts([Draft(2, 9, 2, (1, 2, 3) * 10)], expected, vocab_size=100, max_tokens=10)
    assert long[2].tokens == ((1, 2, 3) * 10)[:10]


def _exchange_worker():
    world = init_process_group(backend="gloo", timeout_s=60)
    rank = world.rank
    mine = [Draft(10 * rank + i, rank, 1, tuple(range(rank + i))) for i in range(rank + 1)]
    out = exchange(mine)
    destroy_distributed()
    return out


def test_exchange_over_three_gloo_ranks():
    results = launch_local(_exchange_worker, 3)
    want = [Draft(10 * r + i, r, 1, tuple(range(r + i))) for r in range(3) for i in range(r + 1)]
    assert all(res == want for res in results)
