"""GRPO objective: rewards -> group advantages; token logprobs (new, old, ref) -> clipped loss + metrics.

Pure torch. Per-token tensors are padded ``[B, T]`` with a ``mask`` that is 1 on response tokens
and 0 elsewhere (prompt, padding); sequence-level tensors (rewards, advantages) are ``[B]``.

* Advantages: per group of the ``n`` samples of one prompt, ``(r - mean) / (std + eps)``, or
  ``r - mean`` without the division (Dr. GRPO, ``scale_by_std=False``). Groups are consecutive
  rows. The standard deviation is the unbiased one (``torch.std``).
* Policy loss per token: ``-min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)`` with
  ``ratio = exp(logp - old_logp)``; eps_high > eps_low gives DAPO's "clip higher".
* Truncated importance sampling (optional, ``tis_cap > 0``; off by default): each token's policy
  loss is weighted by ``min(exp(old_logp - engine_logp), tis_cap)``, the trainer's over the rollout
  engine's probability of the token, as the field corrects for the two engines' numerics (Yao et
  al., "Your efficient RL framework secretly brings you off-policy RL training", 2025). It is the
  one place the learner reads the engine's logprobs, so with it on, a token's verify-row and
  decode-row rounding reach the weights and runs with BubbleSpec on and off may part.
* KL penalty (optional): ``kl_coef * k3`` with the k3 estimator
  ``exp(ref - logp) - (ref - logp) - 1`` (>= 0, zero where the policies agree).
* Reduction: token-level mean over all response tokens of the *global* batch. ``num_tokens`` is
  the normaliser: a caller that sees one piece of the global batch (a micro-batch on one
  data-parallel rank) passes the global count, and the pieces' losses and metrics add up to the
  global means; ``num_tokens=1`` gives plain sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GRPOConfig:
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 0.0                 # 0 = no KL penalty (no reference policy needed)
    adv_eps: float = 1e-6
    tis_cap: float = 0.0                 # truncated importance sampling's cap; 0 = off

    def __post_init__(self):
        if not (0.0 <= self.clip_eps_low < 1.0 and self.clip_eps_high >= 0.0):
            raise ValueError("clip range must satisfy 0 <= clip_eps_low < 1 and clip_eps_high >= 0,"
                             f" got low={self.clip_eps_low}, high={self.clip_eps_high}")
        if self.kl_coef < 0.0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.tis_cap < 0.0:
            raise ValueError(f"tis_cap must be >= 0 (0 = off), got {self.tis_cap}")


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale_by_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """Rewards [B] of consecutive groups of ``group_size`` samples -> advantages [B] (float32)."""
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of "
                         f"{group_size}: pass a flat [B] tensor, B a multiple of the group size")
    groups = rewards.view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale_by_std and group_size > 1:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum()


def token_mean(values: torch.Tensor, mask: torch.Tensor,
               num_tokens: float | torch.Tensor | None = None) -> torch.Tensor:
    """sum(values over masked tokens) / num_tokens (default: the number of masked tokens)."""
    if num_tokens is None:
        num_tokens = mask.sum().clamp(min=1)
    return masked_sum(values, mask) / num_tokens


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference) from the sampled tokens' logprobs."""
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1.0


def clipped_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                        clip_eps_low: float,
                        clip_eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO/GRPO surrogate loss [B, T] and a 0/1 tensor of tokens whose clipped side won.

    ``advantages`` is [B] (one per sequence) or [B, T]. A token whose ratio lies outside the clip
    range on the side its advantage pushes towards contributes no gradient.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    return loss, (clipped < unclipped).to(logp.dtype)


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, config: GRPOConfig, *, ref_logp: torch.Tensor | None = None,
              entropy: torch.Tensor | None = None,
              engine_logp: torch.Tensor | None = None,
              num_tokens: float | torch.Tensor | None = None,
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO loss (differentiable in ``logp``) and its metrics, all token means over ``mask``.

    ``entropy`` (per token, optional) is reported only; ``engine_logp`` (the rollout engine's) is
    read only with ``tis_cap > 0``. Metrics are detached scalar tensors: ``train/loss``,
    ``train/pg_loss``, ``train/kl`` (when ``kl_coef > 0``), ``train/clip_frac``,
    ``train/ratio_mean``, ``train/entropy`` (when given), ``train/tis_weight_mean`` (with
    ``tis_cap``). ``train/num_tokens`` is the masked count.
    """
    mask = mask.to(logp.dtype)
    pg, clipped = clipped_policy_loss(logp, old_logp, advantages.to(logp.dtype),
                                      config.clip_eps_low, config.clip_eps_high)
    metrics = {}
    if config.tis_cap > 0.0:
        if engine_logp is None:
            raise ValueError("tis_cap > 0 needs engine_logp (the rollout engine's logprobs)")
        weight = torch.exp(old_logp - engine_logp).clamp(max=config.tis_cap).detach()
        pg = pg * weight
        metrics["train/tis_weight_mean"] = token_mean(weight, mask, num_tokens)
    per_token = pg
    if config.kl_coef > 0.0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp (the reference policy's token logprobs)")
        kl = kl_k3(logp, ref_logp)
        per_token = per_token + config.kl_coef * kl
        metrics["train/kl"] = token_mean(kl.detach(), mask, num_tokens)
    loss = token_mean(per_token, mask, num_tokens)
    with torch.no_grad():
        metrics.update({
            "train/loss": loss.detach(),
            "train/pg_loss": token_mean(pg, mask, num_tokens),
            "train/clip_frac": token_mean(clipped, mask, num_tokens),
            "train/ratio_mean": token_mean(torch.exp(logp - old_logp), mask, num_tokens),
            "train/num_tokens": mask.sum(),
        })
        if entropy is not None:
            metrics["train/entropy"] = token_mean(entropy, mask, num_tokens)
    return loss, metrics
