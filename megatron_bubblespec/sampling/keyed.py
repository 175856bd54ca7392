"""Keyed sampling: (logits, sample key, draw word) -> token, with noise that is a pure function.

Every random choice the project makes about a response token goes through this module. A sample's
draw keyed by the word ``i`` is

    token = argmax_v ( logits_v / T + g(key, i, v) ),    g = -log(-log u(key, i, v))

(Gumbel-max, i.e. an exact draw from softmax(logits / T)); ``T = 0`` is greedy. Because the noise
depends only on (key, position, token id), two different forwards that produce the same logits draw
the same token: a drafter and a verifier that share a sample's key share its noise, which is what
makes verification exact for any proposal (see ``megatron_bubblespec.speculative.verify``).
A draw's word is its response position or, with ``rollout.keying: context<k>``, a hash of the k
tokens before it (``megatron_bubblespec.sampling.draw_words``, which keeps a response's words distinct);
this module takes the words and calls them positions.

The noise u(key, i, v)
-----------------------
All arithmetic is on unsigned 32-bit words held in int64 tensors (every intermediate stays below
2**63, so no signed overflow happens on any device; the bits are the same on CPU and CUDA).

``mix32(x)`` is Wellons' "lowbias32" bijection on 32-bit words::

    x ^= x >> 16;  x *= 0x7FEB352D;  x ^= x >> 15;  x *= 0x846CA68B;  x ^= x >> 16   (all mod 2**32)

For a 64-bit key (k_hi, k_lo = its high and low 32-bit halves), a draw word i (< 2**32),
a token id v (< 2**32) and a stream s (0 for sampling; 1, 2 for the residual-rule ablation)::

    a  = mix32(k_lo ^ mix32(k_hi ^ 0x9E3779B9 ^ s))
    r1 = mix32(a ^ mix32(i ^ 0x85EBCA6B))            # one word per (sample, position)
    r2 = mix32(r1 ^ 0xC2B2AE35)
    h  = mix32((mix32(v ^ r1) + r2) mod 2**32)       # one word per (sample, position, token)
    u  = min(fl32((h >> 8) + 0.5) / 2**24, 1 - 2**-24)   # in (0, 1)

(``fl32``: float32 rounding. At and above 2**23 the float32 sum rounds half-integers to even, and
(2**24 - 1) + 0.5 rounds up to 2**24: without the clamp that u would be exactly 1.0 and its noise
+inf, a token that wins even outside top-k / top-p, about once in 340 rows at a 49k vocabulary.)

Golden values are pinned in ``tests/test_keyed_sampler.py``; change nothing here without a new
version of those values and a note in the changelog, since every stored draft depends on them.

top-k / top-p
-------------
Applied to ``logits / T`` before the noise, identically everywhere: top-k keeps every token whose
logit is >= the k-th largest (ties are kept); top-p keeps the smallest set of most-probable tokens
(stable order: higher probability first, lower id first on ties) whose mass reaches p, always at
least one token. Greedy ignores both.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_bubblespec.sampling.draw_words import Keying
from megatron_bubblespec.splitmix import chain

MASK32 = 0xFFFFFFFF
_HIGH_BIT = 1 << 31
_M1 = 0x7FEB352D
_M2 = 0x846CA68B
_SALT_KEY = 0x9E3779B9
_SALT_POS = 0x85EBCA6B
_SALT_ROW = 0xC2B2AE35
_UNIT24 = 1.0 / (1 << 24)
U_MAX = 1.0 - _UNIT24           # the largest float32 below 1.0: every noise value is finite

STREAM_SAMPLE = 0
STREAM_ACCEPT = 1    # uniform for the min(1, p/q) acceptance test (ablation rule)
STREAM_RESIDUAL = 2  # Gumbel noise for the residual draw (ablation rule)


def _mul32_(x: torch.Tensor, const: int, tmp: torch.Tensor) -> torch.Tensor:
    """In place: x * const mod 2**32 for 32-bit words x, without any int64 overflow.

    For const >= 2**31: x * const = x * (const - 2**31) + (x & 1) * 2**31 (mod 2**32).
    """
    if const & _HIGH_BIT:
        torch.bitwise_and(x, 1, out=tmp).bitwise_left_shift_(31)
        x.mul_(const - _HIGH_BIT).add_(tmp)
    else:
        x.mul_(const)
    return x.bitwise_and_(MASK32)


def _xorshift_(x: torch.Tensor, shift: int, tmp: torch.Tensor) -> torch.Tensor:
    torch.bitwise_right_shift(x, shift, out=tmp)
    return x.bitwise_xor_(tmp)


def _mix32_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """lowbias32 in place (the vocabulary-sized tensors make allocation the main cost)."""
    _xorshift_(x, 16, tmp)
    _mul32_(x, _M1, tmp)
    _xorshift_(x, 15, tmp)
    _mul32_(x, _M2, tmp)
    return _xorshift_(x, 16, tmp)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32: a bijective avalanche mix of 32-bit words held in an int64 tensor."""
    x = x.to(torch.int64, copy=True)
    return _mix32_(x, torch.empty_like(x))


