"""Lookahead sampler: (seed, step) -> that step's prompt indices and their DP-rank blocks.

A pure function of (seed, step), so step t + 1's batch is known during step t (the bubble drafter
drafts it) and a resumed run sees the same batches as an uninterrupted one.

Schedule: the prompts are read epoch after epoch, each epoch a seeded permutation of all
``num_prompts`` indices (no repeats within an epoch), and step t takes the next
``prompts_per_step`` of that endless sequence, so a step can straddle two epochs. In such a step
the next epoch's order is adjusted so that its first prompts are none of the ones the previous
epoch contributes: a step never holds a prompt twice (two groups with one uid would share their
sample keys). The adjustment moves those prompts just behind the step, keeping the rest of the
seeded order.

The permutation of epoch e sorts the indices by a splitmix64 hash of (seed, e, index) (numpy
uint64 arithmetic), which, unlike a library RNG, cannot change between library versions.

Ranks: the step's prompts are cut into ``dp_size`` contiguous blocks, rank r taking positions
r * P .. (r + 1) * P - 1 (P = prompts_per_step / dp_size), each prompt with its whole group of
``samples_per_prompt`` samples. Global sample index g = position * samples_per_prompt + sample,
so the numbering runs rank by rank and a drafter can claim ranges of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_bubblespec.splitmix import chain


def epoch_permutation(seed: int, epoch: int, num_prompts: int) -> np.ndarray:
    """The seeded order of epoch ``epoch`` before any straddle adjustment (int64 indices)."""
    keys = chain(seed, epoch, np.arange(num_prompts, dtype=np.uint64))
    return np.argsort(keys, kind="stable")


@dataclass(frozen=True)
class SampleSlot:
    """Where one global sample index of a step lives."""

    rank: int
    position: int          # the prompt's position in the step (0 .. prompts_per_step - 1)
    prompt_index: int
    sample_index: int      # 0 .. samples_per_prompt - 1


@dataclass(frozen=True)
class StepBatch:
    """One step's prompts and their assignment to DP ranks."""

    step: int
    epoch: int                     # epoch of the step's first prompt
    prompt_indices: tuple[int, ...]
    dp_size: int
    samples_per_prompt: int

    @property
    def prompts_per_rank(self) -> int:
        return len(self.prompt_indices) // self.dp_size

    @property
    def num_samples(self) -> int:
        return len(self.prompt_indices) * self.samples_per_prompt

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.dp_size:
            raise ValueError(f"rank {rank} out of range 0..{self.dp_size - 1}")

    def rank_prompt_indices(self, rank: int) -> tuple[int, ...]:
        """The prompt indices of rank ``rank`` (a contiguous block of the step's prompts)."""
        self._check_rank(rank)
        per = self.prompts_per_rank
        return self.prompt_indices[rank * per:(rank + 1) * per]

    def rank_samples(self, rank: int) -> list[tuple[int, int]]:
        """(prompt index, sample index) of every sample of rank ``rank``, in global order."""
        return [(p, s) for p in self.rank_prompt_indices(rank)
                for s in range(self.samples_per_prompt)]

    def rank_sample_range(self, rank: int) -> range:
        """The global sample indices of rank ``rank``."""
        self._check_rank(rank)
        width = self.prompts_per_rank * self.samples_per_prompt
        return range(rank * width, (rank + 1) * width)

    def slot(self, global_index: int) -> SampleSlot:
        """The rank, prompt and sample of one global sample index."""
        if not 0 <= global_index < self.num_samples:
            raise ValueError(f"global sample index {global_index} out of range "
                             f"0..{self.num_samples - 1}")
        position, sample = divmod(global_index, self.samples_per_prompt)
        return SampleSlot(position // self.prompts_per_rank, position,
                          self.prompt_indices[position], sample)

    def global_index(self, position: int, sample_index: int) -> int:
        """The global sample index of sample ``sample_index`` of the prompt at ``position``."""
        if not 0 <= position < len(self.prompt_indices):
            raise ValueError(f"position {position} out of range 0..{len(self.prompt_indices) - 1}")
        if not 0 <= sample_index < self.samples_per_prompt:
            raise ValueError(f"sample index {sample_index} out of range "
                             f"0..{self.samples_per_prompt - 1}")
        return position * self.samples_per_prompt + sample_index


