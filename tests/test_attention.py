"""train.attention.FusedCoreAttention: the same causal attention (outputs and gradients) as
Megatron's local DotProductAttention, grouped-query heads included, at TP 1 and TP 2; an explicit
mask goes to Megatron's own computation."""

from __future__ import annotations

import pytest
import torch

from megatron_bubblespec.distributed import destroy_distributed, init_distributed
from megatron_bubblespec.distributed.launch import launch_local

pytestmark = pytest.mark.slow   # gloo process groups, one process per TP rank


def _attention_worker(tp: int):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_bubblespec.distributed.cpu_compat import megatron_cpu_mode
    from megatron_bubblespec.train.attention import FusedCoreAttention

    init_distributed(tp, 1, seed=3)
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                               num_query_groups=2, tensor_model_parallel_size=tp,
                               attention_dropout=0.0, hidden_dropout=0.0)
    out = {}
    with megatron_cpu_mode():
        layers = [cls(config, 1, AttnMaskType.causal, "self")
                  for cls in (DotProductAttention, FusedCoreAttention)]
        g = torch.Generator().manual_seed(0)
        s, b, d = 12, 2, 16
        heads, groups = 4 // tp, 2 // tp
        inputs = [torch.randn(s, b, n, d, generator=g) for n in (heads, groups, groups)]
        for name, layer in zip(("megatron", "fused"), layers):
            q, k, v = (t.clone().requires_grad_() for t in inputs)
            context = layer(q, k, v, None)
            (context * torch.linspace(-1, 1, context.numel()).view_as(context)).sum().backward()
            out[name] = [context.detach(), q.grad, k.grad, v.grad]
        mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
        out["masked"] = [layer(*inputs, mask) for layer in layers]
        out["fused_path"] = layers[1]._fused(inputs[0], inputs[1], None, None, None)
    destroy_distributed()
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_attention_matches_megatrons(tp):
    for rank in launch_local(_attention_worker, tp, tp):
        assert rank["fused_path"]   # compared below: torch's kernel, not the parent's fallback
        for name, a, b in zip(("context", "dq", "dk", "dv"), rank["megatron"], rank["fused"]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
        megatron, fused = rank["masked"]
        assert torch.equal(megatron, fused)   # an explicit mask: Megatron's own computation
