"""Logits [N, V] + keys + positions -> the keyed sampler's tokens, hashing few tokens' noise.

``sampling.keyed_sample`` hashes the Gumbel noise of every (row, token) and, with top-p, sorts
every row in float64; at a 49k-152k vocabulary on (k + 1) rows per request that costs more than
the forward on a CPU. This module returns the same tokens, bit for bit, by computing the noise only
where it can matter:

* The noise is bounded: the sampler's u is at most 1 - 2**-24, so g = -log(-log u) <= G_MAX
  (about 16.6). A token whose scaled logit plus G_MAX is below the exact score
  of some token cannot win. The exact scores of each row's best ``PROBE`` allowed tokens give that
  bar; the noise is then hashed for the tokens above it (SmolLM2 at T = 1: about a tenth of the
  vocabulary; with top-p 0.9: the nucleus, a few tokens) and the argmax taken among them, ties to
  the lowest id, as ``torch.argmax`` over the whole row does.
* top-k: the same ``torch.topk`` threshold as ``sampling.truncation_mask``. top-p: the same float64
  softmax over the row, but only the most probable tokens are sorted (stable, ids ascending among
  equal probabilities) and summed in order, doubling their number until the kept mass is reached;
  the sorted prefix and its running sum are the full sort's first entries, so the nucleus is the
  same set.

Every score is computed with the sampler's own operations in the same dtype; the tensors of
gathered tokens are padded to a multiple of 64 elements so that torch's vectorised kernels handle
every element (no scalar remainder loop), as they do over whole rows. ``tests`` compare the tokens
with ``keyed_sample`` on many rows, settings and vocabulary sizes.
"""

from __future__ import annotations

import torch

from megatron_bubblespec.sampling import SamplingParams, keyed_sample
from megatron_bubblespec.sampling.keyed import U_MAX, uniform_at

PROBE = 8            # tokens per row whose exact scores set the bar
_PAD = 64            # element multiple of the gathered tensors (whole vector iterations)
_MARGIN = 1e-3       # G_MAX is rounded up by this much: a superset of candidates is harmless


def _gumbel(u: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """g of ``sampling.keyed.gumbel_noise`` for a flat float32 u, padded to whole vectors."""
    n = u.numel()
    padded = torch.full((-(-n // _PAD) * _PAD,), 0.5, dtype=torch.float32)
    padded[:n] = u
    padded = padded.to(dtype)
    return (-torch.log(-torch.log(padded)))[:n]


def _g_max(dtype: torch.dtype) -> float:
    return float(_gumbel(torch.tensor([U_MAX], dtype=torch.float32), dtype)[0]) + _MARGIN


def _top_p_keep(scaled: torch.Tensor, keep: torch.Tensor, top_p: float) -> torch.Tensor:
    """``keep`` narrowed to the nucleus, as ``sampling.truncation_mask`` computes it."""
    masked = scaled.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(masked.double(), dim=-1)
    out = torch.zeros_like(keep)
    for row in range(probs.shape[0]):
        p = probs[row]
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


def keyed_sample_sparse(logits: torch.Tensor, keys, positions, params: SamplingParams, *,
                        vocab_size: int | None = None) -> torch.Tensor:
    """``keyed_sample(logits, keys, positions, params, vocab_size=...)`` (one process, whole
    vocabulary per row), computed on few tokens per row; the same tokens."""
    if params.greedy or logits.dim() != 2:
        return keyed_sample(logits, keys, positions, params, vocab_size=vocab_size)
    n, width = logits.shape
    device = logits.device
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    scaled = logits.to(dtype)
    token_ids = torch.arange(width, device=device)
    if vocab_size is not None and width > vocab_size:
        scaled = scaled.masked_fill(token_ids >= vocab_size, float("-inf"))
    scaled = scaled / params.temperature
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if params.top_k > 0 and params.top_k < width:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        keep &= scaled >= kth
    if params.top_p < 1.0:
        keep = _top_p_keep(scaled, keep, params.top_p)
    allowed = scaled.masked_fill(~keep, float("-inf"))
    keys = torch.as_tensor(keys, dtype=torch.int64, device=device).reshape(-1)
    positions = torch.as_tensor(positions, dtype=torch.int64, device=device).reshape(-1)

    def exact_scores(rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        u = uniform_at(keys[rows], positions[rows], ids)
        return allowed[rows, ids] + _gumbel(u, dtype)

    probe = torch.topk(allowed, min(PROBE, width), dim=-1).indices
    rows = torch.arange(n, device=device).repeat_interleave(probe.shape[1])
    bar = exact_scores(rows, probe.reshape(-1)).view(n, -1).max(dim=-1).values
    candidate = allowed + _g_max(dtype) >= bar.unsqueeze(-1)
    rows, ids = torch.nonzero(candidate, as_tuple=True)      # row-major: ids ascending per row
    scores = exact_scores(rows, ids)
    winner = torch.full((n,), width, dtype=torch.int64, device=device)
    nan = torch.isnan(scores)          # torch.argmax takes the first NaN of a row, if any
    winner.scatter_reduce_(0, rows[nan], ids[nan], reduce="amin")
    clean = ~nan
    best = torch.full((n,), float("-inf"), dtype=dtype, device=device)
    best.scatter_reduce_(0, rows[clean], scores[clean], reduce="amax")
    at_best = clean & (scores == best[rows])
    tie = torch.full((n,), width, dtype=torch.int64, device=device)
    tie.scatter_reduce_(0, rows[at_best], ids[at_best], reduce="amin")
    return torch.where(winner < width, winner, tie)
