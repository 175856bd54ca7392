"""HF checkpoint directory -> ModelSpec (the architecture facts every engine and converter reads) + tensors.

Families: Llama, Qwen2, Qwen3 and Qwen3-MoE: RMSNorm, SwiGLU, RoPE, grouped-query attention, tied
or untied embeddings, optional QKV bias (Qwen2), per-head q/k RMSNorm (Qwen3), and for Qwen3-MoE a
softmax router choosing top-k SwiGLU experts in every layer. ``check_checkpoint`` says what an
incomplete directory lacks (before any weights are read); ``make_tiny_checkpoint`` writes a small
random model of any family in the HF layout, for tests of mechanics.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

# HF architecture -> family (the transformers ``model_type``, which also names mbridge's map).
SUPPORTED = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
             "Qwen3MoeForCausalLM": "qwen3_moe"}
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe")


def unsupported_architecture(archs: list) -> str:
    """What to tell a user whose checkpoint is of another family: the supported ones, and what
    a new family needs here."""
    return (f"unsupported architecture {archs}: supported are {sorted(SUPPORTED)}; another "
            "family needs its config read into a ModelSpec (models/architecture.py), its Megatron "
            "layer options (train/model.py) and a weight map from mbridge (train/convert.py)")


@dataclass(frozen=True)
class ModelSpec:
    arch: str                  # a family of SUPPORTED's values
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool
    max_position_embeddings: int
    qk_norm: bool = False           # per-head RMSNorm of q and k before RoPE (Qwen3)
    num_experts: int = 0            # 0: dense MLP; else a routed MoE MLP in every layer
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True     # renormalise the chosen experts' probabilities to sum to 1
    # YaRN rope scaling (HF rope_type "yarn"; Qwen3 past 32k): 0 = none, else the scaling factor
    yarn_factor: float = 0.0
    yarn_original_max_position_embeddings: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_attention_factor: float = 1.0    # the cos/sin scale, as transformers computes it
    yarn_truncate: bool = True            # round the correction range to whole dimensions

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def context_length(self) -> int:
        """The longest sequence the model's positions cover: with YaRN the original context times
        the factor (as vLLM derives it), else max_position_embeddings."""
        if self.yarn_factor:
            return int(self.yarn_original_max_position_embeddings * self.yarn_factor)
        return self.max_position_embeddings

    @classmethod
    def from_hf_config(cls, config: dict) -> "ModelSpec":
        archs = config.get("architectures") or []
        arch = next((SUPPORTED[a] for a in archs if a in SUPPORTED), None)
        if arch is None:
            raise ValueError(unsupported_architecture(archs))
        rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "yarn", None):
            raise ValueError(f"RoPE scaling {rope_type!r} is not supported (only 'default' and "
                             "'yarn')")
        heads = config["num_attention_heads"]
        return cls(
            arch=arch, vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"], num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate_size=config["intermediate_size"], rms_norm_eps=config["rms_norm_eps"],
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(config.get("attention_bias", False)),
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            qk_norm=arch in QK_NORM_FAMILIES, **_moe_fields(arch, config),
            **(_yarn_fields(rope, config) if rope_type == "yarn" else {}))

    def to_dict(self) -> dict:
        return asdict(self)


def _yarn_fields(rope: dict, config: dict) -> dict:
    """The YaRN fields of an HF rope config, with transformers' defaults and its attention factor
    (``modeling_rope_utils._compute_yarn_parameters``)."""
    original = rope.get("original_max_position_embeddings") or config.get(
        "original_max_position_embeddings")
    if not original:
        raise ValueError("YaRN rope scaling needs original_max_position_embeddings in "
                         "rope_scaling (Qwen3: 32768)")
    factor = rope.get("factor") or config["max_position_embeddings"] / original
    attention = rope.get("attention_factor")
    if attention is None:
        mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                     if mscale and mscale_all else _yarn_mscale(factor))
    return dict(yarn_factor=float(factor), yarn_original_max_position_embeddings=int(original),
                yarn_beta_fast=float(rope.get("beta_fast") or 32),
                yarn_beta_slow=float(rope.get("beta_slow") or 1),
                yarn_attention_factor=float(attention),
                yarn_truncate=bool(rope.get("truncate", True)))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _moe_fields(arch: str, config: dict) -> dict:
    """The MoE fields of a Qwen3-MoE config; ValueError for the layouts Megatron's layer spec here
    does not build (dense layers between MoE ones)."""
    if arch != "qwen3_moe":
        return {}
    if config.get("decoder_sparse_step", 1) != 1 or config.get("mlp_only_layers"):
        raise ValueError("Qwen3-MoE with dense layers (decoder_sparse_step != 1 or mlp_only_layers) "
                         "is not supported: every layer must be an MoE layer")
    # transformers 5 writes num_local_experts; the Hub's Qwen3-MoE configs say num_experts.
    experts = config["num_experts"] if "num_experts" in config else config["num_local_experts"]
    return dict(num_experts=experts, experts_per_token=config["num_experts_per_tok"],
                moe_intermediate_size=config["moe_intermediate_size"],
                norm_topk_prob=bool(config.get("norm_topk_prob", False)))


COMPLETE_DIRECTORY = """\
a complete model directory (as written by transformers' save_pretrained) holds
  config.json              with "architectures": one of {archs}
  model.safetensors        or sharded: model.safetensors.index.json + every shard it lists
                           (pytorch_model.bin, or pytorch_model.bin.index.json + its shards, also work)
  tokenizer.json           (or tokenizer.model, or vocab.json + merges.txt) and
  tokenizer_config.json    with a chat template there or in chat_template.jinja (chat tasks)"""
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
TOKENIZER_VOCABS = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))


class CheckpointError(ValueError):
    """A model directory that cannot be loaded: what is missing or wrong, and what it should hold."""


def check_checkpoint(path: str | Path, *, tokenizer: bool = False) -> ModelSpec:
    """The ModelSpec of an HF directory after checking that it is complete: config.json readable
    with a supported architecture, weights present (every shard of an index), and with
    ``tokenizer`` the tokenizer files and a chat template. CheckpointError lists every problem."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"model directory {path} does not exist; "
                              + COMPLETE_DIRECTORY.format(archs=sorted(SUPPORTED)))
    problems: list[str] = []
    arch = _arch_problems(path, problems)
    weight_files(path, problems)
    if tokenizer:
        _tokenizer_problems(path, problems)
    if problems:
        raise CheckpointError(f"model directory {path} is incomplete: " + "; ".join(problems)
                              + ".\n" + COMPLETE_DIRECTORY.format(archs=sorted(SUPPORTED)))
    return arch


