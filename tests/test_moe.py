"""Qwen3 / Qwen3-MoE checkpoints -> ModelSpec (families, errors), the expert layout's problems, and
the router's load-balancing loss as a build_gpt_model setting (it reaches the router's gradient)."""

import json

import pytest
import torch

from megatron_bubblespec.models.architecture import (
    CheckpointError,
    ModelSpec,
    check_checkpoint,
)
from megatron_bubblespec.models.layout import check_expert_layout, experts_per_rank


@pytest.fixture(scope="module")
def moe_checkpoint(tiny_checkpoint):
    return tiny_checkpoint("qwen3_moe", vocab_size=128)


def test_qwen3_families_are_read_from_transformers_configs(tiny_checkpoint, moe_checkpoint):
    dense = check_checkpoint(tiny_checkpoint("qwen3", vocab_size=128))
    assert (dense.arch, dense.qk_norm, dense.qkv_bias, dense.is_moe) == \
        ("qwen3", True, False, False)
    moe = check_checkpoint(moe_checkpoint)
    assert (moe.arch, moe.qk_norm, moe.num_experts, moe.experts_per_token,
            moe.moe_intermediate_size, moe.norm_topk_prob) == ("qwen3_moe", True, 8, 2, 64, True)
    hub_style = json.loads((moe_checkpoint / "config.json").read_text())
    hub_style["num_experts"] = hub_style.pop("num_local_experts")   # as the Hub's configs say it
    assert ModelSpec.from_hf_config(hub_style) == moe


def test_unsupported_architecture_names_the_supported_ones_and_what_is_missing(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MixtralForCausalLM"]}))
    with pytest.raises(CheckpointError) as error:
        check_checkpoint(tmp_path)
    message = str(error.value)
    assert "MixtralForCausalLM" in message and "Qwen3MoeForCausalLM" in message
    assert "Megatron layer options" in message and "mbridge" in message


def test_moe_with_dense_layers_is_refused(moe_checkpoint):
    config = json.loads((moe_checkpoint / "config.json").read_text())
    config["mlp_only_layers"] = [1]
    with pytest.raises(ValueError, match="every layer must be an MoE layer"):
        ModelSpec.from_hf_config(config)


def test_expert_layout_problems_name_both_numbers(moe_checkpoint):
    arch = check_checkpoint(moe_checkpoint)             # 8 experts, moe_intermediate_size 64
    assert check_expert_layout(arch, tensor=2, expert=2, data=2) == []
    assert experts_per_rank(arch, 2) == 4
    (problem,) = check_expert_layout(arch, tensor=1, expert=4, data=2)
    assert "parallel.expert=4" in problem and "data-parallel size 2" in problem
    (problem,) = check_expert_layout(arch, tensor=1, expert=3, data=3)
    assert "parallel.expert=3" in problem and "8 experts" in problem
    dense = ModelSpec("qwen3", 128, 64, 2, 4, 2, 32, 128, 1e-6, 1e4, False, False, 64, qk_norm=True)
    (problem,) = check_expert_layout(dense, tensor=1, expert=2, data=2)
    assert "dense" in problem and "parallel.expert=1" in problem


def _router_gradient(path, load_balancing, coeff):
    from megatron_bubblespec.distributed import (
        destroy_distributed,
        init_distributed,
        megatron_cpu_mode,
    )
    from megatron_bubblespec.models.architecture import load_checkpoint
    from megatron_bubblespec.train.model import build_gpt_model, moe_options
    from megatron_bubblespec.train.sharding import load_hf_weights

    init_distributed(1, 1, seed=0)
    arch, tensors = load_checkpoint(path)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with megatron_cpu_mode():
        model = build_gpt_model(arch, **moe_options(load_balancing, coeff))
        load_hf_weights(model, arch, tensors)
        model.train()
        logits = model(tokens, torch.arange(16).expand_as(tokens), None)
        logits.float().logsumexp(-1).mean().backward()
    router = model.decoder.layers[0].mlp.router
    grad, dtype = router.weight.grad.clone(), model.config.moe_router_dtype
    destroy_distributed()
    return grad, dtype


@pytest.mark.slow
def test_load_balancing_loss_reaches_the_router(moe_checkpoint):
    from megatron_bubblespec.distributed.launch import launch_local

    off, dtype = launch_local(_router_gradient, 1, moe_checkpoint, "none", 0.0)[0]
    again, _ = launch_local(_router_gradient, 1, moe_checkpoint, "none", 0.0)[0]
    aux, _ = launch_local(_router_gradient, 1, moe_checkpoint, "aux_loss", 0.1)[0]
    seq, _ = launch_local(_router_gradient, 1, moe_checkpoint, "seq_aux_loss", 0.1)[0]
    assert dtype == "fp32"
    assert torch.equal(off, again)
    assert not torch.allclose(aux, off) and not torch.allclose(seq, off)


def test_load_balancing_type_is_checked():
    from megatron_bubblespec.train.model import moe_options

    with pytest.raises(ValueError, match="sinkhorn"):
        moe_options("sinkhorn", 0.1)


def test_preflight_names_the_expert_layout_problems(moe_checkpoint):
    """``bubblespec train`` checks the expert layout against the model before any rank starts."""
    from megatron_bubblespec.config import load_config
    from megatron_bubblespec.preflight import PreflightError, check_layout

    arch = check_checkpoint(moe_checkpoint)
    base = ["parallel.world_size=4", f"model.path={moe_checkpoint}"]
    check_layout(load_config("configs/tiny.yaml", [*base, "parallel.data=4",
                                                   "parallel.expert=4"]), arch)
    with pytest.raises(PreflightError, match="does not divide the model's 8 experts"):
        check_layout(load_config("configs/tiny.yaml", [*base, "parallel.world_size=3",
                                                       "parallel.data=3", "parallel.expert=3",
                                                       "rollout.prompts_per_step=3"]),
                     arch)
    with pytest.raises(PreflightError, match="only with parallel.sequence_parallel=true"):
        check_layout(load_config("configs/tiny.yaml", [*base, "parallel.tensor=2",
                                                       "parallel.data=2", "parallel.expert=2"]),
                     arch)
    with pytest.raises(PreflightError, match="rollout.engine=reference runs Llama and Qwen2"):
        check_layout(load_config("configs/tiny.yaml", [*base, "parallel.world_size=1",
                                                       "parallel.data=1",
                                                       "rollout.engine=reference"]),
                     arch)
