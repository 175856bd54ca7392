"""HF-layout Llama/Qwen2 tensors -> a plain-torch forward over a slot-indexed KV cache -> logits.

The reference engine's model. Each sequence lives in a cache *slot*; a forward takes, per row, a
run of new tokens at absolute positions ``start .. start + length - 1`` of its slot, writes their
keys/values there and attends to everything at or before each query's position. The same call
serves prefill (long runs), decode (one token) and speculative verification (one token plus the
proposals); rolling back rejected proposals is just not advancing the slot's length, since stale
entries past a query's position are never attended to.
"""

from __future__ import annotations

import torch

from megatron_bubblespec.models.architecture import ModelSpec


class SlotKVCache:
    """Keys/values [layers] x [slots, kv_heads, capacity, head_dim], grown on demand."""

    def __init__(self, arch: ModelSpec, capacity: int, dtype: torch.dtype):
        self.arch, self.capacity, self.dtype = arch, capacity, dtype
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.num_slots = 0
        self._free: list[int] = []

    def _grow(self, extra: int) -> None:
        shape = (extra, self.arch.num_kv_heads, self.capacity, self.arch.head_dim)
        new = [torch.zeros(shape, dtype=self.dtype) for _ in range(2 * self.arch.num_layers)]
        if not self.keys:
            self.keys, self.values = new[::2], new[1::2]
        else:
            self.keys = [torch.cat([k, n]) for k, n in zip(self.keys, new[::2])]
            self.values = [torch.cat([v, n]) for v, n in zip(self.values, new[1::2])]
        self._free.extend(range(self.num_slots, self.num_slots + extra))
        self.num_slots += extra

    def acquire(self) -> int:
        if not self._free:
            self._grow(max(4, self.num_slots))
        return self._free.pop(0)

    def release(self, slot: int) -> None:
        self._free.append(slot)
        self._free.sort()


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class TorchLlama:
    """Forward of the Llama/Qwen2 family in plain torch (float32 or float64)."""

    def __init__(self, arch: ModelSpec, tensors: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32, max_model_len: int | None = None):
        if arch.yarn_factor:
            raise ValueError("the reference engine has no YaRN rope scaling: use "
                             "rollout.engine=vllm for a model whose config.json sets it")
        self.arch, self.dtype = arch, dtype
        self.max_model_len = max_model_len or arch.max_position_embeddings
        self.weights: dict[str, torch.Tensor] = {}
        self.load(tensors.items())
        self.cache = SlotKVCache(arch, self.max_model_len, dtype)
        self.inv_freq = 1.0 / (arch.rope_theta ** (
            torch.arange(0, arch.head_dim, 2, dtype=torch.float64) / arch.head_dim))

    def expected_names(self) -> set[str]:
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not self.arch.tie_word_embeddings:
            names.add("lm_head.weight")
        for i in range(self.arch.num_layers):
            p = f"model.layers.{i}."
            names |= {p + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                      "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                      "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                                      "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                      "mlp.down_proj.weight")}
            if self.arch.qkv_bias:
                names |= {p + f"self_attn.{n}_proj.bias" for n in "qkv"}
        return names

    def load(self, named_tensors) -> None:
        """Replace every weight with HF-layout tensors: all or nothing.

        Every tensor of the architecture must come, each once and in its shape, and nothing else
        (a tied ``lm_head.weight`` and rotary ``inv_freq`` buffers are ignored); otherwise a
        ``KeyError`` / ``ValueError`` names the offending tensors and the old weights stay.
        """
        expected = self.expected_names()
        staged: dict[str, torch.Tensor] = {}
        for name, tensor in named_tensors:
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name not in expected:
                raise KeyError(f"unexpected tensor {name!r} for a {self.arch.arch} model")
            if name in staged:
                raise KeyError(f"tensor {name!r} sent twice")
            old = self.weights.get(name)
            if old is not None and old.shape != tensor.shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the model's "
                                 f"is {tuple(old.shape)}")
            staged[name] = tensor.detach().to(self.dtype).clone()
        missing = sorted(expected - set(staged))
        if missing:
            raise KeyError(f"missing tensors ({len(missing)}): {missing[:8]}"
                           + (" ..." if len(missing) > 8 else ""))
        self.weights = staged

    def _w(self, name: str) -> torch.Tensor:
        return self.weights[name]

    def _lm_head(self) -> torch.Tensor:
        return self._w("model.embed_tokens.weight" if self.arch.tie_word_embeddings
                       else "lm_head.weight")

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor,
                lengths: torch.Tensor) -> torch.Tensor:
        """tokens [B, n] (row b valid up to lengths[b]) at positions starts[b] + j -> logits
        [B, n, V]."""
        arch = self.arch
        b, n = tokens.shape
        positions = starts.view(-1, 1) + torch.arange(n)
        if int((starts + lengths).max()) > self.max_model_len:
            raise ValueError(f"sequence exceeds max_model_len={self.max_model_len}")
        valid = torch.arange(n).view(1, -1) < lengths.view(-1, 1)
        rows, cols = valid.nonzero(as_tuple=True)
        angles = positions.to(torch.float64).unsqueeze(-1) * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos().to(self.dtype)[:, None], angles.sin().to(self.dtype)[:, None]
        span = int((starts + lengths).max())
        key_pos = torch.arange(span)
        mask = key_pos.view(1, 1, 1, -1) <= positions.view(b, 1, n, 1)
        group = arch.num_heads // arch.num_kv_heads
        x = self._w("model.embed_tokens.weight")[tokens.clamp(min=0)]
        for i in range(arch.num_layers):
            p = f"model.layers.{i}."
            h = _rms_norm(x, self._w(p + "input_layernorm.weight"), arch.rms_norm_eps)
            q, k, v = (torch.nn.functional.linear(
                h, self._w(p + f"self_attn.{m}_proj.weight"),
                self.weights.get(p + f"self_attn.{m}_proj.bias")) for m in "qkv")
            q = q.view(b, n, arch.num_heads, arch.head_dim).transpose(1, 2)
            k = k.view(b, n, arch.num_kv_heads, arch.head_dim).transpose(1, 2)
            v = v.view(b, n, arch.num_kv_heads, arch.head_dim).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            cache_k, cache_v = self.cache.keys[i], self.cache.values[i]
            cache_k[slots[rows], :, positions[rows, cols]] = k.transpose(1, 2)[rows, cols]
            cache_v[slots[rows], :, positions[rows, cols]] = v.transpose(1, 2)[rows, cols]
            keys = cache_k[slots, :, :span].repeat_interleave(group, dim=1)
            values = cache_v[slots, :, :span].repeat_interleave(group, dim=1)
            scores = (q @ keys.transpose(-1, -2)) / arch.head_dim ** 0.5
            scores = scores.masked_fill(~mask, float("-inf"))
            attn = torch.softmax(scores, dim=-1) @ values
            attn = attn.transpose(1, 2).reshape(b, n, arch.num_heads * arch.head_dim)
            x = x + torch.nn.functional.linear(attn, self._w(p + "self_attn.o_proj.weight"))
            h = _rms_norm(x, self._w(p + "post_attention_layernorm.weight"), arch.rms_norm_eps)
            gate = torch.nn.functional.linear(h, self._w(p + "mlp.gate_proj.weight"))
            up = torch.nn.functional.linear(h, self._w(p + "mlp.up_proj.weight"))
            x = x + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up,
                                               self._w(p + "mlp.down_proj.weight"))
        x = _rms_norm(x, self._w("model.norm.weight"), arch.rms_norm_eps)
        return torch.nn.functional.linear(x, self._lm_head())
