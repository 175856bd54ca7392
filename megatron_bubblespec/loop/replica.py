"""One rank's resources: config -> model checkpoint, rollout layout and engine, Megatron trainer +
verifier, resharder, bubble drafter, task and lookahead sampler, drafting policy.

Rollout has a layout of its own (``loop.layout``): every rank belongs to one rollout engine of
``rollout.tensor_parallel`` consecutive ranks of its model replica, so every rank generates. An
engine of one rank lives in process; a tensor-parallel one holds one vLLM shard per rank (vLLM's
external launcher), and its first rank drives it in lockstep (``loop.lockstep``). vLLM's process
groups are created on every rank before any engine (``distributed.vllm_groups``), so building the
engines never waits on a rank that is elsewhere.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_bubblespec.cache import cache_dir
from megatron_bubblespec.config import Config
from megatron_bubblespec.data.lookahead import LookaheadSampler
from megatron_bubblespec.data.registry import task_from_config
from megatron_bubblespec.data.tasks import Task, check_prompt_lengths
from megatron_bubblespec.distributed import init_distributed, megatron_cpu_mode
from megatron_bubblespec.distributed.world import default_store
from megatron_bubblespec.loop.layout import RolloutLayout, build_layout
from megatron_bubblespec.models.architecture import ModelSpec, load_checkpoint, make_tiny_checkpoint
from megatron_bubblespec.rollout.factory import build_engine, engine_options
from megatron_bubblespec.sampling import SamplingParams
from megatron_bubblespec.speculative.bubble import BubbleDrafter
from megatron_bubblespec.train.draft_weights import DraftWeightsProbe
from megatron_bubblespec.speculative.factory import build_verifier
from megatron_bubblespec.speculative.policy import DraftingPolicy
from megatron_bubblespec.speculative.previous_epoch import ResponseMemory
from megatron_bubblespec.speculative.queue import DraftQueue
from megatron_bubblespec.speculative.samples import SampleBook
from megatron_bubblespec.speculative.verifier import Verifier
from megatron_bubblespec.train.model import moe_options

if TYPE_CHECKING:   # annotations only: these import megatron / the engines when built
    from megatron_bubblespec.loop.heartbeat import Heartbeat
    from megatron_bubblespec.rollout.base import RolloutEngine
    from megatron_bubblespec.train.reshard import Resharder
    from megatron_bubblespec.train.trainer import MegatronTrainer


@dataclass
class RunState:
    """What the run carries from one step to the next, the same on every rank (checkpointed)."""

    weight_version: int              # the version the trainer (and, after a reshard, the engine) holds
    drafts: DraftQueue               # pending drafts of the coming steps
    responses: ResponseMemory        # latest responses: previous-epoch drafts, history proposals


@dataclass
class Replica:
    """One rank's resources for the synchronous loop (built once; the run's state is ``state``)."""

    cfg: Config
    arch: ModelSpec
    model_path: Path
    params: SamplingParams
    task: Task
    sampler: LookaheadSampler
    trainer: MegatronTrainer
    verifier: Verifier | None          # None when BubbleSpec is off
    resharder: Resharder
    engine: RolloutEngine | None       # the engine the loop drives (engine leaders only)
    drafter: BubbleDrafter | None      # engine leaders only
    engine_shard: RolloutEngine        # this rank's own engine (or its shard of a TP engine)
    layout: RolloutLayout
    replica_group: dist.ProcessGroup   # gloo, the replica's ranks (results to the learners)
    world_group: dist.ProcessGroup     # gloo, every rank (drafts, per-engine metrics)
    state: RunState
    policy: DraftingPolicy             # what is drafted, verified, proposed, remembered (on state)
    heartbeat: Heartbeat | None = None  # when the loop keeps one
    draft_weights: DraftWeightsProbe | None = None   # ablation.measure_draft_weights

    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank

    @property
    def dp_size(self) -> int:
        return self.layout.dp_size

    def beat(self, step: int, stage: str) -> None:
        if self.heartbeat is not None:
            self.heartbeat.beat(step, stage)


def resolve_model(cfg: Config, rank: int) -> Path:
    """tiny -> a cached random checkpoint; smollm2 -> the shipped model's cached conversion; else a
    directory. Rank 0 prepares it, the others wait at a barrier."""
    m = cfg.model
    if m.path == "tiny":
        name = f"tiny-llama-v{m.tiny_vocab_size}-h{m.tiny_hidden_size}-l{m.tiny_layers}-s{m.tiny_seed}"
        path = cache_dir("models") / name
        if rank == 0 and not (path / "config.json").is_file():
            staging = path.with_name(f"{name}.tmp{os.getpid()}")
            make_tiny_checkpoint(staging, "llama", seed=m.tiny_seed, vocab_size=m.tiny_vocab_size,
                                 hidden_size=m.tiny_hidden_size, num_layers=m.tiny_layers,
                                 max_position_embeddings=max(m.max_model_len, 1024))
            try:
                staging.rename(path)
            except OSError:  # another job made the same model meanwhile: keep theirs
                shutil.rmtree(staging, ignore_errors=True)
    elif m.path == "smollm2":
        from megatron_bubblespec.models.smollm2 import NAME, smollm2_checkpoint

        path = smollm2_checkpoint() if rank == 0 else cache_dir("models") / NAME
    else:
        path = Path(m.path)
    if dist.is_initialized():   # a script's single process has no peers to wait for
        dist.barrier()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model.path={m.path!r}: {path} has no config.json; use tiny, "
                                "smollm2 or an HF checkpoint directory")
    return path


def build_task(cfg: Config, arch: ModelSpec) -> Task:
    task = task_from_config(cfg, arch.vocab_size)
    check_prompt_lengths(task, cfg.data.max_prompt_tokens,
                         indices=range(min(task.size, 4096)))
    return task


def model_parallel_options(cfg: Config) -> dict:
    """TransformerConfig overrides from the config: sequence parallelism, activation recompute,
    the MoE router's load-balancing loss (ignored by dense models)."""
    options = moe_options(cfg.train.moe_load_balancing, cfg.train.moe_aux_loss_coeff)
    if cfg.parallel.sequence_parallel:
        options["sequence_parallel"] = True
    if cfg.train.recompute_activations:
        options.update(recompute_granularity="full", recompute_method="uniform",
                       recompute_num_layers=1)
    return options


