"""Logits [N, V] + keys + positions -> the keyed sampler's tokens, scoring few tokens' noise exactly.

``sampling.keyed_sample`` hashes the Gumbel noise of every (row, token) and, with top-p, sorts
every row in float64; at a 49k-152k vocabulary on (k + 1) rows per request that costs more than
the forward on a CPU. This module returns the same tokens, bit for bit, by computing the exact
score logits / T + g only where it can matter:

* Bounds on the noise: u takes 2**24 values, and g = -log(-log u) grows with u. ``noise_bounds``
  splits the words h into ``2**TABLE_BITS`` buckets by their top bits and holds, per bucket, the g
  of its smallest and of its largest u, computed with the sampler's own torch operations in the
  logits' dtype, widened by ``_MARGIN`` (far above the few ulps by which a vectorised log may
  deviate from monotone). So lo <= g <= up for every word, and x + lo <= score <= x + up for a
  token of scaled logit x (float addition is monotone).
* Pruning: the largest lower bound of a row is a bar that the winner's score reaches; a token whose
  upper bound is below it cannot win. On CPU one C++ pass per row (``sampling.hash_kernel``) hashes
  the integer words, looks up the bounds and keeps the tokens whose upper bound reaches the bar (a
  few per row, peaked or flat). Without the compiled scan (or off the CPU) torch operations do the
  same in two steps: the exact scores of each row's best ``PROBE`` tokens and the largest noise
  ``G_MAX`` select the candidates, whose words are hashed (row words once per row) and pruned by
  the bounds.
* The kept tokens' u and g come from their words through the sampler's torch operations
  (``uniform_from_bits``, then -log(-log u) in the logits' dtype, padded to whole vectors as over
  whole rows), their exact scores are compared, and ties go to the lowest id, as ``torch.argmax``
  over the whole row does. A row holding a NaN is drawn by ``keyed_sample`` itself.
* top-k: the same ``torch.topk`` threshold as ``sampling.truncation_mask``. top-p: the same float64
  softmax over the row, but only the most probable tokens are sorted (stable, ids ascending among
  equal probabilities) and summed in order, doubling their number until the kept mass is reached;
  the sorted prefix and its running sum are the full sort's first entries, so the nucleus is the
  same set. T = 1 skips the division (x / 1 is x).

``tests`` compare the tokens with ``keyed_sample`` on many rows, settings, vocabulary sizes and both
paths, and the bounds with every one of the 2**24 noise values.
"""

from __future__ import annotations

import functools

import torch

from megatron_bubblespec.sampling import SamplingParams, hash_kernel, keyed_sample, truncation_mask
from megatron_bubblespec.sampling.keyed import row_words, token_bits, uniform_from_bits

PROBE = 8            # torch path: tokens per row whose exact scores set the first bar
TABLE_BITS = 12      # buckets of noise words: 4096 pairs of bounds (32 KiB in float32)
_SHIFT = 32 - TABLE_BITS
_PAD = 64            # element multiple of the gathered tensors (whole vector iterations)
_MARGIN = 1e-3       # the bounds are widened by this much: a superset of candidates is harmless
BACKENDS = ("auto", "c++", "torch")