def _arch_problems(path: Path, problems: list[str]) -> ModelSpec | None:
    config = path / "config.json"
    if not config.is_file():
        problems.append("config.json is missing")
        return None
    try:
        content = json.loads(config.read_text())
    except json.JSONDecodeError as error:
        problems.append(f"config.json is not valid JSON ({error.msg}, line {error.lineno})")
        return None
    if not isinstance(content, dict):
        problems.append(f"config.json holds a {type(content).__name__}, not a JSON object")
        return None
    try:
        return ModelSpec.from_hf_config(content)
    except KeyError as error:
        problems.append(f"config.json lacks the key {error.args[0]!r}")
    except (ValueError, TypeError) as error:
        problems.append(f"config.json: {error}")
    return None


def weight_files(path: Path, problems: list[str]) -> list[Path]:
    """The weight files to load: an index's shards, else ``*.safetensors``, else
    ``pytorch_model*.bin``; what is missing is appended to ``problems``."""
    for name in WEIGHT_INDEXES:
        index = path / name
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, AttributeError):
                problems.append(f"{name} is not a valid index (no 'weight_map' of tensor -> shard)")
                return []
            absent = [s for s in shards if not (path / s).is_file()]
            if absent:
                problems.append(f"{len(absent)} of the {len(shards)} weight shards listed in "
                                f"{name} are missing: {', '.join(absent)}")
            return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
    if not files:
        problems.append("no weights (model.safetensors, *.safetensors shards or "
                        "pytorch_model*.bin)")
    return files


def _tokenizer_problems(path: Path, problems: list[str]) -> None:
    if not any(all((path / f).is_file() for f in files) for files in TOKENIZER_VOCABS):
        problems.append("no tokenizer vocabulary (tokenizer.json, tokenizer.model, or vocab.json "
                        "+ merges.txt)")
    config = path / "tokenizer_config.json"
    if not config.is_file():
        problems.append("tokenizer_config.json is missing")
        return
    try:
        has_template = "chat_template" in json.loads(config.read_text())
    except json.JSONDecodeError as error:
        problems.append(f"tokenizer_config.json is not valid JSON ({error.msg}, line "
                        f"{error.lineno})")
        return
    if not has_template and not any((path / f).is_file()
                                    for f in ("chat_template.jinja", "chat_template.json")):
        problems.append("no chat template (chat_template in tokenizer_config.json, or "
                        "chat_template.jinja); the chat tasks format prompts with it")


