"""Training: Megatron model, GRPO loss, trainer, weight resharding into the rollout engines."""
