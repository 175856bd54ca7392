"""GRPO batch (one DP rank's) -> micro-batches -> Megatron pipeline fwd/bwd -> DP grad sum -> Adam step.

``MegatronTrainer`` wraps a GPTModel (this rank's TP/PP shard) in megatron-core's
``DistributedDataParallel`` and steps it with megatron's optimizer (Adam, optional distributed
optimizer) and its learning-rate / weight-decay scheduler (the scheduler is what applies the
optimizer's per-group settings, e.g. no weight decay on biases and norms). It owns the model's
TransformerConfig hooks (``calculate_per_token_loss``, ``no_sync_func``,
``finalize_model_grads_func``, ``grad_scale_func``). Megatron calls run inside
``megatron_cpu_mode()``, so the same code trains over gloo on CPU.

Batches are ``train.batch.GRPOBatch`` (token-aligned [B, S] tensors); the logprob maths is
``train.logprobs``.

Loss normalisation (token mean over the whole global batch, whatever the micro-batch count and the
data-parallel size): the model runs in megatron's per-token-loss mode
(``calculate_per_token_loss``): each micro-batch's loss function returns the *sum* of its
per-token losses and its token count; the schedule then neither divides by the number of
micro-batches nor does DDP divide by the DP size (gradients are summed over DP), and
``finalize_model_grads`` divides all gradients by the token count summed over micro-batches and
DP ranks. Metrics are sums reduced the same way, then divided by the global count.

KL penalty (``grpo.kl_coef > 0``): the reference policy is a frozen copy of this rank's shard of
the model as the trainer receives it (the initial policy), kept in the training layout (same TP/PP
piece, same dtype), so it costs one more copy of the local parameters per rank (params / (TP x PP)
x bytes per parameter; no gradients or optimizer state) and one forward-only pass per step. The
step's ``ref_logprobs`` come from it unless the batch carries its own.

Log-probabilities are computed on the last pipeline stage and broadcast to every stage of the
replica.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist

from megatron_bubblespec.distributed.cpu_compat import megatron_cpu_mode
from megatron_bubblespec.distributed.world import expert_parallel_max
from megatron_bubblespec.models.architecture import ModelSpec
from megatron_bubblespec.train.batch import GRPOBatch
from megatron_bubblespec.train.fingerprint import fingerprint, world_fingerprint
from megatron_bubblespec.train.forward import (broadcast_from_last_stage, context_parallel_gather,
                                               context_parallel_length, context_parallel_split,
                                               model_config)
from megatron_bubblespec.train.grpo import GRPOConfig, grpo_loss
from megatron_bubblespec.train.logprobs import forward_logprobs, label_logprobs, token_logprobs
from megatron_bubblespec.train.model import context_parallel_size


@dataclass(frozen=True)
class TrainerConfig:
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"       # megatron's styles: constant | linear | cosine | ...
    lr_decay_steps: int = 1_000_000
    weight_decay: float = 0.0              # not applied to biases and norm weights
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0                 # max global grad norm; 0 = no clipping
    micro_batch_size: int = 1
    temperature: float = 1.0               # the rollout's: the policy is softmax(logits / T)
    use_distributed_optimizer: bool = False
    grpo: GRPOConfig = field(default_factory=GRPOConfig)


def frozen_copy(model):
    """A copy of ``model``'s parameters and buffers that shares its process groups and config
    (Megatron modules hold both), never trains and needs no gradients."""
    shared = {id(model.config): model.config}
    for module in model.modules():
        for value in vars(module).values():
            groups = [value] + list(getattr(value, "__dict__", {}).values())
            if any(isinstance(group, dist.ProcessGroup) for group in groups):
                shared[id(value)] = value       # a group, or a collection of groups
    frozen = copy.deepcopy(model, memo=shared)
    frozen.requires_grad_(False)
    return frozen.eval()


class GRPOLossStep:
    """Megatron's ``forward_step_func`` for a GRPO step: a micro-batch -> the model's output and
    the loss function Megatron applies to its logits on the last stage -> (loss sum, token count,
    metric sums). It keeps each micro-batch's token logprobs, so the step's own forward also gives
    the logprobs under the weights before the update.

    The policy is the sampling distribution, softmax(logits / T) at the rollout's temperature T:
    the loss, the old logprobs and the entropy are of it. A micro-batch without old logprobs (the
    loop's) takes this forward's own, detached: one update per step, so the ratio is 1 and its
    gradient the policy gradient, as verl's on-policy path does. The logprobs of the logits
    themselves (T = 1) are kept too, for the on-policy check against the engine's raw ones."""

    def __init__(self, grpo: GRPOConfig, vocab_size: int, context_parallel: bool,
                 temperature: float = 1.0):
        self.grpo, self.vocab_size, self.context_parallel = grpo, vocab_size, context_parallel
        self.temperature = temperature
        self.names: list[str] = []                # metric names, in the order of the sums
        self.logprobs: list[torch.Tensor] = []    # per micro-batch (last stage), in order
        self.raw_logprobs: list[torch.Tensor] = []   # the same at T = 1 (only when T != 1)

    def __call__(self, data_iterator, model):
        mb: GRPOBatch = next(data_iterator)
        tokens, labels = mb.tokens, None
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        per_token = [mb.old_logprobs, mb.response_mask, mb.ref_logprobs, mb.engine_logprobs]
        if self.context_parallel:
            # This CP rank's share; a token's values move to the position predicting it.
            shift = lambda t: torch.nn.functional.pad(t[:, 1:], (0, 1))  # noqa: E731
            labels = shift(tokens)
            present = [shift(t) for t in per_token if t is not None]
            tokens, positions, labels, *present = context_parallel_split(
                tokens, positions, labels, *present)
            shares = iter(present)
            per_token = [None if t is None else next(shares) for t in per_token]
        return model(tokens, positions, None), partial(self.loss, tokens, labels, *per_token,
                                                       mb.advantages)

    def _logprobs(self, logits, tokens, labels, with_entropy: bool):
        if labels is not None:
            return label_logprobs(logits, labels, self.vocab_size, with_entropy=with_entropy)
        return token_logprobs(logits, tokens, self.vocab_size, with_entropy=with_entropy)

    def loss(self, tokens, labels, old_logprobs, response_mask, ref_logprobs, engine_logprobs,
             advantages, logits):
        """The micro-batch's loss from its logits (``labels``: the label-aligned targets under
        context parallelism, else None: the tokens themselves, token-aligned)."""
        tempered = logits if self.temperature == 1.0 else logits / self.temperature
        logp, entropy = self._logprobs(tempered, tokens, labels, with_entropy=True)
        if tempered is not logits:
            with torch.no_grad():   # the logits' own cross entropy reuses them: nothing reads them
                self.raw_logprobs.append(
                    self._logprobs(logits.detach(), tokens, labels, False)[0].float())
        self.logprobs.append(logp.detach().float())
        old = logp.detach() if old_logprobs is None else old_logprobs
        loss_sum, sums = grpo_loss(logp, old, advantages, response_mask, self.grpo,
                                   ref_logp=ref_logprobs, entropy=entropy,
                                   engine_logp=engine_logprobs, num_tokens=1.0)
        self.names[:] = sorted(sums)
        count = response_mask.sum().to(torch.int)
        return loss_sum, count, torch.stack([sums[k].float() for k in self.names])

    def token_logprobs(self, seq: int, raw: bool = False) -> torch.Tensor | None:
        """The step's logprobs as token-aligned [B, seq] rows (last stage; None elsewhere): of
        the sampling distribution, or with ``raw`` of the logits themselves (T = 1)."""
        parts = self.raw_logprobs if raw and self.raw_logprobs else self.logprobs
        if not parts:
            return None
        step = torch.cat(parts)
        if self.context_parallel:   # label-aligned CP shares -> whole token-aligned rows
            step = torch.nn.functional.pad(context_parallel_gather(step), (1, 0))
        return step[:, :seq]


# ------------------------------------------------------------------------------------ trainer

class TrainStep(NamedTuple):
    """What one optimizer step returns."""

    metrics: dict[str, float]     # the same on every rank
    logprobs: torch.Tensor        # [B, S] response-token logprobs under the weights before it
    raw_logprobs: torch.Tensor    # the same of the logits at T = 1 (the engines report those)


class MegatronTrainer:
    """GRPO learner on one TP x PP replica (and its data-parallel peers)."""

    def __init__(self, model, arch: ModelSpec, config: TrainerConfig = TrainerConfig()):
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.module, self.arch, self.config = model, arch, config
        mconfig = model.config
        if mconfig.fp16:
            raise ValueError("MegatronTrainer trains float32 or bfloat16 models (fp16 would need "
                             "loss scaling); build the model with another params_dtype")
        # Token-mean over the global batch: see the module docstring. DDP reads it when built.
        mconfig.calculate_per_token_loss = True
        with megatron_cpu_mode():
            # The KL reference: the initial policy, copied before DDP takes over the parameters.
            self.reference = frozen_copy(model) if config.grpo.kl_coef > 0 else None
            wrapped = model
            if mconfig.bf16:   # bf16 weights, fp32 logits out and fp32 master weights in Adam
                from megatron.core.transformer.module import Float16Module

                wrapped = Float16Module(mconfig, model)
                if self.reference is not None:
                    self.reference = Float16Module(mconfig, self.reference)
            self.model = DistributedDataParallel(
                config=mconfig, module=wrapped,
                ddp_config=DistributedDataParallelConfig(
                    grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                    use_distributed_optimizer=config.use_distributed_optimizer,
                    average_in_collective=False))
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam", lr=config.lr, min_lr=config.min_lr,
                    weight_decay=config.weight_decay, adam_beta1=config.adam_beta1,
                    adam_beta2=config.adam_beta2, adam_eps=config.adam_eps,
                    clip_grad=config.clip_grad, bf16=mconfig.bf16,
                    params_dtype=torch.bfloat16 if mconfig.bf16 else torch.float32,
                    use_distributed_optimizer=config.use_distributed_optimizer),
                [self.model])
            self.scheduler = OptimizerParamScheduler(
                self.optimizer, init_lr=0.0 if config.lr_warmup_steps else config.lr,
                max_lr=config.lr, min_lr=config.min_lr, lr_warmup_steps=config.lr_warmup_steps,
                lr_decay_steps=max(config.lr_decay_steps, config.lr_warmup_steps + 1),
                lr_decay_style=config.lr_decay_style, start_wd=config.weight_decay,
                end_wd=config.weight_decay, wd_incr_steps=1, wd_incr_style="constant")
        mconfig.no_sync_func = self.model.no_sync
        mconfig.finalize_model_grads_func = finalize_model_grads
        mconfig.grad_scale_func = self.optimizer.scale_loss
        self.device = next(model.parameters()).device
        self.steps = 0
        self._offloaded: list = []   # (optimizer state dict, key) moved to the host
        self._grads_offloaded = False

    # ---------------------------------------------------------------------------- logprobs

    def logprobs(self, tokens: torch.Tensor, response_mask: torch.Tensor | None = None,
                 micro_batch_size: int | None = None, raw: bool = False) -> torch.Tensor:
        """Token-aligned logprobs [B, S] of ``tokens`` under the current weights (the sampling
        distribution at ``temperature``; with ``raw``, the logits' own at T = 1), on every rank
        of the replica, on the CPU (zero outside ``response_mask`` when given)."""
        return self._logprobs(self.model, tokens, response_mask, micro_batch_size,
                              1.0 if raw else self.config.temperature)

    def reference_logprobs(self, tokens: torch.Tensor,
                           response_mask: torch.Tensor | None = None) -> torch.Tensor:
        """As ``logprobs``, under the frozen reference policy (only with ``grpo.kl_coef > 0``)."""
        if self.reference is None:
            raise ValueError("no reference policy: the trainer keeps one only with kl_coef > 0")
        return self._logprobs(self.reference, tokens, response_mask, None,
                              self.config.temperature)

    def _logprobs(self, model, tokens, response_mask, micro_batch_size,
                  temperature: float) -> torch.Tensor:
        mbs = micro_batch_size or self.config.micro_batch_size
        if len(tokens) % mbs:
            mbs = len(tokens)
        result = forward_logprobs(model, tokens, self.arch.vocab_size, mbs, self.device,
                                  temperature)
        return result if response_mask is None else result * response_mask.cpu()

    # ---------------------------------------------------------------------------- training

    def train_step(self, batch: GRPOBatch) -> TrainStep:
        """One optimizer step on this DP rank's ``batch`` -> the metrics (the same on every rank)
        and the batch's response-token logprobs [B, S] under the weights *before* the step
        (computed by the step's own forward, on every rank of the replica).

        The metrics carry fingerprints (``train.fingerprint``, collective over the world) of what
        the learner read, ``exact/batch_hash``, and of the weights and optimizer state after the
        step, ``exact/state_hash``: two runs are bitwise the same learner while they agree."""
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        start = time.perf_counter()
        mbs = self.config.micro_batch_size
        size, seq = batch.tokens.shape
        if size % mbs:
            raise ValueError(f"this rank's batch of {size} sequences is not a multiple of "
                             f"micro_batch_size={mbs}")
        if self.config.grpo.kl_coef > 0 and batch.ref_logprobs is None:
            batch = replace(batch, ref_logprobs=self.reference_logprobs(batch.tokens,
                                                                        batch.response_mask))
        batch_hash = world_fingerprint(
            fingerprint(batch.fingerprint_tensors(self.config.grpo.tis_cap > 0)), self.device)
        # what the learner does not read (without tis_cap): where on and off runs may differ
        engine_hash = world_fingerprint(fingerprint([batch.engine_logprobs]), self.device)
        batch = batch.to(self.device)
        # one length over the TP x EP group (MoE token gather); the padding is outside the mask
        width = expert_parallel_max(seq)
        if width > seq:
            batch = batch.padded_to(width)
        cp = context_parallel_size() > 1
        if cp:   # whole 2 x CP chunks
            batch = batch.padded_to(context_parallel_length(
                batch.tokens.shape[1], model_config(self.module).sequence_parallel))
        loss_step = GRPOLossStep(self.config.grpo, self.arch.vocab_size, cp,
                                 self.config.temperature)
        lr = float(self.optimizer.param_groups[0]["lr"])
        with megatron_cpu_mode():
            self.model.train()
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            sums = get_forward_backward_func()(
                forward_step_func=loss_step,
                data_iterator=iter([batch.rows(slice(i, i + mbs)) for i in range(0, size, mbs)]),
                model=[self.model], num_microbatches=size // mbs,
                seq_length=batch.tokens.shape[1], micro_batch_size=mbs, forward_only=False)
            updated, grad_norm, _ = self.optimizer.step()
            if updated:
                self.scheduler.step(increment=1)
                self.steps += 1
        metrics = self._global_metrics(loss_step.names,
                                       sums if ps.is_pipeline_last_stage() else None)
        mask = batch.response_mask[:, :seq].cpu()
        gathered = lambda raw: broadcast_from_last_stage(  # noqa: E731
            loss_step.token_logprobs(seq, raw=raw), (size, seq), self.device).cpu() * mask
        logprobs = gathered(False)
        raw = gathered(True) if self.config.temperature != 1.0 else logprobs
        metrics.update({
            "train/grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
            "train/lr": lr,
            "train/update_skipped": float(not updated),
            "train/step_s": time.perf_counter() - start,
            "exact/batch_hash": batch_hash,
            "exact/engine_logprobs_hash": engine_hash,
            "exact/state_hash": world_fingerprint(fingerprint(self._state_tensors()),
                                                  self.device),
        })
        return TrainStep(metrics, logprobs, raw)

    def _state_tensors(self):
        """This rank's training state in a fixed order: its parameters, then each optimizer
        parameter that is not one of them (bf16 training's float32 main weights) and its state
        (Adam's moments and step)."""
        params = [p for _, p in self.module.named_parameters()]
        yield from params
        own = {id(p) for p in params}
        for optimizer in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            for group in optimizer.optimizer.param_groups:
                for param in group["params"]:
                    if id(param) not in own:
                        yield param
                    state = optimizer.optimizer.state.get(param, {})
                    for name in sorted(state):
                        value = state[name]
                        yield value if torch.is_tensor(value) else torch.tensor(float(value))

    def _global_metrics(self, names: list[str],
                        sums: list[torch.Tensor] | None) -> dict[str, float]:
        """Per-micro-batch metric sums (last stage) -> global token means on every rank."""
        from megatron.core import parallel_state as ps

        carrier = [names]
        if ps.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast_object_list(carrier, src=ps.get_pipeline_model_parallel_last_rank(),
                                       group=ps.get_pipeline_model_parallel_group())
        names = carrier[0]
        total = None
        if sums is not None:
            total = torch.stack(sums).sum(0)
            if ps.get_data_parallel_world_size(with_context_parallel=True) > 1:
                dist.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
        total = broadcast_from_last_stage(total, (len(names),), self.device)
        values = dict(zip(names, total.tolist()))
        count = values["train/num_tokens"]
        return {name: value if name == "train/num_tokens" else value / max(count, 1.0)
                for name, value in values.items()}

    # ---------------------------------------------------------------------------- GPU memory

    def offload_training_state(self) -> None:
        """Optimizer state and gradient buffers -> host memory, freeing the GPU for the rollout
        engines (``train.offload_during_rollout``; CUDA only). The weights stay: the verifier and
        the resharder read them. ``restore_training_state`` undoes it before the next step."""
        if self._grads_offloaded or self.device.type != "cuda":
            return
        for state in self._optimizer_states():
            for name, value in state.items():
                if torch.is_tensor(value) and value.is_cuda:
                    state[name] = value.to("cpu")
                    self._offloaded.append((state, name))
        self.model.offload_grad_buffers()
        self._grads_offloaded = True

    def restore_training_state(self) -> None:
        if not self._grads_offloaded:
            return
        self.model.restore_grad_buffers()
        for state, name in self._offloaded:
            state[name] = state[name].to(self.device, non_blocking=True)
        torch.cuda.synchronize()
        self._offloaded, self._grads_offloaded = [], False

    def _optimizer_states(self):
        for optimizer in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            yield from optimizer.optimizer.state.values()

    def resharder(self, **kwargs):
        """A ``Resharder`` over the trained shard (full HF tensors on every rank of the replica)."""
        from megatron_bubblespec.train.reshard import Resharder

        return Resharder(self.module, self.arch, **kwargs)


__all__ = ["GRPOLossStep", "MegatronTrainer", "TrainStep", "TrainerConfig", "frozen_copy"]
