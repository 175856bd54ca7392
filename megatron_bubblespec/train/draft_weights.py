"""The learner's weights before its last two steps -> drafting weights extrapolated from them ->
how far each is from the policy the step gave (a measurement, ``ablation.measure_draft_weights``).

A bubble at step t drafts with the weights W_t for rollouts that W_{t+1} verifies. Adam moves the
weights with momentum, so W_t + a (W_t - W_{t-1}) may land nearer W_{t+1} than W_t does. After step
t's update, on the step's own tokens (drawn from pi_t), ``measure`` computes for each a in
``ALPHAS`` the k3 estimate E[exp(d) - 1 - d], d = log pi_{t+1} - log pi_a, the estimator of
``policy/drift_kl`` (which is a = 0: KL(pi_t || pi_{t+1})). For a > 0 the tokens are not pi_a's,
so the number compares drafting weights on the same tokens rather than being their KL. Nothing
here changes the run: the weights are restored bit for bit before the step ends.
"""

from __future__ import annotations

import torch

# a -> the metric it is logged as
ALPHAS = {0.5: "policy/draft_kl_half_step", 1.0: "policy/draft_kl_full_step"}


def k3(after: torch.Tensor, before: torch.Tensor, mask: torch.Tensor) -> float:
    """E[exp(d) - 1 - d] over ``mask``, d = after - before (per-token logprobs)."""
    delta = after - before
    return float(((delta.exp() - 1 - delta) * mask).sum() / mask.sum().clamp_min(1))


class DraftWeightsProbe:
    """Holds W_{t-1} and W_t (copies of this rank's parameter shards) from one step to the next."""

    def __init__(self):
        self.previous: list[torch.Tensor] | None = None   # W_{t-1}
        self.current: list[torch.Tensor] | None = None    # W_t, taken before the step's update

    def before_step(self, trainer) -> None:
        self.current = [p.detach().clone() for p in trainer.module.parameters()]

    def measure(self, trainer, tokens: torch.Tensor, mask: torch.Tensor,
                after: torch.Tensor) -> dict[str, float]:
        """``after``: the step's tokens' logprobs under W_{t+1} (the trainer's weights now)."""
        previous, current = self.previous, self.current
        self.previous, self.current = current, None
        if previous is None:   # the first step: no W_{t-1}
            return {}
        params = list(trainer.module.parameters())
        updated = [p.detach().clone() for p in params]
        metrics = {}
        try:
            for alpha, name in ALPHAS.items():
                with torch.no_grad():
                    for p, w, w_before in zip(params, current, previous):
                        p.copy_(w + alpha * (w - w_before))
                metrics[name] = k3(after, trainer.logprobs(tokens, mask), mask)
        finally:
            with torch.no_grad():
                for p, w in zip(params, updated):
                    p.copy_(w)
        return metrics
