"""The sparse keyed draw returns ``keyed_sample``'s tokens bit for bit, on the C++ scan and on the
torch path: many rows, temperatures, top-k / top-p, peaked and flat logits, ties, +-inf and NaN
logits, vocabulary padding and vocabularies of 50 to 151,936 tokens (also hypothesis-generated);
its noise bounds hold for every one of the 2**24 noise values; the C++ words equal the torch hash;
and it scores few tokens (else it would not be cheaper)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_bubblespec.sampling import keyed_draw
from megatron_bubblespec.sampling.keyed_draw import TABLE_BITS, keyed_sample_sparse, noise_bounds
from megatron_bubblespec.sampling import SamplingParams, hash_kernel, keyed_sample, sample_key
from megatron_bubblespec.sampling.keyed import MASK32, noise_bits, row_words, uniform_at

pytestmark = pytest.mark.slow

SETTINGS = [SamplingParams(1.0), SamplingParams(0.7), SamplingParams(1.5),
            SamplingParams(1.3, top_k=50), SamplingParams(0.7, top_p=0.9),
            SamplingParams(1.0, top_k=20, top_p=0.5), SamplingParams(1.0, top_p=0.999),
            SamplingParams(1.5, top_k=1), SamplingParams(0.0)]


def _cpp_or_skip():
    if hash_kernel.load() is None:
        pytest.skip(f"no C++ scan here: {hash_kernel.backend()}")


@pytest.fixture(params=["c++", "torch"])
def backend(request):
    if request.param == "c++":
        _cpp_or_skip()
    return request.param


def _logits(n, vocab, seed, scales=(0.3, 1.0, 3.0, 8.0)):
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor(scales)[torch.arange(n) % len(scales)].view(-1, 1)
    logits = torch.randn(n, vocab, generator=g) * scale
    logits[1::5, : vocab // 2] = logits[1::5, vocab // 2: 2 * (vocab // 2)]   # ties across halves
    logits[2::5] = logits[2::5].round()                                       # many equal logits
    logits[3::5, ::3] = float("-inf")
    return logits


def _keys(n, seed=5):
    return torch.tensor([sample_key(seed, 1, i // 4, i % 4) for i in range(n)])


def _assert_same(logits, keys, positions, params, backend, vocab_size=None):
    want = keyed_sample(logits, keys, positions, params, vocab_size=vocab_size)
    got = keyed_sample_sparse(logits, keys, positions, params, vocab_size=vocab_size,
                              backend=backend)
    assert torch.equal(got, want), (got != want).nonzero().flatten().tolist()


@pytest.mark.parametrize("params", SETTINGS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sparse_draw_equals_keyed_sample(params, dtype, backend):
    n, vocab = 48, 3000
    logits = _logits(n, vocab, seed=hash(str(params)) % 1000).to(dtype)
    positions = torch.arange(n) * 7 % 500
    for vocab_size in (None, vocab - 37):
        _assert_same(logits, _keys(n), positions, params, backend, vocab_size)


@pytest.mark.parametrize("vocab", [50, 49152, 151936])
@pytest.mark.parametrize("kind", ["flat", "peaked"])
@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7),
                                    SamplingParams(1.5, top_k=40),
                                    SamplingParams(1.0, top_p=0.95)], ids=str)
def test_model_sized_vocabularies_flat_and_peaked(vocab, kind, params, backend):
    """Flat rows (logits ~ N(0, 1): most tokens within reach of the noise) and peaked ones (a few
    tokens far above the rest, as a trained model's next token)."""
    n = 6 if vocab > 100_000 else 12
    g = torch.Generator().manual_seed(vocab + len(kind))
    logits = torch.randn(n, vocab, generator=g)
    if kind == "peaked":
        logits = logits * 2 - 10
        top = torch.randint(0, vocab, (n, 4), generator=g)
        logits.scatter_(1, top, torch.tensor([12.0, 11.0, 9.5, 9.5]).expand(n, 4))
    _assert_same(logits, _keys(n, seed=vocab), torch.arange(n) * 31, params, backend)


def test_special_values_and_nan_rows(backend):
    n, vocab = 10, 700
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(3)) * 2
    logits[0] = float("-inf")                         # nothing allowed: token 0, as argmax
    logits[1, 5], logits[1, 400] = float("inf"), float("inf")      # the first +inf wins
    logits[2, 17] = float("nan")                      # argmax takes the first NaN
    logits[3, :300] = float("-inf")
    logits[3, 650] = float("nan")
    logits[4] = 0.0                                   # one big tie: the noise decides
    logits[5, :] = float("-inf")
    logits[5, 699] = -3.0                             # one token left, at the very end
    keys, positions = _keys(n), torch.arange(n)
    for params in (SamplingParams(1.0), SamplingParams(0.7), SamplingParams(1.0, top_k=3)):
        _assert_same(logits, keys, positions, params, backend)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 9), vocab=st.integers(1, 900), scale=st.sampled_from([0.0, 0.1, 1.0, 4.0, 30.0]),
       temperature=st.sampled_from([0.0, 0.7, 1.0, 1.5]), top_k=st.sampled_from([0, 1, 5, 100]),
       top_p=st.sampled_from([1.0, 0.9, 0.3]), seed=st.integers(0, 2**31 - 1),
       specials=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(
           [float("-inf"), float("inf"), float("nan"), 0.0, 5.0])), max_size=6),
       float64=st.booleans(), pad=st.integers(0, 3), use_cpp=st.booleans())
