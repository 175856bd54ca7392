"""Vocab-parallel logits [b, S, V/TP] -> token logprobs (and entropies), on the last pipeline
stage, with Megatron's vocabulary padding masked out; a model and tokens -> their token-aligned
logprobs on every stage of the replica.

Log-probabilities are computed vocab-parallel (megatron's ``vocab_parallel_cross_entropy``; the
full vocabulary is never gathered).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_bubblespec.train.forward import broadcast_from_last_stage, megatron_forward


def forward_logprobs(model, tokens: torch.Tensor, vocab_size: int, micro_batch_size: int,
                     device, temperature: float = 1.0) -> torch.Tensor:
    """Token-aligned logprobs [B, S] of ``tokens`` under ``model`` (forward only) at
    ``temperature`` (of softmax(logits / T)), on every rank of the replica, on the CPU."""
    on_device = tokens.to(device)

    def on_logits(logits, rows):
        if temperature != 1.0:
            logits = logits / temperature
        return token_logprobs(logits, on_device[rows], vocab_size)[0]

    parts = megatron_forward(model, tokens, on_logits, micro_batch_size=micro_batch_size)
    return broadcast_from_last_stage(None if parts is None else torch.cat(parts).float(),
                                     tuple(tokens.shape), device).cpu()


def _vocab_shard_padding(logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """Bool [V/TP] marking this TP rank's padded vocabulary ids (None when it has none)."""
    from megatron.core import parallel_state as ps

    shard = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * shard
    if start + shard <= vocab_size:
        return None
    return torch.arange(start, start + shard, device=logits.device) >= vocab_size


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, vocab_size: int,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Vocab-parallel logits [b, S, V/TP] -> token-aligned logprobs [b, S] (and entropies).

    Position j holds log p(tokens[j] | tokens[:j]) from the logits at j - 1 (0 at j = 0); the
    entropy at j is that of the same distribution (metric only, no gradient). Ids >= vocab_size
    (Megatron's padding) get probability 0.
    """
    logp, entropy = label_logprobs(logits[:, :-1], tokens[:, 1:], vocab_size, with_entropy)
    return (torch.nn.functional.pad(logp, (1, 0)),
            None if entropy is None else torch.nn.functional.pad(entropy, (1, 0)))


ENTROPY_CHUNK = 256   # positions at a time: the metric's temporaries stay a few MB, not GB


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """Vocab-parallel logits [b, s, V/TP] -> the entropy at each position [b, s] (no gradient),
    a chunk of positions at a time: each chunk's temporaries are three [b, chunk, V/TP] copies."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    parts = []
    with torch.no_grad():
        for start in range(0, logits.shape[1], ENTROPY_CHUNK):
            shifted = logits[:, start:start + ENTROPY_CHUNK].float()
            peak = shifted.max(dim=-1, keepdim=True).values
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
            shifted = shifted - peak
            weights = torch.exp(shifted)
            sums = torch.stack([weights.sum(-1),
                                torch.where(weights > 0, weights * shifted, 0.0).sum(-1)])
            dist.all_reduce(sums, group=group)
            parts.append(torch.log(sums[0]) - sums[1] / sums[0])
    return torch.cat(parts, dim=1)


def label_logprobs(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Vocab-parallel logits [b, s, V/TP] -> log p(labels[:, j]) from the logits at j [b, s] (and
    the entropies at j): ``token_logprobs`` without the shift, for sequences split over CP."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    padding = _vocab_shard_padding(logits, vocab_size)
    logits = logits.masked_fill(padding, float("-inf")) if padding is not None else logits
    logits = logits.contiguous()
    entropy = _entropy(logits) if with_entropy else None
    # vocab_parallel_cross_entropy overwrites its input: ``logits`` is a copy made above, or (one
    # sequence, no padding) the model output (or a view of it) that nothing reads afterwards.
    return -vocab_parallel_cross_entropy(logits, labels), entropy
