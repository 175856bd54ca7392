"""Full Megatron-named tensors -> this rank's tensor/pipeline-parallel shards, from megatron's own attributes.

Megatron marks every tensor-parallel parameter with ``tensor_model_parallel``, ``partition_dim``
and ``partition_stride`` (2 for the fused gate/up ``linear_fc1`` of SwiGLU: the full weight is
[gate; up] and each rank holds [gate_r; up_r]). Pipeline stages hold a slice of the decoder layers
whose global (1-based) numbers are on each layer's ``layer_number``. Those two facts are enough to
cut a full state dict into any rank's piece, and they are read from the model, never assumed.
"""

from __future__ import annotations

import re

import torch

_LAYER = re.compile(r"^(.*?decoder\.layers\.)(\d+)(\..*)$")


def global_layer_names(model) -> dict[str, str]:
    """Local parameter name -> the name it has in an unsplit (PP=1) model."""
    layer_numbers = [layer.layer_number - 1 for layer in model.decoder.layers]
    mapping = {}
    for name, _ in model.named_parameters():
        match = _LAYER.match(name)
        if match:
            name_global = f"{match[1]}{layer_numbers[int(match[2])]}{match[3]}"
        else:
            name_global = name
        mapping[name] = name_global
    return mapping


def tp_shard(full: torch.Tensor, param, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The slice of ``full`` that ``param`` holds on tensor-parallel rank ``tp_rank``."""
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return full
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    chunks = torch.chunk(full, tp_size * stride, dim=dim)
    return torch.cat([chunks[tp_rank + k * tp_size] for k in range(stride)], dim=dim)


def load_full_state_dict(model, full: dict[str, torch.Tensor], tp_rank: int, tp_size: int,
                         tied_output_from: str = "embedding.word_embeddings.weight") -> None:
    """Copy an unsplit state dict into a TP/PP-sharded Megatron model in place.

    With tied embeddings the last pipeline stage's ``output_layer.weight`` (a copy of the word
    embeddings) is taken from ``tied_output_from``. Raises KeyError naming any missing tensor and
    ValueError naming any shape mismatch.
    """
    names = global_layer_names(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            source = names[name]
            if source not in full and source.endswith("output_layer.weight"):
                source = tied_output_from
            if source not in full:
                raise KeyError(f"state dict has no tensor {source!r} (needed for {name!r})")
            shard = tp_shard(full[source], param, tp_rank, tp_size)
            if shard.shape != param.shape:
                raise ValueError(f"{name}: shard shape {tuple(shard.shape)} != parameter shape "
                                 f"{tuple(param.shape)} (tp {tp_rank}/{tp_size})")
            param.copy_(shard)


def has_fused_norms(model) -> bool:
    """Transformer Engine's spec fuses the pre-attention/pre-MLP norms into the next linear."""
    return any(name.endswith("linear_qkv.layer_norm_weight") for name, _ in model.named_parameters())


def load_hf_weights(model, spec, hf_tensors: dict[str, torch.Tensor]) -> None:
    """HF Llama/Qwen2 tensors -> full Megatron tensors -> this rank's shards, in place."""
    from megatron.core import parallel_state as ps

    from megatron_bubblespec.train.convert import hf_to_megatron

    padded = model.vocab_size
    full = hf_to_megatron(hf_tensors, spec, padded, fused_norms=has_fused_norms(model))
    load_full_state_dict(model, full, ps.get_tensor_model_parallel_rank(),
                         ps.get_tensor_model_parallel_world_size())
