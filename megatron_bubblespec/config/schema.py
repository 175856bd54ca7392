"""The run's typed configuration: one dataclass per room, with the allowed values of every choice.

The defaults are the main job's settings (SmolLM2-135M-Instruct trained with GRPO on GSM8K, 2
data-parallel ranks, vLLM rollouts, BubbleSpec on): ``bubblespec train`` with no config file runs
it, and docs/results/settings.md says why each setting is what it is. YAML files and dotted
command-line overrides are merged onto these dataclasses by ``config.load``; an unknown key, a
wrong type or a value outside ``CHOICES`` is an error that names the key before any process starts.

Field metadata ``OBSERVER`` and ``OFF_RUN`` mark the keys a run's tokens, counts and rollout work
do not depend on (``config.identity.run_identity`` leaves them out).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

# No run's tokens, counts or rollout work depend on this key: where and how often the run
# checkpoints, its watchdogs, what it logs.
OBSERVER = {"identity": "observer"}
# A run with BubbleSpec off does not depend on this key either (nothing drafts, so nothing reuses
# what it sizes).
OFF_RUN = {"identity": "off_run"}


@dataclass
class RunConfig:
    name: str = "smollm2-gsm8k"
    seed: int = 1234
    steps: int = 6
    output_dir: str = "runs"
    resume: str = field(default="none", metadata=OBSERVER)   # none | auto | PATH of a checkpoint
    checkpoint_every: int = field(default=0, metadata=OBSERVER)   # steps; 0 = only at the end
    # default: <output_dir>/<name>/checkpoints
    checkpoint_dir: str = field(default="", metadata=OBSERVER)
    # complete checkpoints kept (older ones are deleted)
    keep_checkpoints: int = field(default=2, metadata=OBSERVER)
    # no-progress watchdog: abort when no stage ends for this long (0 = off)
    stall_timeout_s: float = field(default=1800.0, metadata=OBSERVER)
    # after SIGTERM/SIGINT, a rank stuck this long exits, naming its stage
    signal_grace_s: float = field(default=30.0, metadata=OBSERVER)
    # after SIGTERM/SIGINT, the most a rank making progress may take to finish its step and
    # checkpoint
    checkpoint_grace_s: float = field(default=300.0, metadata=OBSERVER)


@dataclass
class ModelConfig:
    path: str = "smollm2"           # tiny | smollm2 | an HF checkpoint directory
    dtype: str = "float32"
    max_model_len: int = 1024
    # Shape of the random model when path == tiny (for tests of mechanics).
    tiny_vocab_size: int = 256
    tiny_hidden_size: int = 64
    tiny_layers: int = 2
    tiny_seed: int = 0


@dataclass
class ParallelConfig:
    world_size: int = 2             # processes the CLI launches when not inside torchrun/srun
    tensor: int = 1
    pipeline: int = 1
    data: int = 2
    context: int = 1                # context parallelism of the training forward/backward (GPU)
    sequence_parallel: bool = False # Megatron sequence parallelism inside the TP group
    expert: int = 1                 # Megatron expert parallelism (mixtures of experts); divides data
    # Megatron's rank order, innermost first. The default keeps DP inside PP (a replica's stages
    # far apart); tp-cp-ep-pp-dp makes each replica's ranks consecutive, so a rollout engine
    # (rollout.tensor_parallel consecutive ranks) may span its pipeline stages.
    order: str = "tp-cp-ep-dp-pp"


@dataclass
class RolloutConfig:
    engine: str = "vllm"            # vllm | reference
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    # what keys each draw's noise (sampling.draw_words): its response position, or its last k
    # tokens and their count (context<k>: a response that meets its draft's text again draws as
    # the draft did)
    keying: str = "position"
    max_new_tokens: int = 384
    samples_per_prompt: int = 2
    prompts_per_step: int = 2       # global, over all DP ranks
    kv_cache_mb: int = 512          # CPU: KV cache size; GPU: see gpu_memory_utilization
    # tokens per KV block (vLLM's prefix-cache unit; None: vLLM's choice, 128 on CPU, 16 on GPU);
    # a request prefills what follows its last cached full block (ablation.reuse_draft_kv)
    kv_block_size: Optional[int] = field(default=32, metadata=OFF_RUN)
    tensor_parallel: int = 1        # ranks per engine, a divisor of TP x CP; every rank is in one engine
    gpu_memory_utilization: float = 0.5  # fraction of a GPU vLLM may take (GPU)
    # tokens one engine step computes, prompt chunks and verified draft rows alike (None: vLLM's
    # platform default); it bounds the step's [tokens x vocabulary] logits and their copies
    max_num_batched_tokens: Optional[int] = None
    sleep_during_train: bool = False     # vLLM sleep mode while Megatron trains and reshards (GPU)
    sleep_level: int = 1            # 1: KV cache freed, weights to host; 2: weights freed too
    # vLLM's batch-invariant kernels (VLLM_BATCH_INVARIANT=1, GPU): a drafted position's logits do
    # not depend on the batch, so drafts verified inside the engine keep bfloat16 tokens on == off
    batch_invariant: bool = False


@dataclass
class SpecConfig:
    enabled: bool = True
    # engine (vLLM: inside the rollout, any layout; reference: TP = PP = 1) | megatron (a forward
    # of prompt + draft in the training layout, the reference verifier)
    verifier: str = "engine"
    max_draft_tokens: int = 384     # per sample
    draft_chunk: int = 1            # samples claimed from the shared cursor at a time
    draft_in_flight: int = 32       # next-step samples a drafting rank keeps in its engine at once
    # new drafting requests an engine step of the bubble may take, in estimated prefill tokens (0:
    # no bound, the batch is claimed at once); bounds the engine step in flight when the barrier
    # closes, which the step waits for (speculative.bubble)
    draft_prefill_tokens: int = 256
    # what a decoding sample proposes from (speculative.sources registers and describes them);
    # each is counted in spec/continuation_*/<source>
    proposal_sources: list[str] = field(
        default_factory=lambda: ["bubble", "realign", "prompt", "self", "siblings"])
    spec_k: int = 4
    suffix_k: int = 32              # the most tokens a suffix match proposes (as long as it is)
    # the cost of one proposed token, as a fraction of a decode step: each sample then proposes
    # the 0 .. spec_k tokens that pay at its recent acceptance (speculative.pool); none: always
    # spec_k
    proposal_token_cost: Optional[float] = 0.4
    min_match: int = 3
    max_match: int = 8
    barrier_timeout_s: float = field(default=600.0, metadata=OBSERVER)   # a watchdog
    draft_horizon: int = 3          # bubbles draft steps t+k .. t+k+H-1 (later ones fill the batch)
    # a bubble with every draft complete re-drafts the ones older weights made, nearest step
    # first, its engine verifying the old draft as proposals (speculative.queue; engine verifier
    # only)
    refresh_drafts: bool = True


@dataclass
class AblationConfig:
    """Switches that exist to reproduce the paper's ablations (``scripts/ablations/``); the main
    job runs at these values."""

    # keyed (exact) | residual, lenient: other verification rules (speculative.rules registers them)
    rule: str = "keyed"
    lenience: float = 2.0           # the lenient rule accepts when u <= lenience * p/q (SPEC-RL)
    draft_source: str = "bubble"    # bubble (BubbleSpec) | previous_epoch (SPEC-RL-like)
    draft_lookahead: int = 1        # bubble drafts are made for step t + k (k > 1: staler drafts)
    # which of a step's samples a bubble drafts first (speculative.queue): engines (round-robin over
    # the engines that roll them out) | stragglers (partial drafts still running first, longest
    # first)
    draft_order: str = "engines"
    # decoding samples propose tokens from spec.proposal_sources after a divergence
    # (speculative.pool)
    speculative_continuation: bool = True
    # vLLM keeps its prefix cache across weight updates, salted per weight version for rollouts and
    # shared by drafting requests: a bubble extends a partial draft on the KV an earlier bubble left
    # (computed by older weights: only a proposal) instead of prefilling prompt + draft again
    reuse_draft_kv: bool = True
    # each vLLM engine measures spec.proposal_token_cost at start-up instead, at its share of a
    # step's samples, and logs spec/proposal_token_cost
    measure_proposal_cost: bool = False
    # the learner also measures how near weights extrapolated from its last two steps come to the
    # next step's policy (train.draft_weights: policy/draft_kl_*_step)
    measure_draft_weights: bool = False


@dataclass
class TrainConfig:
    lr: float = 2.0e-6
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    micro_batch_size: int = 2
    clip_eps: float = 0.2
    kl_coef: float = 0.0            # k3 KL penalty to the frozen initial policy (0 = none, no copy kept)
    # truncated importance sampling of the engine / trainer mismatch (train.grpo): the cap on
    # Megatron's over the engine's token probability; 0 = off. The one setting under which the
    # learner reads the engine's logprobs, so runs with BubbleSpec on and off may part.
    tis_cap: float = 0.0
    normalize_advantage_std: bool = True
    use_distributed_optimizer: bool = False
    recompute_activations: bool = False  # full per-layer activation recompute (long contexts)
    # the MoE router's load-balancing loss (Megatron's moe_router_load_balancing_type and
    # moe_aux_loss_coeff); RL recipes keep it off or small
    moe_load_balancing: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    offload_during_rollout: bool = False  # optimizer state + gradient buffers on the host while engines generate (GPU)


@dataclass
class DataConfig:
    task: str = "gsm8k"             # synthetic | arithmetic | gsm8k | jsonl | code (data.registry)
    path: str = ""                  # jsonl, code: a file of rows, one JSON object per line
    split: str = "train"
    size: int = 512                 # prompts of the synthetic tasks
    max_prompts: int = 0            # use only the task's first N prompts (0: all); few enough and
    #                                 a run sees each prompt again (the history proposal source)
    max_prompt_tokens: int = 320
    # a step's rewards are computed within this time, or score 0 and are logged (the code task's
    # sandboxes; data.code_task)
    reward_time_limit_s: float = 60.0


@dataclass
class LoggingConfig:
    tensorboard: bool = field(default=True, metadata=OBSERVER)
    progress: bool = field(default=True, metadata=OBSERVER)
    plot: bool = field(default=True, metadata=OBSERVER)


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    ablation: AblationConfig = field(default_factory=AblationConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    config_path: Optional[str] = None


# What speculative continuation proposes from (``speculative.pool``, where each is described).
# Which of a step's samples a bubble drafts first (``speculative.queue``, where each is described).
DRAFT_ORDERS = ("engines", "stragglers")
# What keys a draw's noise: its position, or its last k tokens (``sampling.draw_words``).
KEYINGS = ("position",) + tuple(f"context{k}" for k in range(1, 9))

CHOICES = {
    "rollout.engine": ("vllm", "reference"),
    "rollout.keying": KEYINGS,
    "parallel.order": ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"),
    "spec.verifier": ("megatron", "engine"),
    "ablation.draft_source": ("bubble", "previous_epoch"),
    "ablation.draft_order": DRAFT_ORDERS,
    "data.split": ("train", "test"),
    "train.moe_load_balancing": ("aux_loss", "seq_aux_loss", "none"),
    "model.dtype": ("float32", "float64", "bfloat16"),
}

# key -> (predicate, what it must be)
BOUNDS = {
    "run.steps": (lambda v: v >= 1, ">= 1"),
    "run.checkpoint_every": (lambda v: v >= 0, ">= 0"),
    "parallel.world_size": (lambda v: v >= 1, ">= 1"),
    "parallel.tensor": (lambda v: v >= 1, ">= 1"),
    "parallel.pipeline": (lambda v: v >= 1, ">= 1"),
    "parallel.data": (lambda v: v >= 1, ">= 1"),
    "parallel.expert": (lambda v: v >= 1, ">= 1"),
    "train.moe_aux_loss_coeff": (lambda v: v >= 0, ">= 0 (0 = off)"),
    "rollout.temperature": (lambda v: v >= 0, ">= 0"),
    "rollout.top_k": (lambda v: v >= 0, ">= 0 (0 = off)"),
    "rollout.top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "rollout.max_new_tokens": (lambda v: v >= 1, ">= 1"),
    "rollout.samples_per_prompt": (lambda v: v >= 2, ">= 2 (GRPO needs a group)"),
    "rollout.prompts_per_step": (lambda v: v >= 1, ">= 1"),
    "spec.max_draft_tokens": (lambda v: v >= 0, ">= 0"),
    "spec.draft_chunk": (lambda v: v >= 1, ">= 1"),
    "spec.draft_in_flight": (lambda v: v >= 1, ">= 1"),
    "spec.draft_prefill_tokens": (lambda v: v >= 0, ">= 0 (0 = no bound)"),
    "spec.spec_k": (lambda v: v >= 1, ">= 1"),
    "spec.suffix_k": (lambda v: v >= 1, ">= 1"),
    "spec.min_match": (lambda v: v >= 1, ">= 1"),
    "train.lr": (lambda v: v >= 0, ">= 0"),
    "train.micro_batch_size": (lambda v: v >= 1, ">= 1"),
    "train.clip_eps": (lambda v: v > 0, "> 0"),
    "train.kl_coef": (lambda v: v >= 0, ">= 0 (0 = no KL penalty)"),
    "train.tis_cap": (lambda v: v == 0 or v >= 1, "0 (off) or >= 1 (the cap on the weight)"),
    "model.max_model_len": (lambda v: v >= 16, ">= 16"),
    "parallel.context": (lambda v: v >= 1, ">= 1"),
    "rollout.tensor_parallel": (lambda v: v >= 1, ">= 1"),
    "rollout.sleep_level": (lambda v: v in (1, 2), "1 or 2"),
    "rollout.gpu_memory_utilization": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "rollout.max_num_batched_tokens": (lambda v: v is None or v >= 16,
                                       ">= 16, or null for vLLM's default"),
    "rollout.kv_block_size": (lambda v: v is None or (v >= 16 and v % 16 == 0),
                              "a multiple of 16 (vLLM's KV blocks), or null for vLLM's default"),
    "ablation.draft_lookahead": (lambda v: v >= 1, ">= 1"),
    "spec.draft_horizon": (lambda v: v >= 1, ">= 1"),
    "ablation.lenience": (lambda v: v >= 1, ">= 1"),
    "run.keep_checkpoints": (lambda v: v >= 1, ">= 1"),
    "run.stall_timeout_s": (lambda v: v >= 0, ">= 0 (0 = off)"),
    "run.signal_grace_s": (lambda v: v > 0, "> 0"),
    "run.checkpoint_grace_s": (lambda v: v > 0, "> 0"),
}
