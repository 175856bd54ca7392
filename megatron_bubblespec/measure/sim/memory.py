"""Model shape + GPU memory + rollout TP -> one engine's KV cache: tokens and full-length sequences.

The arithmetic is vLLM's own budget: an engine takes ``gpu_memory_utilization`` of each of its
GPUs and keeps there its shard of the weights, a fixed overhead (activations, CUDA graphs, the
keyed sampler's scratch) and, in the rest, its shard of the KV cache. GB = 1e9 bytes throughout.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

# Public config.json facts of the checkpoints the configs name, and the per-GPU engine overhead
# besides weights and KV cache that the configs budget (an estimate, not a measurement).
KNOWN_MODELS = {
    "Qwen2.5-7B": dict(params=7.62e9, layers=28, heads=28, kv_heads=4, head_dim=128,
                       engine_overhead=3e9),
    "Qwen2.5-7B-Instruct": dict(params=7.62e9, layers=28, heads=28, kv_heads=4, head_dim=128,
                                engine_overhead=3e9),
    "Qwen2.5-32B": dict(params=32.76e9, layers=64, heads=40, kv_heads=8, head_dim=128,
                        engine_overhead=4e9),
    "Qwen3-8B": dict(params=8.19e9, layers=36, heads=32, kv_heads=8, head_dim=128,
                     engine_overhead=4e9),
    # a mixture of experts: vLLM holds every expert (30.5e9 parameters, 3.3e9 active per token)
    "Qwen3-30B-A3B": dict(params=30.5e9, layers=48, heads=32, kv_heads=4, head_dim=128,
                          engine_overhead=4e9),
}
DEFAULT_ENGINE_OVERHEAD = 4e9   # a model read from its config.json: the larger of the estimates
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class ModelShape:
    params: float
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    engine_overhead: float = DEFAULT_ENGINE_OVERHEAD   # bytes per GPU besides weights and KV


@dataclass(frozen=True)
class KVCapacity:
    """One engine of ``engine_tp`` GPUs: per-GPU bytes and the KV cache they leave."""

    engine_tp: int
    engine_bytes: float          # gpu_memory_utilization x GPU memory
    weight_bytes: float          # this GPU's shard of the weights
    overhead_bytes: float
    kv_bytes: float              # what is left for the KV cache on this GPU
    kv_bytes_per_token: float    # this GPU's share of one token's K and V
    tokens: int                  # KV tokens the engine holds (the same on each of its GPUs)
    max_model_len: int

    @property
    def sequences(self) -> int:
        """Sequences of ``max_model_len`` tokens the engine holds at once (0: vLLM refuses to
        start)."""
        return self.tokens // self.max_model_len


def parameters(arch) -> float:
    """Parameters of a ``ModelSpec`` (Llama, Qwen2, Qwen3, Qwen3-MoE): embeddings (twice when
    untied), per layer the attention projections (+ QKV bias, + the q and k RMSNorms of
    ``head_dim`` each), the MLP and two norms, and the final norm. The MLP is one SwiGLU of
    ``intermediate_size``, or for a mixture of experts the router (``num_experts x hidden``) and
    ``num_experts`` SwiGLU experts of ``moe_intermediate_size`` (all of them: the total, not the
    parameters active per token)."""
    h, q, kv = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    attention = 2 * h * q + 2 * h * kv + (q + 2 * kv if arch.qkv_bias else 0)
    if arch.qk_norm:
        attention += 2 * arch.head_dim
    if arch.is_moe:
        mlp = arch.num_experts * h + arch.num_experts * 3 * h * arch.moe_intermediate_size
    else:
        mlp = 3 * h * arch.intermediate_size
    layer = attention + mlp + 2 * h
    embeddings = arch.vocab_size * h * (1 if arch.tie_word_embeddings else 2)
    return float(embeddings + arch.num_layers * layer + h)


def model_shape(path: str) -> ModelShape:
    """The shape of the checkpoint at ``path``: its config.json when it is there, else the public
    facts of a checkpoint of that directory name (``KNOWN_MODELS``)."""
    config = Path(path) / "config.json"
    if config.is_file():
        from megatron_bubblespec.models.architecture import ModelSpec

        arch = ModelSpec.from_hf_config(json.loads(config.read_text()))
        return ModelShape(parameters(arch), arch.num_layers, arch.num_heads, arch.num_kv_heads,
                          arch.head_dim)
    name = Path(path).name
    if name not in KNOWN_MODELS:
        raise ValueError(f"model {path!r}: no config.json there and not one of "
                         f"{sorted(KNOWN_MODELS)}; the KV cache arithmetic needs its shape")
    return ModelShape(**KNOWN_MODELS[name])


def engine_tp_ok(shape: ModelShape, engine_tp: int) -> bool:
    """vLLM's rule: TP divides the query heads, and divides the KV heads or is a multiple of
    them (each GPU then keeps a copy of one KV head)."""
    r = engine_tp
    return (shape.heads % r == 0
            and (shape.kv_heads % r == 0 if r <= shape.kv_heads else r % shape.kv_heads == 0))


def kv_capacity(shape: ModelShape, engine_tp: int, *, gpu_bytes: float,
                gpu_memory_utilization: float, max_model_len: int, dtype: str = "bfloat16",
                overhead_bytes: float | None = None) -> KVCapacity:
    """KV cache of one engine of rollout TP ``r`` = ``engine_tp``, per GPU:

        engine    = gpu_memory_utilization x gpu_bytes
        weights   = dtype bytes x params / r
        KV        = engine - weights - overhead         (overhead: ``shape.engine_overhead``)
        per token = 2 (K and V) x layers x kv_heads x head_dim x dtype bytes / r
                    (kv_heads / r is at least 1: at r > kv_heads each GPU keeps one KV head)
        tokens    = floor(KV / per token);  sequences = floor(tokens / max_model_len)

    Qwen2.5-7B on an 80 GB GPU at 0.36 and r = 4: 28.8 - 3.81 - 3 = 21.99 GB of KV at 14,336 B
    a token = 1,533,900 tokens = 46 sequences of 32,768. vLLM's block rounding (16 tokens) and
    its own profiling of the activations are left out.
    """
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if not engine_tp_ok(shape, engine_tp):
        raise ValueError(f"rollout TP {engine_tp} does not split {shape.heads} query heads / "
                         f"{shape.kv_heads} KV heads (vLLM refuses it)")
    size = DTYPE_BYTES[dtype]
    engine = gpu_memory_utilization * gpu_bytes
    weights = size * shape.params / engine_tp
    overhead = shape.engine_overhead if overhead_bytes is None else overhead_bytes
    kv = engine - weights - overhead
    per_token = 2 * shape.layers * max(shape.kv_heads / engine_tp, 1) * shape.head_dim * size
    tokens = max(math.floor(kv / per_token), 0)
    return KVCapacity(engine_tp, engine, weights, overhead, kv, per_token, tokens, max_model_len)
