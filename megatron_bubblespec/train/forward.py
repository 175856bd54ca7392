"""Token batch -> Megatron forward (any TP/PP/CP, pipeline schedule, forward only) -> per-micro-batch results.

The last pipeline stage sees each micro-batch's vocab-parallel logits [b, s, V_padded / TP] and
applies ``on_logits`` to them (gather, log-probs, verification...); the other stages get None.
All sequences of a call are right-padded to one length (the pipeline's p2p shapes are static).

Context parallelism (CP > 1, Transformer Engine attention on CUDA): each CP rank feeds the model
its share of every sequence, Megatron's load-balanced split (``context_parallel_split``: 2 x CP
chunks, rank r holds chunks r and 2CP-1-r, the split Megatron's RoPE assumes), after right-padding
the sequence to a multiple of 2 x CP (x TP with sequence parallelism). In this forward-only path
the last stage gathers the logits back over the CP group (``context_parallel_gather``), so
``on_logits`` sees whole sequences on every CP rank: the verifier's keyed rule and the logprobs
run unchanged and identically on each CP rank (attention and activations are split, the logits of
one micro-batch are whole, as without CP). Training splits its micro-batches the same way and
keeps its loss local (the trainer's forward step).

``logit_positions(rows) -> [b, w]`` (optional) names, per sequence of a micro-batch, the w
positions whose logits ``on_logits`` needs (the verifier: each draft's L + 1 rows). The output
layer then runs on those positions' hidden states only, through a forward pre-hook on it, instead
of on the whole sequence (a vocabulary-wide matmul per position); with sequence or context
parallelism the hidden states are split over ranks there, so the logits are picked after the
layer instead. Either way ``on_logits`` receives logits [b, w, V_local] whose [i, j] predicts
the token after position ``positions[i, j]``.
"""

from __future__ import annotations

from typing import Callable

import torch

from megatron_bubblespec.distributed.cpu_compat import megatron_cpu_mode
from megatron_bubblespec.train.model import context_parallel_size


def megatron_forward(model, tokens: torch.Tensor, on_logits: Callable[[torch.Tensor, slice], object],
                     micro_batch_size: int | None = None,
                     logit_positions: Callable[[slice], torch.Tensor] | None = None) -> list | None:
    """Run ``model`` over ``tokens`` [B, S]; returns [on_logits(logits_mb, rows_mb), ...] on the
    last pipeline stage, None elsewhere; with ``logit_positions``, ``logits_mb`` holds only the
    positions it names for the micro-batch. Under expert parallelism the call is collective over
    the TP x EP group (``align_over_experts``): a rank with fewer rows or shorter ones runs padding
    micro-batches, whose results are dropped."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batch, seq = tokens.shape
    tokens, mbs = align_over_experts(tokens, micro_batch_size or max(batch, 1))
    if len(tokens) == 0:   # no rows here nor at an expert-parallel peer
        return [] if ps.is_pipeline_last_stage() else None
    slices = [slice(i, i + mbs) for i in range(0, tokens.shape[0], mbs)]
    device = next(model.parameters()).device
    split = context_parallel_size() > 1
    if split:
        tokens = pad_for_context_parallel(tokens, model_config(model).sequence_parallel)
    padded_seq = tokens.shape[1]
    batches = iter([(tokens[s].to(device), s) for s in slices])

    def forward_step(data_iterator, model):
        mb_tokens, rows = next(data_iterator)
        real = slice(rows.start, min(rows.stop, batch))   # empty: an expert-parallel filler
        positions = torch.arange(padded_seq, device=device).expand_as(mb_tokens)
        if split:
            mb_tokens, positions = context_parallel_split(mb_tokens, positions)
        picked = (None if logit_positions is None or real.start >= real.stop
                  else logit_positions(rows).to(device))
        hook = None if picked is None or split else _pick_output_rows(model, picked)
        try:
            logits = model(mb_tokens, positions, None)
        finally:
            if hook is not None:
                hook.remove()

        def collect(output, non_loss_data=False):
            if real.start >= real.stop:
                return None
            if split:
                output = context_parallel_gather(output)
            if picked is not None and hook is None:
                output = output.gather(1, picked.unsqueeze(-1).expand(-1, -1, output.shape[-1]))
            elif picked is None:
                output = output[:, :seq]
            return on_logits(output[:real.stop - real.start], real)

        return logits, collect

    with megatron_cpu_mode(), torch.no_grad():
        was_training = model.training
        model.eval()
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=batches, model=[model],
            num_microbatches=len(slices), seq_length=padded_seq, micro_batch_size=mbs,
            forward_only=True, collect_non_loss_data=True)
        model.train(was_training)
    return [r for r in out if r is not None] if ps.is_pipeline_last_stage() else None


def align_over_experts(tokens: torch.Tensor, micro_batch_size: int) -> tuple[torch.Tensor, int]:
    """``tokens`` [B, S] right-padded (with id 0) to the largest micro-batch size, micro-batch
    count and length of this rank's TP x EP group, and that micro-batch size: every rank of the
    group then runs the same forwards over the same number of tokens, as the MoE layers' token
    gather needs. Unchanged without expert parallelism."""
    from megatron_bubblespec.distributed.world import expert_parallel_peaks, expert_parallel_size

    batch, seq = tokens.shape
    if batch % micro_batch_size:
        raise ValueError(f"batch {batch} is not a multiple of micro_batch_size {micro_batch_size}")
    if expert_parallel_size() == 1:
        return tokens, micro_batch_size
    mbs, count, width = expert_parallel_peaks(
        [micro_batch_size, -(-batch // micro_batch_size), seq])
    padded = torch.zeros(mbs * count, width, dtype=tokens.dtype)
    padded[:batch, :seq] = tokens
    return padded, mbs


def broadcast_from_last_stage(tensor: torch.Tensor | None, shape, device,
                              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The last pipeline stage's ``tensor`` (``shape``, ``dtype``; None on the other stages) on
    every stage of this pipeline."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return tensor
    if tensor is None:
        tensor = torch.empty(shape, dtype=dtype, device=device)
    tensor = tensor.contiguous()
    torch.distributed.broadcast(tensor, src=ps.get_pipeline_model_parallel_last_rank(),
                                group=ps.get_pipeline_model_parallel_group())
    return tensor


def _pick_output_rows(model, positions: torch.Tensor):
    """A removable pre-hook that feeds the output layer, of its [s, b, h] input, only the hidden
    states at ``positions`` [b, w] (as [w, b, h]); None where there is no output layer (not the
    last pipeline stage) or its input is split over the sequence (sequence parallelism)."""
    while not hasattr(model, "output_layer") and hasattr(model, "module"):
        model = model.module
    layer = getattr(model, "output_layer", None)
    if layer is None or getattr(layer, "sequence_parallel", False):
        return None
    index = positions.t().unsqueeze(-1)   # [w, b, 1]

    def pick(module, args, kwargs):
        hidden = args[0]
        return (hidden.gather(0, index.expand(-1, -1, hidden.shape[-1])), *args[1:]), kwargs

    return layer.register_forward_pre_hook(pick, with_kwargs=True)


def gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    """Vocab-parallel logits [..., V/TP] -> full [..., V_padded] on every TP rank."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() == 1:
        return logits
    shards = [torch.empty_like(logits) for _ in range(ps.get_tensor_model_parallel_world_size())]
    torch.distributed.all_gather(shards, logits.contiguous(),
                                 group=ps.get_tensor_model_parallel_group())
    return torch.cat(shards, dim=-1)


