"""Draft verification: (target logits over prompt+draft, draft tokens) -> accepted prefix + next token.

Three rules share one settlement step (``_settle``): find the accepted prefix, emit the target's own
token after it (the correction at a rejection, the bonus token when the whole draft is accepted),
and end each sample's response at its first EOS (``sampling.requests.settle_eos``).
``eos_token_ids`` is one set of ids for every sample or one set per sample.

* ``verify_keyed`` (the default, exact for any proposal): accept while the target's keyed draw
  equals the draft token. The draw is the same Gumbel-max draw plain decoding would make at that
  position with that key, so the verified response is token-identical to plain decoding. Needs no
  draft probabilities. Works on a vocabulary sharded over a tensor-parallel group. In one process
  it draws with ``sampling.keyed_draw.keyed_sample_sparse`` (the same tokens as ``keyed_sample``,
  hashing the noise of the few tokens that can win), and only the rows a draft can reach.
* ``verify_residual`` (ablation, exact): standard speculative sampling, accept y with probability
  min(1, p(y)/q(y)), else draw from norm(max(0, p - q)). Needs the draft distribution q.
* ``verify_lenient`` (ablation, NOT exact): SPEC-RL's rule, accept with probability
  min(1, l * p(y)/q(y)) for a lenience l >= 1 and redraw from p on rejection. Biased towards the
  draft; it exists to measure what inexactness costs and is labelled so everywhere.

Shapes: ``target_logits`` [B, L+1, V] holds, at index j, the logits that predict response position
``start + j`` given the prompt, the response so far and draft[:j]; ``words`` [B, L+1] are the
draw words of those positions (``sampling.draw_words``: row j's word follows draft[:j]), or [B]
the start positions when draws are keyed by position; ``draft`` [B, L] is right-padded,
``draft_lens`` [B] gives the real lengths (0 = no draft: the result is one plain keyed draw); the
padding may hold any value. ``vocab_size`` excludes Megatron's vocabulary padding columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable

import torch
import torch.distributed as dist

from megatron_bubblespec.sampling.keyed_draw import keyed_sample_sparse
from megatron_bubblespec.sampling.keyed import (
    STREAM_ACCEPT,
    STREAM_RESIDUAL,
    SamplingParams,
    gumbel_noise,
    keyed_sample,
    truncation_mask,
    uniform_at,
)
from megatron_bubblespec.sampling.requests import settle_eos

NO_TOKEN = -1



@dataclass
class Verdict:
    """Per sample: how many draft tokens to keep, the token after them, whether the response ended.

    The verified continuation is ``draft[:accepted] + [next_token]`` (``next_token`` is -1 when an
    accepted draft token was EOS, which ends the response with nothing after it).
    """

    accepted: torch.Tensor    # [B] int64
    next_token: torch.Tensor  # [B] int64, -1 = none
    finished: torch.Tensor    # [B] bool: EOS accepted or emitted

    def tokens(self, draft: torch.Tensor) -> list[list[int]]:
        """The verified continuation of each sample as Python lists."""
        out = []
        for row, n, nxt in zip(draft.tolist(), self.accepted.tolist(), self.next_token.tolist()):
            out.append(row[:n] + ([nxt] if nxt != NO_TOKEN else []))
        return out


def _check_shapes(target_logits, draft, draft_lens):
    if target_logits.dim() != 3 or draft.dim() != 2:
        raise ValueError("target_logits must be [B, L+1, V] and draft [B, L]; got "
                         f"{tuple(target_logits.shape)} and {tuple(draft.shape)}")
    b, l1, _ = target_logits.shape
    if draft.shape != (b, l1 - 1) or draft_lens.shape != (b,):
        raise ValueError(f"draft {tuple(draft.shape)} / draft_lens {tuple(draft_lens.shape)} do not "
                         f"match target_logits {tuple(target_logits.shape)} (expected [B, L+1, V], "
                         "[B, L], [B])")
    if bool((draft_lens < 0).any()) or bool((draft_lens > l1 - 1).any()):
        raise ValueError(f"draft_lens must lie in [0, {l1 - 1}], got {draft_lens.tolist()}")


def _words(words: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] draw words from [B, >= width] words or [B] start positions (position keying)."""
    words = torch.as_tensor(words, dtype=torch.int64)
    if words.dim() == 1:
        return words.reshape(-1, 1) + torch.arange(width, device=words.device)
    if words.shape[1] < width:
        raise ValueError(f"words {tuple(words.shape)} cover fewer than the {width} rows to draw")
    return words[:, :width]