class LookaheadSampler:
    """Seeded, resumable prompt schedule; ``batch(step)`` for any step, ``advance`` / ``peek``
    for the running loop (after ``advance`` returned step t, ``peek`` is step t + 1)."""

    def __init__(self, seed: int, num_prompts: int, prompts_per_step: int, dp_size: int = 1,
                 samples_per_prompt: int = 1):
        for name, value in (("num_prompts", num_prompts), ("prompts_per_step", prompts_per_step),
                            ("dp_size", dp_size), ("samples_per_prompt", samples_per_prompt)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if prompts_per_step % dp_size:
            raise ValueError(f"prompts_per_step={prompts_per_step} is not divisible by "
                             f"dp_size={dp_size}: every DP rank must get the same number of "
                             f"prompts")
        if prompts_per_step > num_prompts:
            raise ValueError(f"prompts_per_step={prompts_per_step} exceeds num_prompts="
                             f"{num_prompts}: a step cannot hold a prompt twice")
        self.seed, self.num_prompts, self.prompts_per_step = seed, num_prompts, prompts_per_step
        self.dp_size, self.samples_per_prompt = dp_size, samples_per_prompt
        self.next_step = 0
        self._orders: dict[int, np.ndarray] = {}

    # ------------------------------------------------------------------ schedule
    def _order(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s order, adjusted so a straddling step holds no prompt twice.

        The adjustment of epoch e needs the final order of epoch e - 1. It only moves prompts
        within an epoch's first ``prompts_per_step`` positions, so with num_prompts >=
        2 * prompts_per_step the tail of epoch e - 1 is its seeded one; with fewer prompts the
        orders are built epoch by epoch from the nearest cached one (from epoch 0 on a resume).
        """
        if epoch in self._orders:
            return self._orders[epoch]
        known = max([e for e in self._orders if e < epoch], default=-1)
        if self.num_prompts >= 2 * self.prompts_per_step and 0 < epoch and known < epoch - 1:
            start, order = epoch - 1, epoch_permutation(self.seed, epoch - 1, self.num_prompts)
        else:
            start, order = known, self._orders.get(known)
        for e in range(start + 1, epoch + 1):
            order = self._adjust(e, epoch_permutation(self.seed, e, self.num_prompts), order)
        self._orders = {e: self._orders[e] for e in sorted(self._orders)[-3:]}
        self._orders[epoch] = order
        return order

    def _adjust(self, epoch: int, order: np.ndarray, previous: np.ndarray | None) -> np.ndarray:
        n, size = self.num_prompts, self.prompts_per_step
        carried = (epoch * n) % size     # prompts of the previous epoch in the straddling step
        if previous is None or carried == 0:
            return order
        taken = size - carried           # prompts of this epoch in that step
        tail = np.isin(order, previous[n - carried:])
        first = np.flatnonzero(~tail)[taken - 1] + 1      # end of the first `taken` fresh ones
        head = order[:first]
        return np.concatenate([head[~tail[:first]], head[tail[:first]], order[first:]])

    def batch(self, step: int) -> StepBatch:
        """Step ``step``'s prompts and their rank assignment (pure function of seed and step)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        n, size = self.num_prompts, self.prompts_per_step
        begin = step * size
        epoch, offset = divmod(begin, n)
        indices = self._order(epoch)[offset:offset + size]
        if len(indices) < size:
            indices = np.concatenate([indices, self._order(epoch + 1)[:size - len(indices)]])
        return StepBatch(step, epoch, tuple(int(i) for i in indices), self.dp_size,
                         self.samples_per_prompt)

    # ------------------------------------------------------------------ running loop
    def advance(self) -> StepBatch:
        """The batch of ``next_step``, which then moves on by one."""
        batch = self.batch(self.next_step)
        self.next_step += 1
        return batch

    def peek(self, ahead: int = 0) -> StepBatch:
        """The batch ``ahead`` steps after ``next_step`` (the lookahead), without moving."""
        return self.batch(self.next_step + ahead)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {"seed": self.seed, "next_step": self.next_step, "num_prompts": self.num_prompts,
                "prompts_per_step": self.prompts_per_step, "dp_size": self.dp_size,
                "samples_per_prompt": self.samples_per_prompt}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state["next_step"]``; the schedule settings must match this sampler's,
        else the resumed run would see other batches (ValueError naming the differences)."""
        fixed = ("num_prompts", "prompts_per_step", "dp_size", "samples_per_prompt")
        diff = [f"{k}: checkpoint {state[k]} vs now {getattr(self, k)}"
                for k in fixed if k in state and state[k] != getattr(self, k)]
        if diff:
            raise ValueError("the checkpoint's prompt schedule differs from this run's ("
                             + "; ".join(diff) + "); resume with the same settings")
        if state["next_step"] < 0:
            raise ValueError(f"next_step must be >= 0, got {state['next_step']}")
        if state["seed"] != self.seed:
            self.seed, self._orders = state["seed"], {}
        self.next_step = int(state["next_step"])