def load_checkpoint(path: str | Path) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """Read an HF directory (config.json + safetensors or .bin weights) into a ModelSpec and
    float tensors; CheckpointError if it is incomplete (see ``check_checkpoint``)."""
    path = Path(path)
    arch = check_checkpoint(path)
    tensors: dict[str, torch.Tensor] = {}
    for shard in weight_files(path, []):
        if shard.suffix == ".safetensors":
            tensors.update(load_file(str(shard)))
        else:
            tensors.update(torch.load(shard, map_location="cpu", weights_only=True))
    return arch, tensors


TINY_HEADS, TINY_KV_HEADS, TINY_HEAD_DIM, TINY_INTERMEDIATE = 4, 2, 32, 128


def tiny_arch(vocab_size: int, hidden_size: int, num_layers: int,
              max_position_embeddings: int) -> ModelSpec:
    """The ModelSpec ``make_tiny_checkpoint`` writes for these sizes (its other defaults), without
    writing anything: what the preflight checks a tiny model's parallel layout against."""
    return ModelSpec("llama", vocab_size, hidden_size, num_layers, TINY_HEADS, TINY_KV_HEADS,
                     TINY_HEAD_DIM, TINY_INTERMEDIATE, 1e-6, 10000.0, False, False,
                     max_position_embeddings)


TINY_EXPERTS, TINY_EXPERTS_PER_TOKEN, TINY_MOE_INTERMEDIATE = 8, 2, 64


def make_tiny_checkpoint(path: str | Path, arch: str = "llama", *, seed: int = 0,
                         vocab_size: int = 256, hidden_size: int = 64, num_layers: int = 2,
                         num_heads: int = TINY_HEADS, num_kv_heads: int = TINY_KV_HEADS,
                         head_dim: int = TINY_HEAD_DIM, intermediate_size: int = TINY_INTERMEDIATE,
                         tie_word_embeddings: bool = False, init_std: float = 0.1,
                         max_position_embeddings: int = 1024, num_experts: int = TINY_EXPERTS,
                         experts_per_token: int = TINY_EXPERTS_PER_TOKEN,
                         moe_intermediate_size: int = TINY_MOE_INTERMEDIATE,
                         rope_scaling: dict | None = None) -> Path:
    """Write a random model of family ``arch`` (a value of SUPPORTED) in HF layout (float32), as
    transformers saves it, and return its path. The MoE sizes apply to ``qwen3_moe`` only (with
    normalised top-k probabilities, as Qwen3-30B-A3B). ``rope_scaling``: HF rope parameters
    besides rope_theta (``{"rope_type": "yarn", "factor": 4.0, ...}``).

    ``init_std`` larger than HF's 0.02 keeps the next-token distributions far from uniform, so
    sampling tests see peaked and flat positions alike. head_dim >= 32 (vLLM's CPU attention).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch not in SUPPORTED.values():
        raise ValueError(f"no tiny checkpoint for family {arch!r}: choose one of "
                         f"{sorted(SUPPORTED.values())}")
    moe = dict(num_experts=num_experts, num_experts_per_tok=experts_per_token,
               moe_intermediate_size=moe_intermediate_size, norm_topk_prob=True,
               router_aux_loss_coef=0.0) if arch == "qwen3_moe" else {}
    config = AutoConfig.for_model(
        arch, vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
        intermediate_size=intermediate_size, tie_word_embeddings=tie_word_embeddings,
        initializer_range=init_std, max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="float32", **moe)
    if rope_scaling:
        config.rope_parameters = {**config.rope_parameters, **rope_scaling}
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: vary them too
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith(".bias"):
                param.normal_(0.0, init_std)
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    return path


def perturb_checkpoint(source: str | Path, target: str | Path, noise_std: float,
                       seed: int = 1) -> Path:
    """Copy an HF checkpoint with Gaussian noise added to every tensor (a stand-in for a nearby
    policy, e.g. last step's, in tests and ablations of drafting)."""
    from safetensors.torch import save_file

    source, target = Path(source), Path(target)
    _, tensors = load_checkpoint(source)
    g = torch.Generator().manual_seed(seed)
    target.mkdir(parents=True, exist_ok=True)
    save_file({k: v + noise_std * torch.randn(v.shape, generator=g) for k, v in tensors.items()},
              str(target / "model.safetensors"))
    (target / "config.json").write_text((source / "config.json").read_text())
    return target
