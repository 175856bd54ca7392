"""Trainer state <-> a Megatron distributed checkpoint directory (model + optimizer + LR schedule).

Every rank of the job calls ``save_trainer`` / ``load_trainer`` with the same directory; each
writes and reads only its own shards (``megatron.core.dist_checkpointing``, the ``torch_dist``
format), so a checkpoint saved under one TP x PP x DP layout loads under another. The optimizer's
state is sharded against the model's sharded state dict (the distributed optimizer in its
fully-resharding form), the scheduler and the step counter travel as common state.
"""

from __future__ import annotations

from pathlib import Path

from megatron_bubblespec.distributed import megatron_cpu_mode

# The distributed optimizer saves a layout-independent form, so any DP size can load it.
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _torch_optimizers(optimizer):
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        yield inner.optimizer


def _adam_states(optimizer):
    for torch_optimizer in _torch_optimizers(optimizer):
        for group in torch_optimizer.param_groups:
            for p in group["params"]:
                yield p, torch_optimizer.state[p]


def _sharded_state_dict(trainer, is_loading: bool) -> dict:
    """The trainer's sharded state dict; for loading, over a freshly initialised Adam state.

    Without Apex/Transformer Engine, megatron-core's state initialisation makes exp_avg and
    exp_avg_sq but no ``step``, while the distributed optimizer's ``state_dict`` needs one and its
    parameter loader must not see one (the step travels as common state): a temporary step
    covers the first and is removed before the second."""
    import torch

    if is_loading:
        for p, state in _adam_states(trainer.optimizer):
            if not state:
                state["exp_avg"] = torch.zeros_like(p.data)
                state["exp_avg_sq"] = torch.zeros_like(p.data)
            state.setdefault("step", torch.tensor(0.0))
    model_sd = trainer.module.sharded_state_dict()
    sharded = {
        "model": model_sd,
        "optimizer": trainer.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                          metadata=_OPTIMIZER_METADATA),
        "scheduler": trainer.scheduler.state_dict(),
        "trainer_steps": trainer.steps,
    }
    if is_loading:
        for _, state in _adam_states(trainer.optimizer):
            state.pop("step", None)
    return sharded


def check_checkpointable(trainer) -> None:
    """Raise before training if this trainer's state cannot round-trip through a checkpoint.

    Measured with megatron-core 0.16.1: the distributed optimizer's checkpoint loader fails with
    PyTorch's own Adam (no Apex or Transformer Engine, as on CPU) in every sharding form
    (fully_reshardable: KeyError 'step'; dp_reshardable: in-place on a leaf view;
    fully_sharded_model_space: flattened_range unsupported)."""
    from megatron.core.optimizer import distrib_optimizer

    if trainer.config.use_distributed_optimizer and not distrib_optimizer.HAVE_APEX_OR_TE:
        raise RuntimeError("checkpointing train.use_distributed_optimizer=true needs Apex or "
                           "Transformer Engine's Adam (megatron-core cannot reload PyTorch Adam's "
                           "sharded state); install transformer-engine or set "
                           "train.use_distributed_optimizer=false")


def save_trainer(trainer, directory: str | Path) -> None:
    """Write this rank's shards of the trainer's state into ``directory`` (collective; the
    directory must exist and be empty)."""
    from megatron.core import dist_checkpointing

    with megatron_cpu_mode():
        dist_checkpointing.save(_sharded_state_dict(trainer, is_loading=False), str(directory))


def load_trainer(trainer, directory: str | Path) -> None:
    """Restore model weights, optimizer state, LR schedule and step counter from ``directory``
    (collective)."""
    from megatron.core import dist_checkpointing

    with megatron_cpu_mode():
        state = dist_checkpointing.load(_sharded_state_dict(trainer, is_loading=True),
                                        str(directory))
        trainer.module.load_state_dict(state["model"], strict=False)
        trainer.optimizer.load_state_dict(state["optimizer"])
        trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.steps = int(state["trainer_steps"])
