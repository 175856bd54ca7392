"""Query, key, value [s, b, heads, d] -> torch's fused causal attention -> context [s, b, hidden]:
Megatron's local core attention without the s x s probabilities kept for backward.

Megatron's local ``DotProductAttention`` (the layer spec used when Transformer Engine is absent,
as on CPU) materialises every layer's [b, heads, s, s] attention probabilities and keeps them for
the backward pass, the largest part of a training rank's memory on long responses
(docs/results/memory.md). ``FusedCoreAttention`` computes the same causal softmax attention with
``torch.nn.functional.scaled_dot_product_attention``, whose fused kernels keep only each row's
log-sum-exp. Whatever it does not cover (an explicit mask or bias, packed sequences, sliding
windows, dropout, query-key layer scaling, a learnable softmax offset) goes to Megatron's own
implementation.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class FusedCoreAttention(DotProductAttention):
    """``DotProductAttention`` through ``scaled_dot_product_attention`` for plain causal self
    attention; the parent's computation otherwise."""

    def _fused(self, query, key, attention_mask, attention_bias, packed_seq_params) -> bool:
        c = self.config
        return (attention_mask is None and attention_bias is None and packed_seq_params is None
                and self.attn_mask_type == AttnMaskType.causal and query.size(0) == key.size(0)
                and c.window_size is None and not c.attention_dropout
                and not c.apply_query_key_layer_scaling
                and getattr(c, "softmax_type", "vanilla") == "vanilla")

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if not self._fused(query, key, attention_mask, attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))    # [b, heads, s, d]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        context = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale)
        s, b = query.size(0), query.size(1)
        return context.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)
