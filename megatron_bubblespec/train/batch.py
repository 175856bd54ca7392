"""Rollout results (prompt, response token lists, per-token logprobs, advantages) -> one DP rank's
GRPO batch: token-aligned, right-padded [B, S] tensors, and back to per-response lists.

Sequences are prompt + response, right-padded to one length ``S``; per-token tensors are ``[B, S]``
and aligned with the tokens: ``logprobs[b, j] = log p(tokens[b, j] | tokens[b, :j])`` (0 at j = 0),
``response_mask[b, j] = 1`` where token j is a response token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_bubblespec.tokens import pad_token_rows


@dataclass
class GRPOBatch:
    """One data-parallel rank's training sequences; per-token tensors [B, S], advantages [B]."""

    tokens: torch.Tensor                  # int64, prompt + response, right-padded
    response_mask: torch.Tensor           # 1 on response tokens
    old_logprobs: torch.Tensor            # behaviour policy (the rollout engine), token-aligned
    advantages: torch.Tensor
    ref_logprobs: torch.Tensor | None = None   # reference policy (KL); None: the trainer's own

    def __post_init__(self):
        shape = tuple(self.tokens.shape)
        for name in ("response_mask", "old_logprobs", "ref_logprobs"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != shape:
                raise ValueError(f"GRPOBatch.{name} has shape {tuple(value.shape)}, tokens have "
                                 f"{shape}: every per-token tensor must be token-aligned [B, S]")
        if tuple(self.advantages.shape) != shape[:1]:
            raise ValueError(f"GRPOBatch.advantages has shape {tuple(self.advantages.shape)}, "
                             f"expected one per sequence: ({shape[0]},)")
        if self.response_mask[:, 0].any():
            raise ValueError("response_mask is set at position 0: every sequence needs a prompt "
                             "token before its first response token")

    @classmethod
    def from_responses(cls, prompts: list[list[int]], responses: list[list[int]],
                       old_logprobs: list[list[float]], advantages, *,
                       ref_logprobs: list[list[float]] | None = None,
                       pad_id: int = 0) -> "GRPOBatch":
        """Token lists and per-response logprob lists (as rollout results carry them) -> a batch."""
        tokens, mask = pack_sequences(prompts, responses, pad_id)
        return cls(tokens, mask, scatter_responses(old_logprobs, mask),
                   torch.as_tensor(advantages, dtype=torch.float32),
                   None if ref_logprobs is None else scatter_responses(ref_logprobs, mask))

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def to(self, device) -> "GRPOBatch":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return GRPOBatch(self.tokens.to(device), self.response_mask.to(device),
                         self.old_logprobs.to(device), self.advantages.to(device),
                         move(self.ref_logprobs))

    def rows(self, index: slice) -> "GRPOBatch":
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return GRPOBatch(self.tokens[index], self.response_mask[index], self.old_logprobs[index],
                         self.advantages[index], pick(self.ref_logprobs))

    def padded_to(self, width: int) -> "GRPOBatch":
        """Right-padded to ``width`` tokens (pad id 0; padding is outside the response mask)."""
        pad = lambda t: None if t is None else torch.nn.functional.pad(  # noqa: E731
            t, (0, width - t.shape[1]))
        return GRPOBatch(pad(self.tokens), pad(self.response_mask), pad(self.old_logprobs),
                         self.advantages, pad(self.ref_logprobs))

    def dp_shard(self, rank: int, size: int) -> "GRPOBatch":
        """Data-parallel rank ``rank``'s contiguous share of a global batch (groups stay whole
        when the group size divides the share)."""
        if len(self) % size:
            raise ValueError(f"global batch of {len(self)} sequences does not split over "
                             f"{size} data-parallel ranks")
        share = len(self) // size
        return self.rows(slice(rank * share, (rank + 1) * share))


def pack_sequences(prompts: list[list[int]], responses: list[list[int]],
                   pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt and response token lists -> right-padded tokens [B, S] and the response mask."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"sequence {i} has an empty prompt")
    tokens, lengths = pad_token_rows([list(p) + list(r) for p, r in zip(prompts, responses)],
                                     pad_id)
    position = torch.arange(tokens.shape[1])
    starts = torch.tensor([len(p) for p in prompts]).view(-1, 1)
    mask = ((position >= starts) & (position < lengths.view(-1, 1))).to(torch.float32)
    return tokens, mask


def scatter_responses(values: list[list[float]], mask: torch.Tensor) -> torch.Tensor:
    """Per-response lists (e.g. the engine's logprobs) -> a token-aligned [B, S] tensor."""
    out = torch.zeros(mask.shape, dtype=torch.float32)
    for i, row in enumerate(values):
        positions = mask[i].nonzero().flatten()
        if len(row) != len(positions):
            raise ValueError(f"row {i}: {len(row)} values for {len(positions)} response tokens")
        out[i, positions] = torch.tensor(row, dtype=torch.float32)
    return out


def gather_responses(values: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    """Inverse of ``scatter_responses``: a [B, S] tensor -> per-response lists."""
    return [values[i][mask[i].bool()].tolist() for i in range(values.shape[0])]
