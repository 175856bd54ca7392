"""Keyed sampler: pinned noise bits (of the torch ops and of the C++ scan), a pure-Python
re-statement of the spec, cross-process bits, and draws distributed as softmax(logits / T)."""

import subprocess
import sys

import pytest
import torch
from scipy.stats import chisquare

from megatron_bubblespec.sampling import (
    SamplingParams,
    hash_kernel,
    keyed_sample,
    noise_bits,
    sample_key,
    truncation_mask,
    uniform_noise,
)

M32 = 0xFFFFFFFF

# (key as int64, response position, token id) -> h. Changing these breaks every stored draft.
GOLDEN_BITS = [
    (0, 0, 0, 1521706303),
    (1, 0, 0, 3124541448),
    (2391539541053276776, 0, 0, 843001154),
    (2391539541053276776, 1, 0, 2900140966),
    (2391539541053276776, 0, 1, 548024170),
    (-1, 7, 49151, 4275630394),
    (-(2**63), 2**32 - 1, 151935, 47285161),
    (2**63 - 1, 123456, 99, 52256982),
    (8585483631646850154, 42, 1000, 828358615),
]
GOLDEN_KEYS = [
    ((0, 0, 0, 0), 2391539541053276776),
    ((1234, 5, "gsm8k-17", 3), 8585483631646850154),
    ((1, 2, 3, 4), -3072355124115617029),
    ((2**64 - 1, 2**40, "x", 0), 3575052310533091246),
]

# Token ids drawn from fixed logits (exact in float32, with ties), keys and positions: pins the whole
# path uniform -> Gumbel -> temperature / top-k / top-p -> argmax, not only the noise bits.
GOLDEN_VOCAB, GOLDEN_ROWS, GOLDEN_POSITIONS = 50, 6, (0, 1, 7, 1000)
GOLDEN_DRAWS = {   # params -> one row of draws per position in GOLDEN_POSITIONS
    SamplingParams(0.0): [[18, 13, 8, 3, 27, 22]] * 4,
    SamplingParams(1.0): [[35, 38, 8, 31, 27, 43], [14, 31, 8, 49, 45, 43],
                          [3, 13, 29, 32, 23, 29], [36, 42, 11, 32, 23, 47]],
    SamplingParams(0.7): [[35, 38, 8, 21, 27, 43], [14, 31, 8, 3, 45, 43],
                          [3, 13, 29, 32, 45, 29], [36, 42, 11, 32, 23, 47]],
    SamplingParams(1.0, top_k=5): [[7, 42, 8, 21, 27, 22], [7, 31, 8, 3, 45, 22],
                                   [25, 13, 26, 32, 45, 29], [36, 42, 8, 32, 27, 22]],
    SamplingParams(1.0, top_p=0.8): [[3, 38, 8, 21, 27, 43], [14, 31, 8, 3, 45, 43],
                                     [3, 13, 29, 32, 23, 29], [36, 42, 11, 32, 23, 47]],
}


def _mix32_py(x):
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def _h_py(key, pos, tok, stream=0):
    """The docstring's specification, written independently with Python integers."""
    key &= 0xFFFFFFFFFFFFFFFF
    k_lo, k_hi = key & M32, key >> 32
    a = _mix32_py(k_lo ^ _mix32_py(k_hi ^ 0x9E3779B9 ^ stream))
    r1 = _mix32_py(a ^ _mix32_py(pos ^ 0x85EBCA6B))
    r2 = _mix32_py(r1 ^ 0xC2B2AE35)
    return _mix32_py((_mix32_py(tok ^ r1) + r2) & M32)


@pytest.mark.parametrize("key,pos,tok,expected", GOLDEN_BITS)
def test_golden_noise_bits(key, pos, tok, expected):
    assert int(noise_bits([key], [pos], [tok])[0, 0]) == expected
    assert _h_py(key, pos, tok) == expected


@pytest.mark.parametrize("params", list(GOLDEN_DRAWS), ids=str)
def test_golden_draws(params):
    logits = torch.tensor([[((v * 37 + r * 11) % 29) / 4.0 for v in range(GOLDEN_VOCAB)]
                           for r in range(GOLDEN_ROWS)])
    keys = torch.tensor([sample_key(1234, 3, f"golden-{r}", r % 2) for r in range(GOLDEN_ROWS)])
    draws = [keyed_sample(logits, keys, torch.full((GOLDEN_ROWS,), pos), params).tolist()
             for pos in GOLDEN_POSITIONS]
    assert draws == GOLDEN_DRAWS[params]


@pytest.mark.slow   # loading the extension runs ninja (a build on the first use)
def test_golden_noise_bits_of_the_cpp_scan():
    """The C++ scan of the sparse draw (``sampling.hash_kernel``) computes the same words: bounds
    that keep every token make it return each row's every word."""
    if hash_kernel.load() is None:
        pytest.skip(f"no C++ scan here: {hash_kernel.backend()}")
    keys = torch.tensor([key for key, _, _, _ in GOLDEN_BITS])
    positions = torch.tensor([pos for _, pos, _, _ in GOLDEN_BITS])
    width = max(tok for _, _, tok, _ in GOLDEN_BITS) + 1
    keep_all = torch.tensor([[-1e30], [1e30]]).expand(2, 1 << 12).contiguous()
    rows, ids, words, _ = hash_kernel.scan(torch.zeros(len(keys), width), keys, positions,
                                           keep_all, 20, 1e30)
    words = words.view(len(keys), width)
    assert [int(words[i, tok]) for i, (_, _, tok, _) in enumerate(GOLDEN_BITS)] == [
        expected for _, _, _, expected in GOLDEN_BITS]


