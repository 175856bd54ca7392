"""The sparse keyed draw returns ``keyed_sample``'s tokens bit for bit: many rows, temperatures,
top-k / top-p, peaked and flat logits, ties, -inf logits and vocabulary padding; and it hashes the
noise of few tokens (else it would not be cheaper)."""

import pytest
import torch

from megatron_bubblespec.rollout import keyed_draw
from megatron_bubblespec.rollout.keyed_draw import keyed_sample_sparse
from megatron_bubblespec.sampling import SamplingParams, keyed_sample, sample_key
from megatron_bubblespec.sampling.keyed import MASK32, row_words, uniform_at

pytestmark = pytest.mark.slow

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


_M1_INV, _M2_INV = pow(0x7FEB352D, -1, 1 << 32), pow(0x846CA68B, -1, 1 << 32)


def _mul32(x: torch.Tensor, const: int) -> torch.Tensor:
    """x * const mod 2**32 for 32-bit words in int64, in 16-bit halves (no int64 overflow)."""
    return (x * (const & 0xFFFF) + (((x * (const >> 16)) & 0xFFFF) << 16)) & MASK32


def _unmix32(h: torch.Tensor) -> torch.Tensor:
    """The inverse of ``sampling.keyed.mix32`` (lowbias32 is a bijection)."""
    x = h ^ (h >> 16)
    x = _mul32(x, _M2_INV)
    x = x ^ (x >> 15) ^ (x >> 30)
    x = _mul32(x, _M1_INV)
    return x ^ (x >> 16)


def _tokens_with_top_noise_word(keys, positions, width):
    """(row, token) pairs whose hash word h has h >> 8 == 2**24 - 1 (found by inverting the hash):
    the words whose float32 u = (h >> 8) + 0.5 over 2**24 rounds up to exactly 1.0 unclamped."""
    top_words = torch.arange(0xFFFFFF00, 0x100000000, dtype=torch.int64).reshape(1, -1)
    r1, r2 = row_words(keys.reshape(-1, 1), positions.reshape(-1, 1))
    tokens = _unmix32((_unmix32(top_words) - r2) & MASK32) ^ r1
    return torch.nonzero(tokens < width, as_tuple=True)[0], tokens[tokens < width]


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(1.0, top_k=5)], ids=str)
def test_the_largest_noise_word_stays_finite_and_masked_tokens_never_win(params):
    """The top hash word gives u = 1 - 2**-24, not 1.0 (g finite): such a token at logit -8 does
    not beat a row of N(0, 9) logits, and a masked one never wins; both draws agree."""
    vocab, key = 49152, sample_key(9, 9, 9, 9)
    positions = torch.arange(4000)
    rows, tokens = _tokens_with_top_noise_word(torch.full((4000,), key), positions, vocab)
    assert rows.numel() >= 4
    u = uniform_at(torch.full_like(tokens, key), positions[rows], tokens)
    assert torch.equal(u, torch.full_like(u, 1.0 - 2.0 ** -24))
    n = rows.numel()
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(1)) * 3
    logits[torch.arange(n), tokens] = -8.0       # improbable tokens, outside any top-5
    keys = torch.full((n,), key)
    want = keyed_sample(logits, keys, positions[rows], params)
    assert torch.equal(keyed_sample_sparse(logits, keys, positions[rows], params), want)
    assert not torch.any(want == tokens)
