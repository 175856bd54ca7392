"""GRPO batch (one DP rank's) -> micro-batches -> Megatron pipeline fwd/bwd -> DP grad sum -> Adam step.

``MegatronTrainer`` wraps a GPTModel (this rank's TP/PP shard) in megatron-core's
``DistributedDataParallel`` and steps it with megatron's optimizer (Adam, optional distributed
optimizer) and its learning-rate / weight-decay scheduler (the scheduler is what applies the
optimizer's per-group settings, e.g. no weight decay on biases and norms). It owns the model's
TransformerConfig hooks (``calculate_per_token_loss``, ``no_sync_func``,
``finalize_model_grads_func``, ``grad_scale_func``). Megatron calls run inside
``megatron_cpu_mode()``, so the same code trains over gloo on CPU.

Sequences are prompt + response, right-padded to one length ``S``; per-token tensors are ``[B, S]``
and aligned with the tokens: ``logprobs[b, j] = log p(tokens[b, j] | tokens[b, :j])`` (0 at j = 0),
``response_mask[b, j] = 1`` where token j is a response token.

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

Log-probabilities are computed vocab-parallel (megatron's ``vocab_parallel_cross_entropy``; the
full vocabulary is never gathered), with Megatron's vocabulary padding masked out, on the last
pipeline stage, and broadcast to every stage of the replica.
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
from megatron_bubblespec.models.architecture import ModelSpec
from megatron_bubblespec.tokens import pad_token_rows
from megatron_bubblespec.train.forward import (context_parallel_gather, context_parallel_length,
                                               context_parallel_split, megatron_forward,
                                               model_config)
from megatron_bubblespec.train.grpo import GRPOConfig, grpo_loss
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
    use_distributed_optimizer: bool = False
    grpo: GRPOConfig = field(default_factory=GRPOConfig)


# ------------------------------------------------------------------------------------- batches

@dataclass
class GRPOBatch:
    """One data-parallel rank's training sequences; per-token tensors [B, S], advantages [B]."""

    tokens: torch.Tensor                  # int64, prompt + response, right-padded
    response_mask: torch.Tensor           # 1 on response tokens
    old_logprobs: torch.Tensor            # behaviour policy (the rollout engine), token-aligned
    advantages: torch.Tensor
    ref_logprobs: torch.Tensor | None = None   # reference policy (KL); None: the trainer's own

    def __post_init__(self):
        shape = tuple(self.tokens.shape)
        for name in ("response_mask", "old_logprobs", "ref_logprobs"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != shape:
                raise ValueError(f"GRPOBatch.{name} has shape {tuple(value.shape)}, tokens have "
                                 f"{shape}: every per-token tensor must be token-aligned [B, S]")
        if tuple(self.advantages.shape) != shape[:1]:
            raise ValueError(f"GRPOBatch.advantages has shape {tuple(self.advantages.shape)}, "
                             f"expected one per sequence: ({shape[0]},)")
        if self.response_mask[:, 0].any():
            raise ValueError("response_mask is set at position 0: every sequence needs a prompt "
                             "token before its first response token")

    @classmethod
    def from_responses(cls, prompts: list[list[int]], responses: list[list[int]],
                       old_logprobs: list[list[float]], advantages, *,
                       ref_logprobs: list[list[float]] | None = None,
                       pad_id: int = 0) -> "GRPOBatch":
        """Token lists and per-response logprob lists (as rollout results carry them) -> a batch."""
        tokens, mask = pack_sequences(prompts, responses, pad_id)
        return cls(tokens, mask, scatter_responses(old_logprobs, mask),
                   torch.as_tensor(advantages, dtype=torch.float32),
                   None if ref_logprobs is None else scatter_responses(ref_logprobs, mask))

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def to(self, device) -> "GRPOBatch":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return GRPOBatch(self.tokens.to(device), self.response_mask.to(device),
                         self.old_logprobs.to(device), self.advantages.to(device),
                         move(self.ref_logprobs))

    def rows(self, index: slice) -> "GRPOBatch":
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return GRPOBatch(self.tokens[index], self.response_mask[index], self.old_logprobs[index],
                         self.advantages[index], pick(self.ref_logprobs))

    def padded_to(self, width: int) -> "GRPOBatch":
        """Right-padded to ``width`` tokens (pad id 0; padding is outside the response mask)."""
        pad = lambda t: None if t is None else torch.nn.functional.pad(  # noqa: E731
            t, (0, width - t.shape[1]))
        return GRPOBatch(pad(self.tokens), pad(self.response_mask), pad(self.old_logprobs),
                         self.advantages, pad(self.ref_logprobs))

    def dp_shard(self, rank: int, size: int) -> "GRPOBatch":
        """Data-parallel rank ``rank``'s contiguous share of a global batch (groups stay whole
        when the group size divides the share)."""
        if len(self) % size:
            raise ValueError(f"global batch of {len(self)} sequences does not split over "
                             f"{size} data-parallel ranks")
        share = len(self) // size
        return self.rows(slice(rank * share, (rank + 1) * share))


def pack_sequences(prompts: list[list[int]], responses: list[list[int]],
                   pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt and response token lists -> right-padded tokens [B, S] and the response mask."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"sequence {i} has an empty prompt")
    tokens, lengths = pad_token_rows([list(p) + list(r) for p, r in zip(prompts, responses)],
                                     pad_id)
    position = torch.arange(tokens.shape[1])
    starts = torch.tensor([len(p) for p in prompts]).view(-1, 1)
    mask = ((position >= starts) & (position < lengths.view(-1, 1))).to(torch.float32)
    return tokens, mask


def scatter_responses(values: list[list[float]], mask: torch.Tensor) -> torch.Tensor:
    """Per-response lists (e.g. the engine's logprobs) -> a token-aligned [B, S] tensor."""
    out = torch.zeros(mask.shape, dtype=torch.float32)
    for i, row in enumerate(values):
        positions = mask[i].nonzero().flatten()
        if len(row) != len(positions):
            raise ValueError(f"row {i}: {len(row)} values for {len(positions)} response tokens")
        out[i, positions] = torch.tensor(row, dtype=torch.float32)
    return out


def gather_responses(values: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    """Inverse of ``scatter_responses``: a [B, S] tensor -> per-response lists."""
    return [values[i][mask[i].bool()].tolist() for i in range(values.shape[0])]


# ---------------------------------------------------------------------- vocab-parallel maths

def _vocab_shard_padding(logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """Bool [V/TP] marking this TP rank's padded vocabulary ids (None when it has none)."""
    from megatron.core import parallel_state as ps

    shard = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * shard
    if start + shard <= vocab_size:
        return None
    return torch.arange(start, start + shard, device=logits.device) >= vocab_size


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, vocab_size: int,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Vocab-parallel logits [b, S, V/TP] -> token-aligned logprobs [b, S] (and entropies).

    Position j holds log p(tokens[j] | tokens[:j]) from the logits at j - 1 (0 at j = 0); the
    entropy at j is that of the same distribution (metric only, no gradient). Ids >= vocab_size
    (Megatron's padding) get probability 0.
    """
    logp, entropy = label_logprobs(logits[:, :-1], tokens[:, 1:], vocab_size, with_entropy)
    return (torch.nn.functional.pad(logp, (1, 0)),
            None if entropy is None else torch.nn.functional.pad(entropy, (1, 0)))


def label_logprobs(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Vocab-parallel logits [b, s, V/TP] -> log p(labels[:, j]) from the logits at j [b, s] (and
    the entropies at j): ``token_logprobs`` without the shift, for sequences split over CP."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    padding = _vocab_shard_padding(logits, vocab_size)
    logits = logits.masked_fill(padding, float("-inf")) if padding is not None else logits
    logits = logits.contiguous()
    entropy = None
    if with_entropy:
        with torch.no_grad():
            group = ps.get_tensor_model_parallel_group()
            shifted = logits.float()
            peak = shifted.max(dim=-1, keepdim=True).values
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
            shifted = shifted - peak
            weights = torch.exp(shifted)
            sums = torch.stack([weights.sum(-1),
                                torch.where(weights > 0, weights * shifted, 0.0).sum(-1)])
            dist.all_reduce(sums, group=group)
            entropy = torch.log(sums[0]) - sums[1] / sums[0]
    # vocab_parallel_cross_entropy overwrites its input: ``logits`` is a copy made above, or (one
    # sequence, no padding) the model output (or a view of it) that nothing reads afterwards.
    return -vocab_parallel_cross_entropy(logits, labels), entropy


def _broadcast_from_last_stage(tensor: torch.Tensor | None, shape, device) -> torch.Tensor:
    """The last pipeline stage's float32 ``tensor`` on every stage of this pipeline."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return tensor
    if tensor is None:
        tensor = torch.empty(shape, dtype=torch.float32, device=device)
    tensor = tensor.contiguous()
    dist.broadcast(tensor, src=ps.get_pipeline_model_parallel_last_rank(),
                   group=ps.get_pipeline_model_parallel_group())
    return tensor


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
    the logprobs under the weights before the update."""

    def __init__(self, grpo: GRPOConfig, vocab_size: int, context_parallel: bool):
        self.grpo, self.vocab_size, self.context_parallel = grpo, vocab_size, context_parallel
        self.names: list[str] = []                # metric names, in the order of the sums
        self.logprobs: list[torch.Tensor] = []    # per micro-batch (last stage), in order

    def __call__(self, data_iterator, model):
        mb: GRPOBatch = next(data_iterator)
        tokens, labels = mb.tokens, None
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        per_token = [mb.old_logprobs, mb.response_mask, mb.ref_logprobs]
        if self.context_parallel:
            # This CP rank's share; a token's values move to the position predicting it.
            shift = lambda t: torch.nn.functional.pad(t[:, 1:], (0, 1))  # noqa: E731
            labels = shift(tokens)
            present = [shift(t) for t in per_token if t is not None]
            tokens, positions, labels, *present = context_parallel_split(
                tokens, positions, labels, *present)
            per_token = present + [None] * (3 - len(present))
        return model(tokens, positions, None), partial(self.loss, tokens, labels, *per_token,
                                                       mb.advantages)

    def loss(self, tokens, labels, old_logprobs, response_mask, ref_logprobs, advantages,
             logits):
        """The micro-batch's loss from its logits (``labels``: the label-aligned targets under
        context parallelism, else None: the tokens themselves, token-aligned)."""
        if labels is not None:
            logp, entropy = label_logprobs(logits, labels, self.vocab_size, with_entropy=True)
        else:
            logp, entropy = token_logprobs(logits, tokens, self.vocab_size, with_entropy=True)
        self.logprobs.append(logp.detach().float())
        loss_sum, sums = grpo_loss(logp, old_logprobs, advantages, response_mask, self.grpo,
                                   ref_logp=ref_logprobs, entropy=entropy, num_tokens=1.0)
        self.names[:] = sorted(sums)
        count = response_mask.sum().to(torch.int)
        return loss_sum, count, torch.stack([sums[k].float() for k in self.names])

    def token_logprobs(self, seq: int) -> torch.Tensor | None:
        """The step's logprobs as token-aligned [B, seq] rows (last stage; None elsewhere)."""
        if not self.logprobs:
            return None
        step = torch.cat(self.logprobs)
        if self.context_parallel:   # label-aligned CP shares -> whole token-aligned rows
            step = torch.nn.functional.pad(context_parallel_gather(step), (1, 0))
        return step[:, :seq]


# ------------------------------------------------------------------------------------ trainer

class TrainStep(NamedTuple):
    """What one optimizer step returns."""

    metrics: dict[str, float]     # the same on every rank
    logprobs: torch.Tensor        # [B, S] response-token logprobs under the weights before it


class MegatronTrainer:
    """GRPO learner on one TP x PP replica (and its data-parallel peers)."""

    def __init__(self, model, spec: ModelSpec, config: TrainerConfig = TrainerConfig()):
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.module, self.spec, self.config = model, spec, config
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
                 micro_batch_size: int | None = None) -> torch.Tensor:
        """Token-aligned logprobs [B, S] of ``tokens`` under the current weights, on every rank of
        the replica, on the CPU (zero outside ``response_mask`` when given)."""
        return self._logprobs(self.model, tokens, response_mask, micro_batch_size)

    def reference_logprobs(self, tokens: torch.Tensor,
                           response_mask: torch.Tensor | None = None) -> torch.Tensor:
        """As ``logprobs``, under the frozen reference policy (only with ``grpo.kl_coef > 0``)."""
        if self.reference is None:
            raise ValueError("no reference policy: the trainer keeps one only with kl_coef > 0")
        return self._logprobs(self.reference, tokens, response_mask, None)

    def _logprobs(self, model, tokens, response_mask, micro_batch_size) -> torch.Tensor:
        vocab = self.spec.vocab_size
        mbs = micro_batch_size or self.config.micro_batch_size
        if len(tokens) % mbs:
            mbs = len(tokens)

        on_device = tokens.to(self.device)

        def on_logits(logits, rows):
            return token_logprobs(logits, on_device[rows], vocab)[0]

        parts = megatron_forward(model, tokens, on_logits, micro_batch_size=mbs)
        result = _broadcast_from_last_stage(None if parts is None else torch.cat(parts).float(),
                                            tuple(tokens.shape), self.device).cpu()
        return result if response_mask is None else result * response_mask.cpu()

    # ---------------------------------------------------------------------------- training

    def train_step(self, batch: GRPOBatch) -> TrainStep:
        """One optimizer step on this DP rank's ``batch`` -> the metrics (the same on every rank)
        and the batch's response-token logprobs [B, S] under the weights *before* the step
        (computed by the step's own forward, on every rank of the replica)."""
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
        batch = batch.to(self.device)
        cp = context_parallel_size() > 1
        if cp:   # whole 2 x CP chunks; the padding is outside the response mask
            batch = batch.padded_to(context_parallel_length(
                seq, model_config(self.module).sequence_parallel))
        loss_step = GRPOLossStep(self.config.grpo, self.spec.vocab_size, cp)
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
        logprobs = _broadcast_from_last_stage(loss_step.token_logprobs(seq), (size, seq),
                                              self.device).cpu()
        metrics.update({
            "train/grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
            "train/lr": lr,
            "train/update_skipped": float(not updated),
            "train/step_s": time.perf_counter() - start,
        })
        return TrainStep(metrics, logprobs * batch.response_mask[:, :seq].cpu())

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
        total = _broadcast_from_last_stage(total, (len(names),), self.device)
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

        return Resharder(self.module, self.spec, **kwargs)


__all__ = ["GRPOBatch", "GRPOLossStep", "MegatronTrainer", "TrainStep", "TrainerConfig", "frozen_copy", "gather_responses",
           "pack_sequences", "scatter_responses", "token_logprobs"]