def draft_words(params: SamplingParams, requests, drafts, width: int) -> torch.Tensor:
    """The draw words [B, width] of each request's draft rows: row j keys the draw after its
    prompt, response prefix and draft[:j] (``params.keying``); rows past a draft's end, which
    no rule reads, continue its last word by ones (position keying: prefix length + j)."""
    rows = []
    for request, draft in zip(requests, drafts):
        words = params.keying.words(request.prompt_token_ids, request.response_prefix, draft)
        rows.append(pad_words(words, width))
    return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), width)


def pad_words(words: list[int], width: int) -> list[int]:
    """``words`` cut or continued by ones (mod 2**32) to ``width`` words."""
    return (words + [(words[-1] + j) & 0xFFFFFFFF
                     for j in range(1, width - len(words) + 1)])[:width]


def _eos_rows(eos_token_ids, rows: int) -> list[frozenset[int]]:
    """One EOS set per row from either one set of ids shared by every row or one set per row."""
    given = list(eos_token_ids)
    if given and all(isinstance(ids, Collection) for ids in given):
        if len(given) != rows:
            raise ValueError(f"{len(given)} EOS sets for {rows} samples; pass one set per sample "
                             "or one set of token ids for all")
        return [frozenset(int(t) for t in ids) for ids in given]
    return [frozenset(int(t) for t in given)] * rows


def _settle(accept: torch.Tensor, replacement: torch.Tensor, draft: torch.Tensor,
            draft_lens: torch.Tensor, eos_token_ids) -> Verdict:
    """accept [B, L] (draft token j kept if reached), replacement [B, L+1] (token emitted when the
    first rejection is at j, or the bonus at j = len) -> Verdict, each sample's response ended
    at its own first EOS (``sampling.requests.settle_eos``)."""
    b, width = draft.shape
    j = torch.arange(width, device=draft.device).expand(b, width)
    valid = j < draft_lens.reshape(-1, 1)
    accepted = torch.cumprod((accept & valid).to(torch.int64), dim=-1).sum(-1)
    emitted = replacement.gather(-1, accepted.reshape(-1, 1)).squeeze(-1)
    settled = []
    for row, n, token, eos in zip(draft.tolist(), accepted.tolist(), emitted.tolist(),
                                  _eos_rows(eos_token_ids, b)):
        kept, ended = settle_eos(row[:n] + [token], eos)
        settled.append((min(kept, n), token if kept > n else NO_TOKEN, ended))
    columns = torch.tensor(settled, dtype=torch.int64, device=draft.device).reshape(b, 3)
    return Verdict(accepted=columns[:, 0].clone(), next_token=columns[:, 1].clone(),
                        finished=columns[:, 2].bool())


def verify_keyed(target_logits: torch.Tensor, draft: torch.Tensor, draft_lens: torch.Tensor,
                 keys: torch.Tensor, words: torch.Tensor, params: SamplingParams,
                 eos_token_ids: Iterable = (), *, vocab_offset: int = 0,
                 vocab_size: int | None = None, group=None) -> Verdict:
    """Exact verification by shared keyed noise; ``group`` = TP group when the vocab is sharded."""
    _check_shapes(target_logits, draft, draft_lens)
    b, width1, vocab = target_logits.shape
    # Only the rows up to each draft's end can be read by _settle (row len is the bonus draw);
    # the padding rows of shorter drafts are not drawn. Every rank of a TP group selects the same
    # rows (the same draft_lens), so the collectives of the sharded draw still match.
    read = (torch.arange(width1, device=draft.device) <= draft_lens.reshape(-1, 1)).reshape(-1)
    logits = target_logits.reshape(b * width1, vocab)[read]
    row_keys = keys.reshape(-1, 1).expand(b, width1).reshape(-1)[read]
    positions = _words(words, width1).to(draft.device).reshape(-1)[read]
    if vocab_offset == 0 and (group is None or dist.get_world_size(group) == 1):
        # the same tokens as keyed_sample, bit for bit, scoring few tokens per row
        drawn = keyed_sample_sparse(logits, row_keys, positions, params, vocab_size=vocab_size)
    else:
        drawn = keyed_sample(logits, row_keys, positions, params, vocab_offset=vocab_offset,
                             vocab_size=vocab_size, group=group)
    draws = torch.zeros(b * width1, dtype=torch.int64, device=draft.device)
    draws[read] = drawn.to(draft.device)
    draws = draws.view(b, width1)
    return _settle(draws[:, :-1] == draft, draws, draft, draft_lens, eos_token_ids)


