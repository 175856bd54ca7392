"""HF Llama/Qwen2 tensors <-> full (unsharded) Megatron GPTModel tensors, as pure functions.

HF name + tensor -> Megatron name + tensor, and back. The only non-trivial layouts:

* ``linear_qkv``: Megatron fuses q, k, v per query group: for each of the ``kv_heads`` groups,
  the group's ``heads / kv_heads`` query heads, then its key head, then its value head (rows of
  ``head_dim`` each). Biases (Qwen2) follow the same order.
* ``linear_fc1``: [gate; up] stacked (SwiGLU's ``silu(first half) * second half``).
* Embedding and output layer rows are padded with zeros to the padded vocabulary, and the padding
  is dropped on the way back. Tied models have no ``lm_head.weight`` on the HF side.

Sharding across TP ranks and PP stages is separate (``train.sharding``, ``train.reshard``).
"""

from __future__ import annotations

import re

import torch

from megatron_bubblespec.models.architecture import ModelSpec

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MG_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# Per-layer tensors that map one to one: HF suffix -> Megatron suffix.
_LAYER_RENAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
# The local (non-TE) layer spec keeps the norms as separate modules.
_LOCAL_SPEC_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def _norm_name(megatron_suffix: str, fused_norms: bool) -> str:
    return megatron_suffix if fused_norms else _LOCAL_SPEC_NORMS.get(megatron_suffix, megatron_suffix)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """HF q [H*d, ...], k/v [G*d, ...] -> Megatron's per-group [q_g; k_g; v_g] rows."""
    groups, per_group, d = spec.num_kv_heads, spec.num_heads // spec.num_kv_heads, spec.head_dim
    tail = q.shape[1:]
    q = q.reshape(groups, per_group * d, *tail)
    k = k.reshape(groups, d, *tail)
    v = v.reshape(groups, d, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def split_qkv(qkv: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``fuse_qkv``."""
    groups, per_group, d = spec.num_kv_heads, spec.num_heads // spec.num_kv_heads, spec.head_dim
    tail = qkv.shape[1:]
    grouped = qkv.reshape(groups, (per_group + 2) * d, *tail)
    q, k, v = torch.split(grouped, [per_group * d, d, d], dim=1)
    return (q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail))


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def hf_to_megatron(tensors: dict[str, torch.Tensor], spec: ModelSpec, padded_vocab: int,
                   fused_norms: bool = False) -> dict[str, torch.Tensor]:
    """All HF tensors of a model -> the full Megatron state dict (every layer, unsharded)."""
    out = {"embedding.word_embeddings.weight":
           _pad_rows(tensors["model.embed_tokens.weight"], padded_vocab),
           "decoder.final_layernorm.weight": tensors["model.norm.weight"]}
    if not spec.tie_word_embeddings:
        out["output_layer.weight"] = _pad_rows(tensors["lm_head.weight"], padded_vocab)
    for i in range(spec.num_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_suffix, mg_suffix in _LAYER_RENAMES.items():
            out[mg + _norm_name(mg_suffix, fused_norms)] = tensors[hf + hf_suffix]
        out[mg + "self_attention.linear_qkv.weight"] = fuse_qkv(
            *(tensors[hf + f"self_attn.{m}_proj.weight"] for m in "qkv"), spec)
        if spec.qkv_bias:
            out[mg + "self_attention.linear_qkv.bias"] = fuse_qkv(
                *(tensors[hf + f"self_attn.{m}_proj.bias"] for m in "qkv"), spec)
        out[mg + "mlp.linear_fc1.weight"] = torch.cat(
            [tensors[hf + "mlp.gate_proj.weight"], tensors[hf + "mlp.up_proj.weight"]])
    return out


def megatron_to_hf(name: str, tensor: torch.Tensor, spec: ModelSpec) -> list[tuple[str, torch.Tensor]]:
    """One full Megatron tensor (global layer numbering) -> its HF tensors (padding removed)."""
    if name == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", tensor[:spec.vocab_size])]
    if name == "output_layer.weight":
        return [] if spec.tie_word_embeddings else [("lm_head.weight", tensor[:spec.vocab_size])]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", tensor)]
    match = _MG_LAYER.match(name)
    if not match:
        raise KeyError(f"no HF mapping for Megatron tensor {name!r}")
    hf, suffix = f"model.layers.{match[1]}.", match[2]
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        q, k, v = split_qkv(tensor, spec)
        return [(hf + f"self_attn.{m}_proj.{kind}", t) for m, t in zip("qkv", (q, k, v))]
    if suffix == "mlp.linear_fc1.weight":
        gate, up = torch.chunk(tensor, 2, dim=0)
        return [(hf + "mlp.gate_proj.weight", gate), (hf + "mlp.up_proj.weight", up)]
    for hf_suffix, mg_suffix in _LAYER_RENAMES.items():
        if suffix in (mg_suffix, _LOCAL_SPEC_NORMS.get(mg_suffix)):
            return [(hf + hf_suffix, tensor)]
    raise KeyError(f"no HF mapping for Megatron tensor {name!r}")
