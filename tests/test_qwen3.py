"""Qwen3 dense and Qwen3-MoE (tiny random checkpoints written by transformers) -> Megatron at TP 2,
EP 2 and EP 2 x TP 2 over gloo: transformers' logits, and HF -> Megatron -> reshard -> HF returns
the original tensors exactly, every expert whole on every rank; the TP x EP group agrees on the
largest forward size (what its ranks pad to, as the MoE token dispatcher needs)."""

import pytest
import torch

from megatron_bubblespec.distributed import (
    destroy_distributed,
    expert_parallel_max,
    init_distributed,
    megatron_cpu_mode,
)
from megatron_bubblespec.distributed.launch import launch_local
from megatron_bubblespec.models.architecture import load_checkpoint
from megatron_bubblespec.train.forward import gather_vocab, megatron_forward
from megatron_bubblespec.train.model import build_gpt_model
from megatron_bubblespec.train.reshard import Resharder
from megatron_bubblespec.train.sharding import load_hf_weights

pytestmark = pytest.mark.slow   # multi-process runs: minutes on 2 cores

VOCAB = 250  # not a multiple of 128: exercises vocabulary padding
# Megatron vs transformers in float32 on these tiny models: the same maths in another operation
# order (fused QKV and gate/up matmuls, another attention kernel). A conversion error (a wrong
# q/k norm, a permuted QKV group or expert) moves the logits by far more.
ATOL = 1e-5
MOE_NOTE = ("for Qwen3-MoE a logit gap beyond the float32 bound can also be a routing near-tie "
            "(two experts' router scores equal to rounding, each side picking another expert); "
            "a gap at every position is a conversion error")


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint):
    return {arch: tiny_checkpoint(arch, vocab_size=VOCAB, num_layers=4)
            for arch in ("qwen3", "qwen3_moe")}


def _tokens():
    return torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(0))


def _worker(path, tp, ep):
    init_distributed(tp, 1, seed=3, expert_parallel=ep)
    arch, tensors = load_checkpoint(path)
    with megatron_cpu_mode():
        model = build_gpt_model(arch)
        load_hf_weights(model, arch, tensors)
    logits = megatron_forward(model, _tokens(), lambda out, rows: gather_vocab(out)[..., :VOCAB],
                              micro_batch_size=2)
    hf_back = dict(Resharder(model, arch, bucket_bytes=64 << 10).named_tensors())
    peak = expert_parallel_max(torch.distributed.get_rank())
    destroy_distributed()
    return torch.cat(logits), hf_back, peak


@pytest.mark.parametrize("family,tp,ep,dp", [("qwen3", 2, 1, 1), ("qwen3_moe", 2, 1, 1),
                                             ("qwen3_moe", 1, 2, 2), ("qwen3_moe", 2, 2, 2)],
                         ids=["qwen3-tp2", "moe-tp2", "moe-ep2", "moe-ep2xtp2"])
def test_logits_and_bit_exact_round_trip(checkpoints, family, tp, ep, dp):
    from transformers import AutoModelForCausalLM

    checkpoint = checkpoints[family]
    arch, tensors = load_checkpoint(checkpoint)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        want = hf(_tokens()).logits
    results = launch_local(_worker, tp * dp, checkpoint, tp, ep)
    # the TP x EP group is the whole world here (without EP a rank keeps its own value)
    assert [peak for _, _, peak in results] == [tp * dp - 1 if ep > 1 else r
                                                for r in range(tp * dp)]
    for logits, hf_back, _ in results:   # every rank is a last stage and holds every HF tensor
        gap = float((logits - want).abs().max())
        assert gap <= ATOL, f"Megatron vs transformers logits differ by {gap:.2e} > {ATOL:.0e}; " \
            + (MOE_NOTE if arch.is_moe else "a conversion error")
        assert set(hf_back) == set(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(hf_back[name], tensor), name


# ------------------------------------------------------- YaRN rope scaling (Qwen3 past 32k)

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
LONG = 200     # tokens: three times the original context, where YaRN's interpolation matters


@pytest.fixture(scope="module")
def yarn_checkpoint(tmp_path_factory):
    from megatron_bubblespec.models.architecture import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen3-yarn"), "qwen3",
                                vocab_size=VOCAB, num_layers=2, max_position_embeddings=256,
                                rope_scaling=YARN)


def _long_tokens():
    return torch.randint(0, VOCAB, (2, LONG), generator=torch.Generator().manual_seed(1))


def _yarn_worker(path, tp):
    init_distributed(tp, 1, seed=3)
    arch, tensors = load_checkpoint(path)
    with megatron_cpu_mode():
        model = build_gpt_model(arch)
        load_hf_weights(model, arch, tensors)
    logits = megatron_forward(model, _long_tokens(),
                              lambda out, rows: gather_vocab(out)[..., :VOCAB], micro_batch_size=2)
    destroy_distributed()
    return torch.cat(logits)


@pytest.mark.parametrize("tp", [1, 2])
def test_yarn_logits_equal_transformers(yarn_checkpoint, tp):
    """A tiny Qwen3 whose config.json sets YaRN (factor 4 over 64 positions): Megatron's yarn
    rotary embedding with transformers' attention factor gives transformers' logits past the
    original context; plain RoPE on the same weights does not."""
    from transformers import AutoModelForCausalLM

    arch, _ = load_checkpoint(yarn_checkpoint)
    assert arch.yarn_factor == 4.0 and arch.yarn_attention_factor == pytest.approx(
        0.1 * torch.log(torch.tensor(4.0)).item() + 1.0)
    hf = AutoModelForCausalLM.from_pretrained(yarn_checkpoint, dtype=torch.float32)
    with torch.no_grad():
        want = hf(_long_tokens()).logits
    for logits in launch_local(_yarn_worker, tp, yarn_checkpoint, tp):
        gap = float((logits - want).abs().max())
        assert gap <= ATOL, f"Megatron vs transformers logits with YaRN differ by {gap:.2e}"
    plain = AutoModelForCausalLM.from_pretrained(yarn_checkpoint, dtype=torch.float32,
                                                 rope_parameters={"rope_type": "default",
                                                                  "rope_theta": 10000.0})
    with torch.no_grad():
        assert float((plain(_long_tokens()).logits - want).abs().max()) > 100 * ATOL
