"""Free drafting slots + this engine step's claimed prefill -> claim another chunk from the shared
cursor or not: the one claim and pacing rule of the bubble drafter and of its simulation.

A drafting engine keeps up to ``in_flight`` samples at once (its full decode batch: an engine step
costs nearly the same for one row as for many, so drafted tokens per bubble-second grow with the
batch) and claims the next ``chunk`` samples from the shared cursor whenever a slot is free.

The engine step that prefills the claimed requests (prompt + earlier draft) is the longest there
is, and the barrier waits for the step in flight when it closes: a large prefill can run past the
barrier by more than a whole short bubble. ``prefill_budget`` (``spec.draft_prefill_tokens``)
paces the claims instead: each engine step takes new requests only until their estimated prefill
reaches the budget (at least one chunk when there is room), and the next engine step claims again
while slots are free, so the batch fills over a few short steps while the first drafts already
decode. Pacing changes which tokens the drafts hold when the barrier closes, never a rollout token
(drafts are proposals).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class ClaimPolicy:
    chunk: int                 # samples per claim from the shared cursor (spec.draft_chunk)
    in_flight: int             # drafts an engine keeps at once
    prefill_budget: int = 0    # estimated prefill tokens claimed per engine step; 0: no bound

    @property
    def budget(self) -> float:
        return self.prefill_budget if self.prefill_budget > 0 else math.inf

    def has_room(self, in_flight: int) -> bool:
        """Whether a drafting slot is free (then the next engine step claims again)."""
        return in_flight < self.in_flight

    def claim(self, in_flight: int, next_chunk: Callable[[], Optional[Sequence[T]]],
              prefill: Callable[[Sequence[T]], float]) -> list[Sequence[T]]:
        """The chunks one engine step claims, in order: ``next_chunk()`` takes the cursor's next
        chunk (None: nothing is left), ``prefill(chunk)`` estimates the tokens its requests
        prefill on this engine. Claims while a slot is free and the step's estimated prefill is
        below the budget."""
        claimed: list[Sequence[T]] = []
        tokens = 0.0
        while self.has_room(in_flight) and tokens < self.budget:
            chunk = next_chunk()
            if chunk is None:
                break
            claimed.append(chunk)
            in_flight += len(chunk)
            tokens += prefill(chunk)
        return claimed