# ---------------------------------------------------------------------- context parallelism

def model_config(model):
    """The TransformerConfig of a (possibly wrapped: DDP, Float16Module) Megatron model."""
    while not hasattr(model, "config") and hasattr(model, "module"):
        model = model.module
    return model.config


def context_parallel_length(seq_len: int, sequence_parallel: bool) -> int:
    """The shortest length >= ``seq_len`` that splits into 2 x CP chunks (of a multiple of TP
    tokens with sequence parallelism)."""
    from megatron.core import parallel_state as ps

    multiple = 2 * context_parallel_size()
    if sequence_parallel:
        multiple *= ps.get_tensor_model_parallel_world_size()
    return seq_len + (-seq_len % multiple)


def pad_for_context_parallel(tokens: torch.Tensor, sequence_parallel: bool,
                             pad_id: int = 0) -> torch.Tensor:
    """Right-pad [B, S] to ``context_parallel_length``. Causal attention keeps the padding out of
    every real position."""
    extra = context_parallel_length(tokens.shape[1], sequence_parallel) - tokens.shape[1]
    return torch.nn.functional.pad(tokens, (0, extra), value=pad_id) if extra else tokens


def context_parallel_split(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[B, S, ...] tensors -> this CP rank's [B, S / CP, ...] share (Megatron's own split)."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    names = [f"t{i}" for i in range(len(tensors))]
    local = get_batch_on_this_cp_rank(dict(zip(names, tensors)))
    return tuple(local[name] for name in names)


def context_parallel_gather(local: torch.Tensor) -> torch.Tensor:
    """Inverse of ``context_parallel_split`` along dim 1: every CP rank's share -> the whole
    [B, S, ...] on every CP rank (no gradient: forward-only paths)."""
    from megatron.core import parallel_state as ps

    cp = context_parallel_size()
    if cp == 1:
        return local
    group = ps.get_context_parallel_group()
    shards = [torch.empty_like(local) for _ in range(cp)]
    torch.distributed.all_gather(shards, local.contiguous(), group=group)
    chunk = local.shape[1] // 2
    pieces: list = [None] * (2 * cp)
    for rank, shard in enumerate(shards):
        pieces[rank], pieces[2 * cp - 1 - rank] = shard[:, :chunk], shard[:, chunk:]
    return torch.cat(pieces, dim=1)