def test_hypothesis_rows(n, vocab, scale, temperature, top_k, top_p, seed, specials, float64,
                         pad, use_cpp):
    if use_cpp and hash_kernel.load() is None:
        use_cpp = False
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, vocab, generator=g) * scale).round(decimals=1)
    for where, value in specials:
        logits.view(-1)[where % logits.numel()] = value
    if float64:
        logits = logits.double()
    keys = torch.randint(-(2**63), 2**63 - 1, (n,), generator=g)
    positions = torch.randint(0, 2**32, (n,), generator=g)
    params = SamplingParams(temperature, top_k, top_p)
    vocab_size = max(1, vocab - pad) if pad else None
    _assert_same(logits, keys, positions, params, "c++" if use_cpp else "torch", vocab_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bounds_hold_for_every_noise_value(dtype):
    """lo[b] <= g <= up[b] for all 2**24 values of u, g computed as ``gumbel_noise`` computes it."""
    bounds, g_max = noise_bounds(dtype)
    assert g_max == float(bounds[1].max())
    tightest = float("inf")
    for start in range(0, 1 << 24, 1 << 21):
        words = torch.arange(start, start + (1 << 21), dtype=torch.int64) << 8   # h >> 8 values
        g = keyed_draw._gumbel(keyed_draw.uniform_from_bits(words), dtype)
        bucket = words >> (32 - TABLE_BITS)
        assert bool((bounds[0, bucket] <= g).all()) and bool((g <= bounds[1, bucket]).all())
        assert float(g.max()) <= g_max
        tightest = min(tightest, float((bounds[1, bucket] - g).min()))
    assert tightest <= 2e-3     # the bounds are the buckets' own extremes plus the margin


def _keep_all_bounds(dtype):
    """Bounds that keep every token of a row (so the scan returns every word)."""
    bounds = torch.empty(2, 1 << TABLE_BITS, dtype=dtype)
    bounds[0], bounds[1] = -1e30, 1e30
    return bounds, 1e30


def test_cpp_words_equal_the_torch_hash():
    _cpp_or_skip()
    keys = torch.tensor([0, 1, -1, -(2**63), 2**63 - 1, sample_key(3, 4, "x", 5), 12345])
    positions = torch.tensor([0, 7, 2**32 - 1, 123456, 1, 99, 2**20])
    vocab = 5000
    bounds, g_max = _keep_all_bounds(torch.float32)
    rows, ids, words, nan_rows = hash_kernel.scan(torch.zeros(len(keys), vocab), keys, positions,
                                                  bounds, 32 - TABLE_BITS, g_max)
    assert not bool(nan_rows.any())
    assert torch.equal(rows, torch.arange(len(keys)).repeat_interleave(vocab))
    assert torch.equal(ids, torch.arange(vocab).repeat(len(keys)))
    assert torch.equal(words.view(len(keys), vocab), noise_bits(keys, positions, torch.arange(vocab)))


def test_scan_keeps_few_tokens_on_flat_and_peaked_rows():
    _cpp_or_skip()
    n, vocab = 32, 49152
    flat = torch.randn(n, vocab, generator=torch.Generator().manual_seed(0)) * 2
    peaked = flat.clone()
    peaked[:, :8] += 20.0
    bounds, g_max = noise_bounds(torch.float32)
    for logits in (flat, peaked):
        rows, _, _, _ = hash_kernel.scan(logits, _keys(n), torch.arange(n), bounds,
                                         32 - TABLE_BITS, g_max)
        assert torch.bincount(rows, minlength=n).max() <= 64


def test_torch_path_hashes_few_tokens(monkeypatch):
    n, vocab, params = 40, 49152, SamplingParams(0.7, top_p=0.9)
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(0)) * 3
    keys = torch.tensor([sample_key(1, 2, i, 0) for i in range(n)])
    hashed = []
    original = keyed_draw.token_bits
    monkeypatch.setattr(keyed_draw, "token_bits",
                        lambda *a: hashed.append(a[2].numel()) or original(*a))
    got = keyed_sample_sparse(logits, keys, torch.arange(n), params, backend="torch")
    assert torch.equal(got, keyed_sample(logits, keys, torch.arange(n), params))
    assert sum(hashed) < n * vocab / 20


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend"):
        keyed_sample_sparse(torch.zeros(1, 4), [0], [0], SamplingParams(1.0), backend="numba")


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
def test_the_largest_noise_word_stays_finite_and_masked_tokens_never_win(params, backend):
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
    assert torch.equal(keyed_sample_sparse(logits, keys, positions[rows], params,
                                           backend=backend), want)
    assert not torch.any(want == tokens)