def _as_words(values, device) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int64, device=device)


def row_words(keys: torch.Tensor, positions: torch.Tensor, stream: int = STREAM_SAMPLE):
    """Per-(sample, position) words (r1, r2) of the noise; keys are int64 (two's complement)."""
    k_lo = keys & MASK32
    k_hi = (keys >> 32) & MASK32
    a = mix32(k_lo ^ mix32(k_hi ^ (_SALT_KEY ^ stream)))
    r1 = mix32(a ^ mix32((positions & MASK32) ^ _SALT_POS))
    r2 = mix32(r1 ^ _SALT_ROW)
    return r1, r2


def token_bits(r1: torch.Tensor, r2: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """h from a row's words (``row_words``) and token ids, broadcastable int64 tensors."""
    h = torch.bitwise_xor(token_ids, r1)
    tmp = torch.empty_like(h)
    _mix32_(h, tmp).add_(r2).bitwise_and_(MASK32)
    return _mix32_(h, tmp)


def _hash(keys: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor,
          stream: int) -> torch.Tensor:
    """h(key, position, token) for broadcastable int64 tensors."""
    return token_bits(*row_words(keys, positions, stream), token_ids)


def uniform_from_bits(h: torch.Tensor) -> torch.Tensor:
    """u as float32 from hash words h (int64 holding 32-bit words): the spec's last line."""
    return (((h >> 8).to(torch.float32) + 0.5) * _UNIT24).clamp_(max=U_MAX)


def noise_bits(keys, positions, token_ids, stream: int = STREAM_SAMPLE) -> torch.Tensor:
    """The 32-bit word h(key, position, token) for rows [N] x token ids [V] -> int64 [N, V]."""
    device = token_ids.device if isinstance(token_ids, torch.Tensor) else None
    keys = _as_words(keys, device).reshape(-1, 1)
    positions = _as_words(positions, keys.device).reshape(-1, 1)
    token_ids = _as_words(token_ids, keys.device).reshape(1, -1)
    return _hash(keys, positions, token_ids, stream)


def uniform_noise(keys, positions, token_ids, stream: int = STREAM_SAMPLE) -> torch.Tensor:
    """u(key, position, token) in (0, 1) as float32 [N, V] (24 bits, exact in float32)."""
    return uniform_from_bits(noise_bits(keys, positions, token_ids, stream))


def uniform_at(keys, positions, token_ids, stream: int = STREAM_SAMPLE) -> torch.Tensor:
    """u(key, position, token) elementwise for same-shaped keys, positions and token ids."""
    keys = _as_words(keys, None)
    return uniform_from_bits(_hash(keys, _as_words(positions, keys.device),
                                   _as_words(token_ids, keys.device), stream))


def gumbel_noise(keys, positions, token_ids, stream: int = STREAM_SAMPLE,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """g = -log(-log u) as ``dtype`` [N, V]."""
    u = uniform_noise(keys, positions, token_ids, stream).to(dtype)
    return -torch.log(-torch.log(u))


# ----------------------------------------------------------------------------------------- keys

def _uid_word(prompt_uid: int | str) -> int:
    if isinstance(prompt_uid, int):
        return prompt_uid & 0xFFFFFFFFFFFFFFFF
    digest = hashlib.blake2b(str(prompt_uid).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def to_int64(key: int) -> int:
    """A 64-bit unsigned key as the signed value an int64 tensor stores."""
    key &= 0xFFFFFFFFFFFFFFFF
    return key - (1 << 64) if key >= (1 << 63) else key


def sample_key(seed: int, step: int, prompt_uid: int | str, sample_index: int) -> int:
    """The 64-bit key H(run seed, step, prompt uid, sample index), as a signed int64 value.

    A chain of splitmix64 finalisers (``megatron_bubblespec.splitmix.chain``); string uids are first hashed with BLAKE2b-64. The draft for
    step t+1's sample uses this same function with step t+1, so the draft and the real draw share
    their noise.
    """
    return to_int64(chain(seed, step, _uid_word(prompt_uid), sample_index))


# -------------------------------------------------------------------------------------- sampler

@dataclass(frozen=True)
class SamplingParams:
    """How logits become a token: temperature (0 = greedy), optional top-k (0 = off) and top-p,
    and what keys each draw of a response (``draw_words``; the sampler takes the words)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    keying: Keying = Keying()

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @classmethod
    def of(cls, rollout) -> "SamplingParams":
        """The run's sampling (its ``rollout`` config section)."""
        return cls(rollout.temperature, rollout.top_k, rollout.top_p, Keying.parse(rollout.keying))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def truncates(self) -> bool:
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)


def truncation_mask(scaled_logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Boolean [N, V]: the tokens top-k / top-p keep, from full-vocabulary ``logits / T``."""
    keep = torch.ones_like(scaled_logits, dtype=torch.bool)
    if params.top_k > 0 and params.top_k < scaled_logits.shape[-1]:
        kth = torch.topk(scaled_logits, params.top_k, dim=-1).values[..., -1:]
        keep &= scaled_logits >= kth
    if params.top_p < 1.0:
        masked = scaled_logits.masked_fill(~keep, float("-inf"))
        probs = torch.softmax(masked.double(), dim=-1)
        order = torch.sort(probs, dim=-1, descending=True, stable=True).indices
        sorted_probs = probs.gather(-1, order)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        keep_sorted = mass_before < params.top_p
        keep_sorted[..., 0] = True
        keep &= torch.zeros_like(keep).scatter(-1, order, keep_sorted)
    return keep


def perturbed_scores(logits: torch.Tensor, keys, positions, params: SamplingParams,
                     vocab_offset: int = 0, vocab_size: int | None = None,
                     keep: torch.Tensor | None = None) -> torch.Tensor:
    """logits / T + g over a (possibly sharded) vocabulary [N, V_local]; -inf where excluded.

    ``vocab_offset`` is the global id of column 0 (vocab-parallel shards); columns whose global id
    is >= ``vocab_size`` (Megatron's vocabulary padding) and columns outside ``keep`` (top-k/top-p)
    are excluded. Greedy returns the raw logits. Float32 unless the logits are float64.
    """
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    scores = logits.to(dtype)
    token_ids = torch.arange(vocab_offset, vocab_offset + logits.shape[-1], device=logits.device)
    if vocab_size is not None and vocab_offset + logits.shape[-1] > vocab_size:
        scores = scores.masked_fill(token_ids >= vocab_size, float("-inf"))
    if params.greedy:
        return scores
    scores = scores / params.temperature
    if keep is None and params.truncates:
        keep = truncation_mask(scores, params)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores + gumbel_noise(keys, positions, token_ids, dtype=dtype)


def keyed_sample(logits: torch.Tensor, keys, positions, params: SamplingParams, *,
                 vocab_offset: int = 0, vocab_size: int | None = None, group=None) -> torch.Tensor:
    """Draw one token per row: logits [N, V_local], keys [N], positions [N] -> global ids [N].

    Single process (``group`` None or of size 1): argmax of the perturbed scores. Vocab-parallel
    (``group`` = the tensor-parallel group, each rank holding ids [vocab_offset, vocab_offset +
    V_local)): each rank takes its shard's max, all-reduce MAX, then all-reduce MIN over the global
    ids that hold the max, so ties go to the lowest id exactly as ``torch.argmax`` does. With
    top-k/top-p the full logits are all-gathered first so every rank builds the same mask.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    if group is None or dist.get_world_size(group) == 1:
        scores = perturbed_scores(logits, keys, positions, params, vocab_offset, vocab_size)
        return torch.argmax(scores, dim=-1) + vocab_offset
    keep = None
    if params.truncates:
        keep = _sharded_truncation_mask(logits, params, vocab_offset, vocab_size, group)
    scores = perturbed_scores(logits, keys, positions, params, vocab_offset, vocab_size, keep)
    local_arg = torch.argmax(scores, dim=-1, keepdim=True)
    local_max = scores.gather(-1, local_arg).squeeze(-1)
    global_max = local_max.clone()
    dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    candidate = torch.where(local_max == global_max, local_arg.squeeze(-1) + vocab_offset,
                            torch.full_like(local_arg.squeeze(-1), torch.iinfo(torch.int64).max))
    dist.all_reduce(candidate, op=dist.ReduceOp.MIN, group=group)
    return candidate


def _sharded_truncation_mask(logits, params, vocab_offset, vocab_size, group) -> torch.Tensor:
    shards = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, logits.contiguous(), group=group)
    full = torch.cat(shards, dim=-1).to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
    if vocab_size is not None:
        full = full[..., :vocab_size]
    keep = truncation_mask(full / params.temperature, params)
    local = torch.zeros_like(logits, dtype=torch.bool)
    width = max(0, min(logits.shape[-1], keep.shape[-1] - vocab_offset))
    local[..., :width] = keep[..., vocab_offset:vocab_offset + width]
    return local
