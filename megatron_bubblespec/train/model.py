"""ModelSpec (from an HF config) -> megatron-core GPTModel for this rank's TP/PP piece.

Llama/Qwen2/Qwen3 families: RMSNorm, SwiGLU (fused gate/up ``linear_fc1``), RoPE (non-interleaved,
as HF stores the weights), grouped-query attention, optional QKV bias, per-head q/k RMSNorm
(``qk_layernorm``), tied or untied embeddings. Qwen3-MoE adds Megatron's MoE layer: a softmax
router in fp32 choosing top-k experts (normalised over the chosen ones unless the checkpoint says
otherwise), one SwiGLU MLP per expert (no grouped GEMM), the allgather token dispatcher (the
all-to-all one needs CUDA streams), experts split over the EP ranks, and the router's
load-balancing loss as a setting (``moe_options``). The local (non-TE) layer spec on CPU;
Transformer Engine's spec when TE is importable and a GPU exists.
The vocabulary is padded to a multiple of ``vocab_multiple x TP`` as Megatron-LM does; padded
logits are excluded by every sampler (``vocab_size`` argument of the keyed sampler).

Context parallelism (CP from parallel_state, ``parallel.context``) needs Transformer Engine's
attention on CUDA (its ring attention, ``cp_comm_type`` p2p by default); without them the model
is refused with a message naming the setting. Inputs are split over CP by ``train.forward``.
"""

from __future__ import annotations

import math

import torch

from megatron_bubblespec.models.architecture import ModelSpec
from megatron_bubblespec.models.layout import check_expert_layout


def padded_vocab_size(vocab_size: int, tensor_parallel: int, vocab_multiple: int = 128) -> int:
    multiple = vocab_multiple * tensor_parallel
    return -(-vocab_size // multiple) * multiple


def _transformer_engine_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def context_parallel_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def check_context_parallel(cp: int, te_available: bool) -> None:
    """Refuse CP > 1 where it cannot run (it needs Transformer Engine's attention on CUDA)."""
    if cp > 1 and not te_available:
        missing = ("a CUDA device" if not torch.cuda.is_available()
                   else "Transformer Engine (pip install transformer-engine[pytorch])")
        raise ValueError(f"parallel.context={cp}: context parallelism needs Transformer Engine's "
                         f"attention on CUDA, and this process has no {missing}; set "
                         "parallel.context=1")


LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")


def moe_options(load_balancing: str = "none", aux_loss_coeff: float = 0.0) -> dict:
    """``build_gpt_model`` options for the router's load-balancing loss (ignored by dense models):
    Megatron's type (``aux_loss``, ``seq_aux_loss`` or ``none``) and coefficient."""
    if load_balancing not in LOAD_BALANCING_TYPES:
        raise ValueError(f"router load balancing {load_balancing!r} is not one of "
                         f"{LOAD_BALANCING_TYPES}")
    return {"moe_router_load_balancing_type": load_balancing, "moe_aux_loss_coeff": aux_loss_coeff}


def _family_fields(arch: ModelSpec) -> dict:
    """TransformerConfig fields of the family beyond the Llama ones: q/k norms and the MoE layer."""
    from megatron.core import parallel_state as ps

    fields = {"qk_layernorm": arch.qk_norm}
    if arch.is_moe:
        fields.update(
            num_moe_experts=arch.num_experts, moe_router_topk=arch.experts_per_token,
            moe_ffn_hidden_size=arch.moe_intermediate_size, moe_grouped_gemm=False,
            moe_router_score_function="softmax", moe_router_pre_softmax=not arch.norm_topk_prob,
            moe_router_dtype="fp32", moe_token_dispatcher_type="allgather",
            expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
            expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
            **moe_options())
    return fields


def transformer_config(arch: ModelSpec, *, params_dtype: torch.dtype = torch.float32,
                       **overrides):
    """The TransformerConfig of ``arch`` for this process (TP/PP sizes from parallel_state)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_bubblespec.distributed.world import megatron_config_overrides

    fields = dict(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads, num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim, ffn_hidden_size=arch.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=arch.rms_norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=params_dtype, pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        **_family_fields(arch), **megatron_config_overrides())
    if not arch.is_moe:  # the load-balancing settings only exist for a router
        for name in moe_options():
            overrides.pop(name, None)
    fields.setdefault("context_parallel_size", context_parallel_size())
    if fields["context_parallel_size"] > 1:
        fields.setdefault("cp_comm_type", "p2p")
    fields.update(overrides)
    return TransformerConfig(**fields)


def build_gpt_model(arch: ModelSpec, *, params_dtype: torch.dtype = torch.float32,
                    vocab_multiple: int = 128, **config_overrides):
    """A GPTModel holding this rank's shard (call inside ``megatron_cpu_mode()`` on CPU)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs

    check_context_parallel(config_overrides.get("context_parallel_size", context_parallel_size()),
                           _transformer_engine_available())
    problems = check_expert_layout(arch, ps.get_tensor_model_parallel_world_size(),
                                   ps.get_expert_model_parallel_world_size(),
                                   ps.get_data_parallel_world_size())
    if problems:
        raise ValueError("; ".join(problems))
    config = transformer_config(arch, params_dtype=params_dtype, **config_overrides)
    _set_yarn(config, arch)
    layers = dict(num_experts=arch.num_experts or None, moe_grouped_gemm=False,
                  qk_layernorm=arch.qk_norm)
    if _transformer_engine_available():
        layer_spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**layers)
    else:
        from megatron_bubblespec.train.attention import FusedCoreAttention

        layer_spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", **layers)
        # no s x s probabilities kept per layer (train.attention)
        layer_spec.submodules.self_attention.submodules.core_attention = FusedCoreAttention
    return GPTModel(
        config=config, transformer_layer_spec=layer_spec,
        vocab_size=padded_vocab_size(arch.vocab_size, ps.get_tensor_model_parallel_world_size(),
                                     vocab_multiple),
        max_sequence_length=arch.context_length,
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="yarn" if arch.yarn_factor else "rope",
        rotary_base=int(arch.rope_theta))


def _set_yarn(config, arch: ModelSpec) -> None:
    """megatron-core's YaRN rotary embedding reads its parameters from the config's ``yarn_*``
    attributes (GPTModel, and the attention's cos/sin scale). Its scale is the ratio of two
    mscales; an mscale_all_dim of 0 makes it exactly transformers' attention factor."""
    if not arch.yarn_factor:
        return
    log = math.log(arch.yarn_factor) if arch.yarn_factor > 1 else 0.0
    config.yarn_rotary_scaling_factor = arch.yarn_factor
    config.yarn_original_max_position_embeddings = arch.yarn_original_max_position_embeddings
    config.yarn_beta_fast, config.yarn_beta_slow = arch.yarn_beta_fast, arch.yarn_beta_slow
    config.yarn_mscale = (arch.yarn_attention_factor - 1.0) / (0.1 * log) if log else 0.0
    config.yarn_mscale_all_dim = 0.0
    config.yarn_correction_range_round_to_int = arch.yarn_truncate
