"""Full Megatron-named tensors -> this rank's tensor/pipeline/expert-parallel shards, from megatron's own attributes.

Megatron marks every tensor-parallel parameter with ``tensor_model_parallel``, ``partition_dim``
and ``partition_stride`` (2 for the fused gate/up ``linear_fc1`` of SwiGLU: the full weight is
[gate; up] and each rank holds [gate_r; up_r]). Pipeline stages hold a slice of the decoder layers
whose global (1-based) numbers are on each layer's ``layer_number``. Those two facts are enough to
cut a full state dict into any rank's piece, and they are read from the model, never assumed.
With expert parallelism each rank holds ``num_experts / EP`` experts of every MoE layer, local
expert ``e`` of EP rank ``r`` being global expert ``r * (num_experts / EP) + e``; expert weights
(megatron marks them ``allreduce=False``) are split over the expert-tensor-parallel group.
"""

from __future__ import annotations

import re

import torch

_LAYER = re.compile(r"^(.*?decoder\.layers\.)(\d+)(\..*)$")
_EXPERT = re.compile(r"^(.*\.local_experts\.)(\d+)(\..*)$")


def global_layer_names(model, expert_offset: int = 0) -> dict[str, str]:
    """Local parameter name -> the name it has in an unsplit (PP=1, EP=1) model, local experts
    numbered from ``expert_offset``."""
    layer_numbers = [layer.layer_number - 1 for layer in model.decoder.layers]
    mapping = {}
    for name, _ in model.named_parameters():
        match = _LAYER.match(name)
        unsplit = f"{match[1]}{layer_numbers[int(match[2])]}{match[3]}" if match else name
        mapping[name] = renumber_expert(unsplit, expert_offset)
    return mapping


def renumber_expert(name: str, offset: int) -> str:
    """``name`` with its local expert number (if any) moved by ``offset``."""
    match = _EXPERT.match(name)
    return f"{match[1]}{int(match[2]) + offset}{match[3]}" if match and offset else name


def is_expert(param) -> bool:
    """Megatron marks expert weights as excluded from the data-parallel all-reduce."""
    return not getattr(param, "allreduce", True)


def experts_per_rank(model) -> int:
    """Experts of each MoE layer on this rank (0 for a dense model)."""
    from megatron.core import parallel_state as ps

    return (model.config.num_moe_experts or 0) // ps.get_expert_model_parallel_world_size()


def expert_offset(model) -> int:
    """The global number of this rank's first local expert."""
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_rank() * experts_per_rank(model)


def _tp_position(param, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """(rank, size) of the group ``param`` is split over: expert-TP for expert weights."""
    if not is_expert(param):
        return tp_rank, tp_size
    from megatron.core import parallel_state as ps

    return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()


def tp_shard(full: torch.Tensor, param, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The slice of ``full`` that ``param`` holds on tensor-parallel rank ``tp_rank``."""
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return full
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    chunks = torch.chunk(full, tp_size * stride, dim=dim)
    return torch.cat([chunks[tp_rank + k * tp_size] for k in range(stride)], dim=dim)


def load_full_state_dict(model, full: dict[str, torch.Tensor], tp_rank: int, tp_size: int,
                         tied_output_from: str = "embedding.word_embeddings.weight",
                         expert_offset: int = 0) -> None:
    """Copy an unsplit state dict into a TP/PP/EP-sharded Megatron model in place (this rank's
    local experts are the global ones from ``expert_offset``).

    With tied embeddings the last pipeline stage's ``output_layer.weight`` (a copy of the word
    embeddings) is taken from ``tied_output_from``. Raises KeyError naming any missing tensor and
    ValueError naming any shape mismatch.
    """
    names = global_layer_names(model, expert_offset)
    with torch.no_grad():
        for name, param in model.named_parameters():
            source = names[name]
            if source not in full and source.endswith("output_layer.weight"):
                source = tied_output_from
            if source not in full:
                raise KeyError(f"state dict has no tensor {source!r} (needed for {name!r})")
            rank, size = _tp_position(param, tp_rank, tp_size)
            shard = tp_shard(full[source], param, rank, size)
            if shard.shape != param.shape:
                raise ValueError(f"{name}: shard shape {tuple(shard.shape)} != parameter shape "
                                 f"{tuple(param.shape)} (tp {rank}/{size})")
            param.copy_(shard)


def has_fused_norms(model) -> bool:
    """Transformer Engine's spec fuses the pre-attention/pre-MLP norms into the next linear."""
    return any(name.endswith("linear_qkv.layer_norm_weight") for name, _ in model.named_parameters())


def load_hf_weights(model, arch, hf_tensors: dict[str, torch.Tensor]) -> None:
    """HF tensors -> the full Megatron tensors this rank holds a piece of -> its shards, in place."""
    from megatron.core import parallel_state as ps

    from megatron_bubblespec.train.convert import hf_to_megatron

    offset = expert_offset(model)
    names = global_layer_names(model, offset).values()
    full = hf_to_megatron(hf_tensors, arch, model.vocab_size, names)
    load_full_state_dict(model, full, ps.get_tensor_model_parallel_rank(),
                         ps.get_tensor_model_parallel_world_size(), expert_offset=offset)
