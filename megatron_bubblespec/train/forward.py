"""Token batch -> Megatron forward (any TP/PP, pipeline schedule, forward only) -> per-micro-batch results.

The last pipeline stage sees each micro-batch's vocab-parallel logits [b, s, V_padded / TP] and
applies ``on_logits`` to them (gather, log-probs, verification...); the other stages get None.
All sequences of a call are right-padded to one length (the pipeline's p2p shapes are static).
"""

from __future__ import annotations

from typing import Callable

import torch

from megatron_bubblespec.distributed.cpu_compat import megatron_cpu_mode


def megatron_forward(model, tokens: torch.Tensor, on_logits: Callable[[torch.Tensor, slice], object],
                     micro_batch_size: int | None = None) -> list | None:
    """Run ``model`` over ``tokens`` [B, S]; returns [on_logits(logits_mb, rows_mb), ...] on the
    last pipeline stage, None elsewhere."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batch, seq = tokens.shape
    mbs = micro_batch_size or batch
    slices = [slice(i, min(i + mbs, batch)) for i in range(0, batch, mbs)]
    if len({s.stop - s.start for s in slices}) != 1:
        raise ValueError(f"batch {batch} is not a multiple of micro_batch_size {mbs}")
    device = next(model.parameters()).device
    batches = iter([(tokens[s].to(device), s) for s in slices])

    def forward_step(data_iterator, model):
        mb_tokens, rows = next(data_iterator)
        positions = torch.arange(seq, device=device).expand_as(mb_tokens)
        logits = model(mb_tokens, positions, None)

        def collect(output, non_loss_data=False):
            return on_logits(output, rows)

        return logits, collect

    with megatron_cpu_mode(), torch.no_grad():
        was_training = model.training
        model.eval()
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=batches, model=[model],
            num_microbatches=len(slices), seq_length=seq, micro_batch_size=mbs,
            forward_only=True, collect_non_loss_data=True)
        model.train(was_training)
    return out if ps.is_pipeline_last_stage() else None


def gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    """Vocab-parallel logits [..., V/TP] -> full [..., V_padded] on every TP rank."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() == 1:
        return logits
    shards = [torch.empty_like(logits) for _ in range(ps.get_tensor_model_parallel_world_size())]
    torch.distributed.all_gather(shards, logits.contiguous(),
                                 group=ps.get_tensor_model_parallel_group())
    return torch.cat(shards, dim=-1)
