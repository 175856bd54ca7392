"""The vocab-parallel verifier over 2 and 4 gloo processes equals the single-process verifier exactly."""

import pytest
import torch
import torch.distributed as dist

from megatron_bubblespec.distributed import destroy_distributed, init_process_group
from megatron_bubblespec.distributed.launch import launch_local
from megatron_bubblespec.sampling import SamplingParams, keyed_sample, sample_key
from megatron_bubblespec.speculative import verify_keyed

pytestmark = pytest.mark.slow   # multi-process or real-model runs: minutes on 2 cores

VOCAB, PADDED = 61, 64  # the last 3 columns are vocabulary padding, as Megatron adds
PARAMS = [SamplingParams(0.0), SamplingParams(1.0), SamplingParams(0.7),
          SamplingParams(1.0, top_k=5), SamplingParams(0.9, top_p=0.8)]


def _problem(seed=0, batch=24, width=6):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, width + 1, PADDED, generator=g) * 2.0
    logits[:4, :, 40] = logits[:4, :, 8] = 9.0   # exact ties across shards: lowest id must win
    logits[:, :, VOCAB:] = 30.0                   # padding that must never be drawn
    keys = torch.tensor([sample_key(seed, 1, i, 0) for i in range(batch)])
    starts = torch.randint(0, 50, (batch,), generator=g)
    lens = torch.randint(0, width + 1, (batch,), generator=g)
    return logits, keys, starts, lens


def _drafts(logits, keys, starts, params, seed):
    """Half the rows draft the target's own draws (long accepted prefixes), half random tokens."""
    b, w1, v = logits.shape
    truth = keyed_sample(logits.reshape(b * w1, v), keys.repeat_interleave(w1),
                         (starts.view(-1, 1) + torch.arange(w1)).reshape(-1), params,
                         vocab_size=VOCAB).view(b, w1)[:, :-1]
    g = torch.Generator().manual_seed(seed + 1)
    noise = torch.randint(0, VOCAB, truth.shape, generator=g)
    cut = torch.randint(0, w1, (b, 1), generator=g)
    mixed = torch.where(torch.arange(w1 - 1) < cut, truth, noise)
    return torch.where(torch.arange(b).view(-1, 1) % 2 == 0, mixed, noise)


def _vocab_parallel_worker(seed):
    world = init_process_group(backend="gloo", timeout_s=120)
    rank, size = world.rank, world.world_size
    width = PADDED // size
    logits, keys, starts, lens = _problem(seed)
    results = []
    for params in PARAMS:
        draft = _drafts(logits, keys, starts, params, seed)
        shard = logits[..., rank * width:(rank + 1) * width]
        got = verify_keyed(shard, draft, lens, keys, starts, params, eos_token_ids=[3],
                           vocab_offset=rank * width, vocab_size=VOCAB, group=dist.group.WORLD)
        results.append((got.accepted, got.next_token, got.finished))
    destroy_distributed()
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_vocab_parallel_verifier_equals_single_process(world_size):
    seed = 11
    per_rank = launch_local(_vocab_parallel_worker, world_size, seed)
    logits, keys, starts, lens = _problem(seed)
    total_accepted = 0
    for i, params in enumerate(PARAMS):
        draft = _drafts(logits, keys, starts, params, seed)
        want = verify_keyed(logits, draft, lens, keys, starts, params, eos_token_ids=[3],
                            vocab_size=VOCAB)
        total_accepted += int(want.accepted.sum())
        assert int(want.next_token.max()) < VOCAB
        for rank_result in per_rank:
            accepted, next_token, finished = rank_result[i]
            assert torch.equal(accepted, want.accepted), (params, accepted, want.accepted)
            assert torch.equal(next_token, want.next_token), params
            assert torch.equal(finished, want.finished), params
    assert total_accepted > 20  # the comparison covered real accepted prefixes, not only rejections
