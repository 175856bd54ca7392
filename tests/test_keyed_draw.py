"""The sparse keyed draw returns ``keyed_sample``'s tokens bit for bit: many rows, temperatures,
top-k / top-p, peaked and flat logits, ties, -inf logits and vocabulary padding; and it hashes the
noise of few tokens (else it would not be cheaper)."""

import pytest
import torch

from megatron_bubblespec.rollout import keyed_draw
from megatron_bubblespec.rollout.keyed_draw import keyed_sample_sparse
from megatron_bubblespec.sampling import SamplingParams, keyed_sample, sample_key
from megatron_bubblespec.sampling.keyed import uniform_at

SETTINGS = [SamplingParams(1.0), SamplingParams(0.7), SamplingParams(1.3, top_k=50),
            SamplingParams(0.7, top_p=0.9), SamplingParams(1.0, top_k=20, top_p=0.5),
            SamplingParams(1.0, top_p=0.999), SamplingParams(0.0)]


def _logits(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.3, 1.0, 3.0, 8.0])[torch.arange(n) % 4].view(-1, 1)
    logits = torch.randn(n, vocab, generator=g) * scale
    logits[1::5, : vocab // 2] = logits[1::5, vocab // 2:]          # exact ties across halves
    logits[2::5] = logits[2::5].round()                             # many equal logits
    logits[3::5, ::3] = float("-inf")
    return logits


@pytest.mark.parametrize("params", SETTINGS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sparse_draw_equals_keyed_sample(params, dtype):
    n, vocab = 48, 3000
    logits = _logits(n, vocab, seed=hash(str(params)) % 1000).to(dtype)
    keys = torch.tensor([sample_key(5, 1, i // 4, i % 4) for i in range(n)])
    positions = torch.arange(n) * 7 % 500
    for vocab_size in (None, vocab - 37):
        want = keyed_sample(logits, keys, positions, params, vocab_size=vocab_size)
        got = keyed_sample_sparse(logits, keys, positions, params, vocab_size=vocab_size)
        assert torch.equal(got, want), (got != want).nonzero().flatten().tolist()


def test_sparse_draw_hashes_few_tokens(monkeypatch):
    n, vocab, params = 40, 49152, SamplingParams(0.7, top_p=0.9)
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(0)) * 3
    keys = torch.tensor([sample_key(1, 2, i, 0) for i in range(n)])
    hashed = []
    original = keyed_draw.uniform_at
    monkeypatch.setattr(keyed_draw, "uniform_at",
                        lambda *a: hashed.append(a[2].numel()) or original(*a))
    got = keyed_sample_sparse(logits, keys, torch.arange(n), params)
    assert torch.equal(got, keyed_sample(logits, keys, torch.arange(n), params))
    assert sum(hashed) < n * vocab / 20


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(1.0, top_k=5)], ids=str)
def test_tokens_whose_noise_rounds_to_infinity(params):
    """u = ((h >> 8) + 0.5) / 2**24 rounds to exactly 1.0 in float32 for h >> 8 = 2**24 - 1, so
    g = +inf: such a token wins an unmasked row (score +inf) and, masked, makes the score NaN,
    which torch.argmax also picks. The sparse draw finds these tokens by inverting the hash and
    must reproduce both outcomes. (A defect of sampling.keyed's u, not a property to keep: once u
    stays below 1, this test and ``_tokens_with_infinite_noise`` go.)"""
    vocab, key = 49152, sample_key(9, 9, 9, 9)
    positions = torch.arange(4000)
    keys = torch.full((4000,), key)
    rows, tokens = keyed_draw._tokens_with_infinite_noise(keys, positions, vocab)
    assert rows.numel() >= 4
    assert torch.equal(uniform_at(torch.full_like(tokens, key), positions[rows], tokens),
                       torch.ones(tokens.numel()))
    n = rows.numel()
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(1)) * 3
    logits[torch.arange(n), tokens] = -8.0       # improbable tokens, outside any top-5
    keys = torch.full((n,), key)
    want = keyed_sample(logits, keys, positions[rows], params)
    got = keyed_sample_sparse(logits, keys, positions[rows], params)
    assert torch.equal(got, want)
    assert torch.equal(want, tokens)   # the rounding makes them win, masked or not
