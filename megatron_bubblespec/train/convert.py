"""Megatron tensor (global layer and expert numbers, full size) <-> HF tensors, through mbridge's map of the family.

mbridge (the bridge verl uses) holds, for every family in ``models.architecture.SUPPORTED``, the
HF names of each Megatron tensor and their layouts: q, k, v fused per query group into
``linear_qkv`` (biases alike), [gate; up] stacked into ``linear_fc1`` (also per expert), the router
as HF's ``mlp.gate``, per-head q/k norms, and the embedding and output rows padded to the padded
vocabulary. Its tables are keyed on Transformer Engine's parameter names; ``bridge_name``
translates the two things the local (non-TE) layer spec names differently: the pre-attention and
pre-MLP norms (separate modules there, fused into the next linear under TE) and the experts
(``experts.local_experts.E.linear_fcN.weight`` there, ``experts.linear_fcN.weightE`` under TE).

Tied embeddings are handled here, not by the bridge: a tied model's HF side has no ``lm_head``,
and its output layer loads from the embedding. Sharding across TP ranks, PP stages and EP ranks is
separate (``train.sharding``, ``train.reshard``).
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Iterable, Mapping

import torch

from megatron_bubblespec.models.architecture import ModelSpec

EMBEDDING, OUTPUT_LAYER = "embedding.word_embeddings.weight", "output_layer.weight"
VOCAB_TENSORS = (EMBEDDING, OUTPUT_LAYER)
_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_LOCAL_NORM = re.compile(r"^(decoder\.layers\.\d+\.)(input_layernorm|pre_mlp_layernorm)\.weight$")
_TE_NORMS = {"input_layernorm": "self_attention.linear_qkv.layer_norm_weight",
             "pre_mlp_layernorm": "mlp.linear_fc1.layer_norm_weight"}


def bridge_name(name: str, arch: ModelSpec) -> str:
    """A Megatron tensor's name as mbridge's tables spell it (Transformer Engine's names)."""
    expert = _LOCAL_EXPERT.match(name)
    if expert:
        return f"{expert[1]}{expert[3]}.weight{expert[2]}"
    norm = _LOCAL_NORM.match(name)
    # An MoE layer has no linear_fc1 to fuse its pre-MLP norm into: mbridge keeps that name.
    if norm and not (arch.is_moe and norm[2] == "pre_mlp_layernorm"):
        return norm[1] + _TE_NORMS[norm[2]]
    return name


@functools.lru_cache(maxsize=16)
def _bridge(arch: ModelSpec, padded_vocab: int):
    """mbridge's Bridge of the family, padding the vocabulary to ``padded_vocab`` rows."""
    from transformers import AutoConfig

    with warnings.catch_warnings():   # its vision models warn about Apex, which no map here uses
        warnings.filterwarnings("ignore", message="Apex is not installed")
        from mbridge import AutoBridge
        from mbridge.core.parallel_states import ParallelStates

    moe = dict(num_experts=arch.num_experts, num_experts_per_tok=arch.experts_per_token,
               moe_intermediate_size=arch.moe_intermediate_size,
               norm_topk_prob=arch.norm_topk_prob) if arch.is_moe else {}
    # tie_word_embeddings stays False for the bridge: ties are resolved here (see the docstring),
    # and a tied Qwen2 bridge rewrites its class's name table for every later model.
    hf_config = AutoConfig.for_model(
        arch.arch, vocab_size=arch.vocab_size, hidden_size=arch.hidden_size,
        num_hidden_layers=arch.num_layers, num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_kv_heads, head_dim=arch.head_dim,
        intermediate_size=arch.intermediate_size, rms_norm_eps=arch.rms_norm_eps,
        attention_bias=arch.qkv_bias, tie_word_embeddings=False,
        max_position_embeddings=arch.max_position_embeddings, **moe)
    # float32: the bridge casts HF tensors to its dtype, which is exact from bf16/fp16 and leaves
    # the one rounding to the parameter's own dtype (as copying into it always did).
    bridge = AutoBridge.from_config(hf_config, dtype=torch.float32,
                                    parallel_states=ParallelStates(),
                                    make_vocab_size_divisible_by=padded_vocab)
    bridge.vocab_size, bridge.padded_vocab_size = arch.vocab_size, padded_vocab
    return bridge


def hf_names(name: str, arch: ModelSpec) -> list[str]:
    """The HF tensors one Megatron tensor is made of (KeyError when the family has none)."""
    try:
        bridge = _bridge(arch, arch.vocab_size)
        return bridge._weight_name_mapping_mcore_to_hf(bridge_name(name, arch))
    except NotImplementedError as error:
        raise KeyError(f"no HF mapping for Megatron tensor {name!r} ({arch.arch})") from error


def to_megatron(name: str, tensors: Mapping[str, torch.Tensor], arch: ModelSpec,
                padded_vocab: int) -> torch.Tensor:
    """The full Megatron tensor ``name`` from the HF ``tensors`` (KeyError naming a missing one)."""
    sources = hf_names(name, arch)
    missing = [s for s in sources if s not in tensors]
    if missing:
        raise KeyError(f"the checkpoint has no tensor {missing[0]!r} (needed for {name!r})")
    return _bridge(arch, padded_vocab)._weight_to_mcore_format(
        bridge_name(name, arch), [tensors[s] for s in sources])


def hf_to_megatron(tensors: Mapping[str, torch.Tensor], arch: ModelSpec, padded_vocab: int,
                   names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The full Megatron tensors ``names`` from HF tensors (a tied output layer from the
    embedding: the last pipeline stage holds a copy of it)."""
    tied = {OUTPUT_LAYER: EMBEDDING} if arch.tie_word_embeddings else {}
    return {name: to_megatron(tied.get(name, name), tensors, arch, padded_vocab) for name in names}


def megatron_to_hf(name: str, tensor: torch.Tensor,
                   arch: ModelSpec) -> list[tuple[str, torch.Tensor]]:
    """One full Megatron tensor -> its HF tensors (vocabulary padding removed; none for a tied
    output layer)."""
    if name == OUTPUT_LAYER and arch.tie_word_embeddings:
        return []
    hf_names(name, arch)  # a KeyError naming the tensor when the family has no map for it
    padded = tensor.shape[0] if name in VOCAB_TENSORS else arch.vocab_size
    names, hf_tensors = _bridge(arch, padded)._weight_to_hf_format(bridge_name(name, arch), tensor)
    return list(zip(names, hf_tensors))