def _gumbel(u: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """g of ``sampling.keyed.gumbel_noise`` for a flat float32 u, padded to whole vectors."""
    n = u.numel()
    padded = torch.full((-(-n // _PAD) * _PAD,), 0.5, dtype=torch.float32, device=u.device)
    padded[:n] = u
    padded = padded.to(dtype)
    return (-torch.log(-torch.log(padded)))[:n]


@functools.lru_cache(maxsize=None)
def _bounds(dtype: torch.dtype, device: str) -> tuple[torch.Tensor, float]:
    buckets = torch.arange(1 << TABLE_BITS, dtype=torch.int64)
    low = _gumbel(uniform_from_bits(buckets << _SHIFT), dtype) - _MARGIN
    high = _gumbel(uniform_from_bits((buckets << _SHIFT) | ((1 << _SHIFT) - 1)), dtype) + _MARGIN
    table = torch.stack([low, high]).contiguous().to(device)
    return table, float(high[-1])


def noise_bounds(dtype: torch.dtype, device: torch.device | str = "cpu") -> tuple[torch.Tensor, float]:
    """([2, 2**TABLE_BITS]: the lower and the upper bound on g per bucket ``h >> (32 -
    TABLE_BITS)``, in ``dtype``; the largest upper bound, G_MAX)."""
    return _bounds(dtype, str(device))


def _top_p_keep(scaled: torch.Tensor, keep: torch.Tensor, top_p: float) -> torch.Tensor:
    """``keep`` narrowed to the nucleus, as ``sampling.truncation_mask`` computes it."""
    masked = scaled.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(masked.double(), dim=-1)
    out = torch.zeros_like(keep)
    for row in range(probs.shape[0]):
        p = probs[row]
        if not bool(torch.isfinite(p).all()):   # NaN or -inf only: the full sort decides
            out[row] = truncation_mask(masked[row:row + 1], SamplingParams(1.0, top_p=top_p))[0]
            continue
        m = min(64, p.numel())
        while True:
            threshold = torch.topk(p, m).values[-1]
            ids = torch.nonzero(p >= threshold).squeeze(-1)          # ascending ids
            order = torch.sort(p[ids], descending=True, stable=True).indices
            sorted_probs = p[ids[order]]
            mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            kept = mass_before < top_p
            kept[0] = True
            if not bool(kept[-1]) or ids.numel() == p.numel():
                break
            m = min(2 * m, p.numel())
        out[row, ids[order[kept]]] = True
    return out


def _scaled(logits: torch.Tensor, params: SamplingParams, vocab_size: int | None) -> torch.Tensor:
    """logits / T in the sampler's dtype, -inf outside the vocabulary and outside top-k / top-p."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    scaled = logits.to(dtype)
    width = logits.shape[-1]
    if vocab_size is not None and width > vocab_size:
        padding = torch.arange(width, device=logits.device) >= vocab_size
        scaled = scaled.masked_fill(padding, float("-inf"))
    if params.temperature != 1.0:
        scaled = scaled / params.temperature
    if not params.truncates:
        return scaled
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if params.top_k > 0 and params.top_k < width:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        keep &= scaled >= kth
    if params.top_p < 1.0:
        keep = _top_p_keep(scaled, keep, params.top_p)
    return scaled.masked_fill(~keep, float("-inf"))


def _torch_candidates(allowed: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                      bounds: torch.Tensor, g_max: float):
    """(rows, ids, words, nan_rows) as ``hash_kernel.scan`` returns them (not in row order), on
    torch operations."""
    n, width = allowed.shape
    r1, r2 = row_words(keys, positions)
    nan_rows = torch.isnan(allowed).any(dim=-1)
    probe = torch.topk(allowed, min(PROBE, width), dim=-1).indices
    words = token_bits(r1.unsqueeze(-1), r2.unsqueeze(-1), probe)
    bar = (allowed.gather(-1, probe) + _gumbel(uniform_from_bits(words.reshape(-1)),
                                               allowed.dtype).view(n, -1)).max(dim=-1).values
    finite = bar > float("-inf")
    rows, ids = torch.nonzero((allowed + g_max >= bar.unsqueeze(-1)) & finite.unsqueeze(-1),
                              as_tuple=True)          # row-major: ids ascending per row
    words = token_bits(r1[rows], r2[rows], ids)
    x = allowed[rows, ids]
    bucket = words >> _SHIFT
    bar = bar.scatter_reduce(0, rows, x + bounds[0, bucket], reduce="amax")
    kept = x + bounds[1, bucket] >= bar[rows]
    rows, ids, words = rows[kept], ids[kept], words[kept]
    if not bool(finite.all()):       # -inf only: token 0, as torch.argmax takes it
        empty = torch.nonzero(~finite).squeeze(-1)
        zeros = torch.zeros_like(empty)
        rows, ids = torch.cat([rows, empty]), torch.cat([ids, zeros])
        words = torch.cat([words, token_bits(r1[empty], r2[empty], zeros)])
    return rows, ids, words, nan_rows


def _use_kernel(backend: str, allowed: torch.Tensor) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: choose from {BACKENDS}")
    if backend == "torch" or allowed.device.type != "cpu":
        return False
    if backend == "c++" and hash_kernel.load() is None:
        raise RuntimeError(hash_kernel.backend())
    return hash_kernel.load() is not None


def keyed_sample_sparse(logits: torch.Tensor, keys, positions, params: SamplingParams, *,
                        vocab_size: int | None = None, backend: str = "auto") -> torch.Tensor:
    """``keyed_sample(logits, keys, positions, params, vocab_size=...)`` (one process, whole
    vocabulary per row), computed on few tokens per row; the same tokens.

    ``backend``: ``auto`` (the C++ scan on CPU tensors when it is built, else torch), ``c++`` or
    ``torch``."""
    if params.greedy or logits.dim() != 2:
        return keyed_sample(logits, keys, positions, params, vocab_size=vocab_size)
    n, width = logits.shape
    device = logits.device
    allowed = _scaled(logits, params, vocab_size)
    keys = torch.as_tensor(keys, dtype=torch.int64, device=device).reshape(-1)
    positions = torch.as_tensor(positions, dtype=torch.int64, device=device).reshape(-1)
    bounds, g_max = noise_bounds(allowed.dtype, device)
    if _use_kernel(backend, allowed):
        rows, ids, words, nan_rows = hash_kernel.scan(allowed, keys, positions, bounds, _SHIFT,
                                                      g_max)
    else:
        rows, ids, words, nan_rows = _torch_candidates(allowed, keys, positions, bounds, g_max)
    scores = allowed[rows, ids] + _gumbel(uniform_from_bits(words), allowed.dtype)
    best = torch.full((n,), float("-inf"), dtype=allowed.dtype, device=device)
    best.scatter_reduce_(0, rows, scores, reduce="amax")
    at_best = scores == best[rows]
    winner = torch.full((n,), width, dtype=torch.int64, device=device)
    winner.scatter_reduce_(0, rows[at_best], ids[at_best], reduce="amin")
    if bool(nan_rows.any()):
        where = torch.nonzero(nan_rows).squeeze(-1)
        winner[where] = keyed_sample(logits[where], keys[where], positions[where], params,
                                     vocab_size=vocab_size)
    return winner
