"""HF Llama / Qwen2 (mbridge's maps) -> Megatron (TP, PP, TP x PP over gloo) gives transformers' logits, and
HF -> Megatron -> reshard -> HF returns the original tensors exactly."""

import pytest
import torch

from megatron_bubblespec.distributed import destroy_distributed, init_distributed, megatron_cpu_mode
from megatron_bubblespec.distributed.launch import launch_local
from megatron_bubblespec.models.architecture import load_checkpoint
from megatron_bubblespec.train.convert import bridge_name, megatron_to_hf, to_megatron
from megatron_bubblespec.train.forward import gather_vocab, megatron_forward
from megatron_bubblespec.train.model import build_gpt_model, padded_vocab_size
from megatron_bubblespec.train.reshard import Resharder
from megatron_bubblespec.train.sharding import load_hf_weights

pytestmark = pytest.mark.slow   # multi-process or real-model runs: minutes on 2 cores

VOCAB = 250  # not a multiple of 128: exercises vocabulary padding


@pytest.fixture(scope="module", params=[("llama", False), ("qwen2", True)], ids=["llama", "qwen2-tied"])
def checkpoint(request, tiny_checkpoint):
    arch, tied = request.param
    return tiny_checkpoint(arch, vocab_size=VOCAB, num_layers=4, tie_word_embeddings=tied)


def _tokens():
    return torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(0))


def _megatron_worker(path, tp, pp):
    init_distributed(tp, pp, seed=3)
    arch, tensors = load_checkpoint(path)
    with megatron_cpu_mode():
        model = build_gpt_model(arch)
        load_hf_weights(model, arch, tensors)
    logits = megatron_forward(model, _tokens(), lambda out, rows: gather_vocab(out)[..., :VOCAB],
                              micro_batch_size=2)
    resharder = Resharder(model, arch, bucket_bytes=64 << 10)
    hf_back = dict(resharder.named_tensors())
    stats = resharder.last
    destroy_distributed()
    return (torch.cat(logits) if logits is not None else None), hf_back, stats


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_megatron_logits_and_round_trip(checkpoint, tp, pp):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        want = hf(_tokens()).logits
    _, tensors = load_checkpoint(checkpoint)
    results = launch_local(_megatron_worker, tp * pp, checkpoint, tp, pp)
    last_stage = [logits for logits, _, _ in results if logits is not None]
    assert len(last_stage) == tp
    for logits in last_stage:
        torch.testing.assert_close(logits, want, rtol=0, atol=1e-5)
    for _, hf_back, stats in results:  # every rank of the replica holds the full HF tensors
        assert set(hf_back) == set(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(hf_back[name], tensor), name
        assert stats.tensors == len(tensors) and stats.buckets > 1
        assert stats.bytes == sum(t.numel() * t.element_size() for t in tensors.values())


def test_qkv_fusion_round_trip_and_layout():
    from megatron_bubblespec.models.architecture import ModelSpec

    arch = ModelSpec("qwen2", 10, 8, 1, num_heads=4, num_kv_heads=2, head_dim=2,
                     intermediate_size=4, rms_norm_eps=1e-6, rope_theta=1e4,
                     tie_word_embeddings=False, qkv_bias=True, max_position_embeddings=8)
    hf = "model.layers.0.self_attn."
    tensors = {hf + "q_proj.bias": torch.arange(8.0), hf + "k_proj.bias": 100 + torch.arange(4.0),
               hf + "v_proj.bias": 200 + torch.arange(4.0)}
    name = "decoder.layers.0.self_attention.linear_qkv.bias"
    fused = to_megatron(name, tensors, arch, padded_vocab=16)
    # group 0: q heads 0,1 (rows 0-3), k head 0, v head 0; then group 1
    assert fused.tolist() == [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]
    back = dict(megatron_to_hf(name, fused, arch))
    assert set(back) == set(tensors) and all(torch.equal(back[k], t) for k, t in tensors.items())


def test_local_spec_names_are_translated_to_the_bridge_tables():
    from megatron_bubblespec.models.architecture import ModelSpec

    dense = ModelSpec("qwen3", 10, 8, 1, 4, 2, 2, 4, 1e-6, 1e4, False, False, 8, qk_norm=True)
    moe = ModelSpec("qwen3_moe", 10, 8, 1, 4, 2, 2, 4, 1e-6, 1e4, False, False, 8, qk_norm=True,
                    num_experts=4, experts_per_token=2, moe_intermediate_size=4)
    layer = "decoder.layers.3."
    assert bridge_name(layer + "input_layernorm.weight", dense) == \
        layer + "self_attention.linear_qkv.layer_norm_weight"
    assert bridge_name(layer + "pre_mlp_layernorm.weight", dense) == \
        layer + "mlp.linear_fc1.layer_norm_weight"
    assert bridge_name(layer + "pre_mlp_layernorm.weight", moe) == layer + "pre_mlp_layernorm.weight"
    assert bridge_name(layer + "mlp.experts.local_experts.3.linear_fc2.weight", moe) == \
        layer + "mlp.experts.linear_fc2.weight3"


def test_vocab_padding_multiple():
    assert padded_vocab_size(250, 1) == 256 and padded_vocab_size(250, 2) == 256
    assert padded_vocab_size(49152, 4) == 49152 and padded_vocab_size(300, 4) == 512