def target_probs(target_logits: torch.Tensor, params: SamplingParams,
                 vocab_size: int | None = None) -> torch.Tensor:
    """p = softmax(logits / T) after top-k/top-p and without vocabulary padding, float64 [..., V].

    The truncation mask is built exactly as the keyed sampler builds it (same dtype), so both
    rules see the same support.
    """
    if params.greedy:
        raise ValueError("the residual and lenient rules need temperature > 0 (greedy is a point "
                         "mass; use the keyed rule)")
    dtype = torch.float64 if target_logits.dtype == torch.float64 else torch.float32
    scaled = target_logits.to(dtype) / params.temperature
    if vocab_size is not None and vocab_size < scaled.shape[-1]:
        scaled[..., vocab_size:] = float("-inf")
    if params.truncates:
        flat = scaled.reshape(-1, scaled.shape[-1])
        scaled = scaled.masked_fill(~truncation_mask(flat, params).view_as(scaled), float("-inf"))
    return torch.softmax(scaled.double(), dim=-1)


def _ratio_test(target_logits, draft_probs, draft, draft_lens, keys, words, params,
                vocab_size):
    _check_shapes(target_logits, draft, draft_lens)
    if draft_probs.shape != draft.shape + target_logits.shape[-1:]:
        raise ValueError(f"draft_probs must be [B, L, V] = {tuple(draft.shape) + target_logits.shape[-1:]}, "
                         f"got {tuple(draft_probs.shape)}")
    b, width1, vocab = target_logits.shape
    p = target_probs(target_logits, params, vocab_size)
    q = draft_probs.double()
    padding = torch.arange(draft.shape[1], device=draft.device) >= draft_lens.reshape(-1, 1)
    draft = draft.masked_fill(padding, 0)  # any padding value is allowed, as for verify_keyed
    y = draft.unsqueeze(-1)
    ratio = p[:, :-1].gather(-1, y).squeeze(-1) / q.gather(-1, y).squeeze(-1).clamp_min(1e-300)
    pos = _words(words, width1 - 1).reshape(-1)
    flat_keys = keys.reshape(-1, 1).expand(b, width1 - 1).reshape(-1)
    u = uniform_at(flat_keys, pos, draft.reshape(-1), STREAM_ACCEPT)
    bonus = keyed_sample(target_logits.reshape(b * width1, vocab),
                         keys.reshape(-1, 1).expand(b, width1).reshape(-1),
                         _words(words, width1).reshape(-1), params,
                         vocab_size=vocab_size).view(b, width1)
    return p, q, ratio, u.double().view(b, width1 - 1), bonus


def verify_residual(target_logits, draft_probs, draft, draft_lens, keys, words,
                    params: SamplingParams, eos_token_ids: Iterable = (),
                    vocab_size: int | None = None) -> Verdict:
    """Exact standard speculative sampling (needs q = ``draft_probs`` [B, L, V]); ablation only."""
    p, q, ratio, u, bonus = _ratio_test(target_logits, draft_probs, draft, draft_lens, keys,
                                        words, params, vocab_size)
    b, width1, vocab = target_logits.shape
    residual = (p[:, :-1] - q).clamp_min(0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[:, :-1])
    pos = _words(words, width1 - 1).reshape(-1)
    g = gumbel_noise(keys.reshape(-1, 1).expand(b, width1 - 1).reshape(-1), pos,
                     torch.arange(vocab), STREAM_RESIDUAL, dtype=torch.float64)
    residual_draw = torch.argmax(residual.log().reshape(-1, vocab) + g, dim=-1).view(b, width1 - 1)
    j = torch.arange(width1, device=draft.device)
    replacement = torch.where(j < draft_lens.reshape(-1, 1),
                              torch.cat([residual_draw, bonus[:, -1:]], dim=-1), bonus)
    return _settle(u <= ratio, replacement, draft, draft_lens, eos_token_ids)


def verify_lenient(target_logits, draft_probs, draft, draft_lens, keys, words,
                   params: SamplingParams, eos_token_ids: Iterable = (),
                   lenience: float = 1.0, vocab_size: int | None = None) -> Verdict:
    """SPEC-RL's lenient rule (INEXACT for lenience > 1, and never exact: it redraws from p rather
    than from the residual); ablation only."""
    if lenience < 1.0:
        raise ValueError(f"lenience must be >= 1, got {lenience}")
    _, _, ratio, u, bonus = _ratio_test(target_logits, draft_probs, draft, draft_lens, keys,
                                        words, params, vocab_size)
    return _settle(u <= lenience * ratio, bonus, draft, draft_lens, eos_token_ids)
