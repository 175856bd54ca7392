"""The engine's last two weight versions, as the reshard streams them -> drafting weights
W_t + (W_t - W_{t-1}) -> loaded into an idle engine for its bubble only (``spec.draft_weights``).

A bubble at step t drafts for rollouts that W_{t+1} verifies; weights extrapolated along the
learner's last step land nearer W_{t+1} than W_t does (docs/results/draft-weights.md). The engine
holds them under ``DRAFTING_VERSION``, which no rollout accepts (``loop.step``'s version check), and
the step's reshard replaces them with W_{t+1}: drafts stay proposals, whatever weights made them.
The copies live on the host: twice the model's HF tensors per engine leader.
"""

from __future__ import annotations

import time
from typing import Iterable, Iterator

import torch

# the weight version an engine holds while it drafts with extrapolated weights: no rollout's
DRAFTING_VERSION = -1


class ExtrapolatedWeights:
    """Keeps host copies of the last two weight versions streamed into one engine."""

    def __init__(self):
        self.previous: dict[str, torch.Tensor] | None = None   # W_{t-1}
        self.current: dict[str, torch.Tensor] | None = None    # W_t
        self.load_s = 0.0                                       # the last ``load``'s seconds

    def watch(self, named_tensors: Iterable[tuple[str, torch.Tensor]]
              ) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass the stream through unchanged, copying each tensor; a stream read to its end
        becomes W_t (and the one before it W_{t-1})."""
        copies = {}
        for name, tensor in named_tensors:
            copies[name] = tensor.detach().to("cpu", copy=True)
            yield name, tensor
        self.previous, self.current = self.current, copies

    @property
    def ready(self) -> bool:
        """Two whole versions of the same tensors (a first step has only one)."""
        if self.previous is None or self.current is None:
            return False
        return self.previous.keys() == self.current.keys() and all(
            self.previous[name].shape == tensor.shape for name, tensor in self.current.items())

    def drafting(self) -> Iterator[tuple[str, torch.Tensor]]:
        """W_t + (W_t - W_{t-1}), computed in float32 a tensor at a time, in each tensor's dtype."""
        for name, now in self.current.items():
            before = self.previous[name]
            yield name, (2 * now.float() - before.float()).to(now.dtype)

    def load(self, engine) -> bool:
        """Load the drafting weights into ``engine`` (idle: nothing running); False when not
        ``ready``."""
        if not self.ready:
            return False
        start = time.perf_counter()
        engine.update_weights(self.drafting(), DRAFTING_VERSION)
        self.load_s = time.perf_counter() - start
        return True