def build_replica(cfg: Config) -> Replica:
    """Start the process groups and build this rank's resources (collective: all ranks call it)."""
    from megatron.core import parallel_state as ps

    from megatron_bubblespec.train.grpo import GRPOConfig
    from megatron_bubblespec.train.model import build_gpt_model
    from megatron_bubblespec.train.sharding import load_hf_weights
    from megatron_bubblespec.train.trainer import MegatronTrainer, TrainerConfig

    p = cfg.parallel
    world = init_distributed(p.tensor, p.pipeline, seed=cfg.run.seed,
                             timeout_s=cfg.spec.barrier_timeout_s, context_parallel=p.context,
                             order=p.order, expert_parallel=p.expert)
    path = resolve_model(cfg, world.rank)
    arch, tensors = load_checkpoint(path)
    dtype = getattr(torch, cfg.model.dtype)
    with megatron_cpu_mode():
        model = build_gpt_model(arch, params_dtype=dtype, **model_parallel_options(cfg))
        load_hf_weights(model, arch, tensors)
    del tensors   # the engine reads its own copy: free this one before it loads
    t = cfg.train
    trainer = MegatronTrainer(model, arch, TrainerConfig(
        lr=t.lr, weight_decay=t.weight_decay, clip_grad=t.clip_grad,
        micro_batch_size=t.micro_batch_size, use_distributed_optimizer=t.use_distributed_optimizer,
        temperature=cfg.rollout.temperature,
        grpo=GRPOConfig(clip_eps_low=t.clip_eps, clip_eps_high=t.clip_eps, kl_coef=t.kl_coef,
                        tis_cap=t.tis_cap)))
    params = SamplingParams.of(cfg.rollout)
    task = build_task(cfg, arch)
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    sampler = LookaheadSampler(cfg.run.seed, task.size, cfg.rollout.prompts_per_step, dp_size,
                               cfg.rollout.samples_per_prompt)
    rollout_tp = cfg.rollout.tensor_parallel
    layout, replica_group, world_group = build_layout(rollout_tp, dp_rank, dp_size)
    state = RunState(0, DraftQueue.from_config(cfg, task.eos_token_ids, arch.vocab_size,
                                               engines_per_replica=layout.engines_per_replica),
                     ResponseMemory())
    policy = DraftingPolicy(cfg, SampleBook(task, sampler, cfg.run.seed), state.drafts,
                            state.responses)
    if cfg.rollout.engine == "vllm":
        from megatron_bubblespec.distributed.vllm_groups import init_vllm_parallel_state

        init_vllm_parallel_state(rollout_tp, layout.engine_ranks,       # every rank, before engines
                                 run_name=cfg.run.name)
    engine_shard = build_engine(path, **engine_options(cfg))
    engine = drafter = None
    if layout.leads_engine:
        engine = engine_shard
        if rollout_tp > 1:
            from megatron_bubblespec.distributed.vllm_groups import engine_cpu_group
            from megatron_bubblespec.loop.lockstep import LockstepEngine

            engine = LockstepEngine(engine_shard, engine_cpu_group())
        drafter = BubbleDrafter(default_store(), layout.num_engines, engine, params,
                                policy.claims, timeout_s=cfg.spec.barrier_timeout_s,
                                namespace=f"bubblespec/{cfg.run.name}")
    verifier = build_verifier(cfg, params, model=model, arch=arch, engine=engine)
    return Replica(cfg, arch, path, params, task, sampler, trainer, verifier, trainer.resharder(),
                   engine, drafter, engine_shard, layout, replica_group, world_group, state,
                   policy, draft_weights=DraftWeightsProbe()
                   if cfg.ablation.measure_draft_weights else None)