@pytest.mark.parametrize("args,expected", GOLDEN_KEYS)
def test_golden_sample_keys(args, expected):
    assert sample_key(*args) == expected


def test_tensor_hash_matches_python_spec_on_random_triples():
    g = torch.Generator().manual_seed(7)
    keys = torch.randint(-(2**63), 2**63 - 1, (64,), generator=g)
    positions = torch.randint(0, 2**32, (64,), generator=g)
    tokens = torch.randint(0, 2**20, (50,), generator=g)
    for stream in (0, 1, 2):
        bits = noise_bits(keys, positions, tokens, stream)
        for i in range(0, 64, 7):
            for j in range(0, 50, 9):
                assert int(bits[i, j]) == _h_py(int(keys[i]), int(positions[i]), int(tokens[j]), stream)


def test_uniform_in_open_unit_interval_and_24_bit():
    u = uniform_noise(torch.arange(16), torch.arange(16), torch.arange(4096))
    assert u.dtype == torch.float32
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert torch.equal(u * 2**24 - 0.5, torch.round(u * 2**24 - 0.5))


@pytest.mark.slow
def test_same_bits_in_a_second_process():
    code = ("import torch;from megatron_bubblespec.sampling import noise_bits;"
            "print(noise_bits(torch.arange(-4,4)*1000003, torch.arange(8)*11, torch.arange(300)).sum().item(),"
            "noise_bits(torch.arange(-4,4)*1000003, torch.arange(8)*11, torch.arange(300))[3,77].item())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    here = noise_bits(torch.arange(-4, 4) * 1000003, torch.arange(8) * 11, torch.arange(300))
    assert out.stdout.split() == [str(here.sum().item()), str(here[3, 77].item())]


def test_keys_differ_in_every_field_and_accept_string_uids():
    base = sample_key(1, 2, 3, 4)
    assert len({base, sample_key(2, 2, 3, 4), sample_key(1, 3, 3, 4), sample_key(1, 2, 4, 4),
                sample_key(1, 2, 3, 5), sample_key(1, 2, "3", 4)}) == 6
    assert sample_key(1, 2, "abc", 4) == sample_key(1, 2, "abc", 4)
    assert -(2**63) <= base < 2**63


LOGITS = torch.tensor([1.2, -0.3, 0.5, 2.0, -1.5, 0.0, 0.9, -0.7])
N_KEYS = 24000


def _draw_counts(logits, params, n=N_KEYS, seed=0):
    keys = torch.tensor([sample_key(seed, 0, i, 0) for i in range(n)])
    positions = torch.arange(n) % 97
    tokens = keyed_sample(logits.expand(n, -1), keys, positions, params)
    return torch.bincount(tokens, minlength=logits.numel()).double()


def _pvalue(counts, probs):
    return chisquare(counts.numpy(), (probs * counts.sum()).numpy()).pvalue


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_draws_follow_softmax_over_temperature(temperature):
    counts = _draw_counts(LOGITS, SamplingParams(temperature))
    assert _pvalue(counts, torch.softmax(LOGITS.double() / temperature, -1)) > 1e-3
    # The same test rejects a sampler that gets the temperature wrong.
    wrong = torch.softmax(LOGITS.double() / (1.7 - temperature), -1)
    assert _pvalue(counts, wrong) < 1e-12


def test_draws_are_independent_across_positions_of_one_key():
    key = torch.tensor([sample_key(3, 1, "p", 0)]).expand(N_KEYS)
    tokens = keyed_sample(LOGITS.expand(N_KEYS, -1), key, torch.arange(N_KEYS), SamplingParams(1.0))
    counts = torch.bincount(tokens, minlength=LOGITS.numel()).double()
    assert _pvalue(counts, torch.softmax(LOGITS.double(), -1)) > 1e-3


def test_greedy_is_argmax_with_lowest_id_on_ties():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0]])
    out = keyed_sample(logits, torch.tensor([1, 2]), torch.tensor([0, 0]), SamplingParams(0.0))
    assert out.tolist() == [1, 0]


@pytest.mark.parametrize("params", [SamplingParams(1.0, top_k=3), SamplingParams(0.8, top_p=0.7),
                                    SamplingParams(1.0, top_k=5, top_p=0.6)])
def test_top_k_top_p_draws_follow_the_renormalised_kept_set(params):
    keep = truncation_mask(LOGITS.view(1, -1) / params.temperature, params)[0]
    counts = _draw_counts(LOGITS, params)
    assert counts[~keep].sum() == 0
    probs = torch.softmax((LOGITS.double() / params.temperature).masked_fill(~keep, float("-inf")), -1)
    assert _pvalue(counts[keep], probs[keep]) > 1e-3


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert truncation_mask(logits, SamplingParams(1.0, top_p=0.8))[0].tolist() == [True, True, False, False]
    assert truncation_mask(logits, SamplingParams(1.0, top_p=0.81))[0].tolist() == [True, True, True, False]
    assert truncation_mask(logits, SamplingParams(1.0, top_p=0.1))[0].tolist() == [True, False, False, False]


def test_padded_vocabulary_is_never_drawn():
    logits = torch.zeros(2000, 8)
    logits[:, 6:] = 50.0  # padding columns with huge logits
    keys = torch.tensor([sample_key(0, 0, i, 0) for i in range(2000)])
    for params in (SamplingParams(1.0), SamplingParams(0.0), SamplingParams(1.0, top_k=2)):
        out = keyed_sample(logits, keys, torch.zeros(2000, dtype=torch.long), params, vocab_size=6)
        assert int(out.max()) < 6


def test_invalid_params_are_refused_with_the_field_name():
    for kwargs, field in (({"temperature": -1}, "temperature"), ({"top_k": -2}, "top_k"),
                          ({"top_p": 0.0}, "top_p")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)
