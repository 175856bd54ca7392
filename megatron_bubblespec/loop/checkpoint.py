"""The run's state after step k -> ``<checkpoints>/step_<k>/`` written atomically; the latest
complete one -> a resumed replica that continues token-identically.

A checkpoint holds:

* ``megatron/``: the trainer's Megatron distributed checkpoint (model, optimizer, LR schedule);
* ``run_state.json``: completed steps, weight version, the prompt sampler's position, the seed,
  and every pending draft (the proposals for the next steps' samples, with their keys and the
  weight version that made them), so the resumed run verifies exactly what the uninterrupted
  one would have;
* ``rng/rank<R>.pt``: each rank's torch / numpy / python RNG states;
* ``COMPLETE``: written last.

Everything is written into ``step_<k>.partial`` and renamed to ``step_<k>`` only after every rank
has finished its part and ``COMPLETE`` exists, so a job killed half-way leaves a ``.partial``
directory that ``latest_checkpoint`` never returns (and the next save of that step replaces).
The directory must be on a file system that every node sees.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_bubblespec.train.checkpoint import load_trainer, save_trainer

COMPLETE = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d+)$")
FORMAT_VERSION = 1


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(completed steps, directory) of every complete checkpoint under ``root``, oldest first."""
    found = []
    if root.is_dir():
        for child in root.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and (child / COMPLETE).is_file():
                found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def resolve_resume(cfg, checkpoints: Path) -> Path | None:
    """``run.resume``: none -> None; auto -> the latest complete checkpoint under ``checkpoints``
    (None if there is none yet: a first start); a path -> that checkpoint, which must be
    complete."""
    resume = cfg.run.resume
    if resume == "none":
        return None
    if resume == "auto":
        return latest_checkpoint(checkpoints)
    path = Path(resume)
    if not (path / COMPLETE).is_file():
        raise FileNotFoundError(f"run.resume={resume!r} is not a complete checkpoint (no "
                                f"{COMPLETE} file); use run.resume=auto or a step_<k> directory")
    return path


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
            "python": random.getstate()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def save_checkpoint(rep, root: Path, completed_steps: int, keep: int) -> Path:
    """Collective: every rank writes its part of ``root/step_<completed_steps>``; rank 0
    finalises it and deletes all but the ``keep`` newest complete checkpoints."""
    rank = dist.get_rank()
    final = root / f"step_{completed_steps}"
    partial = root / f"step_{completed_steps}.partial"
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)   # a half-written one from a killed job
        (partial / "megatron").mkdir(parents=True)
        (partial / "rng").mkdir()
    dist.barrier()
    save_trainer(rep.trainer, partial / "megatron")
    torch.save(_rng_state(), partial / "rng" / f"rank{rank}.pt")
    if rank == 0:
        state = {
            "format": FORMAT_VERSION,
            "completed_steps": completed_steps,
            "weight_version": rep.state.weight_version,
            "seed": rep.cfg.run.seed,
            "sampler": {**rep.sampler.state_dict(), "next_step": completed_steps},
            "draft_queue": rep.state.drafts.state_dict(),   # the same on every rank
            "responses": rep.state.responses.state_dict(),  # the same on every rank
            "world_size": dist.get_world_size(),
        }
        (partial / "run_state.json").write_text(json.dumps(state))
    dist.barrier()  # every rank's shards and RNG file are on disk
    if rank == 0:
        (partial / COMPLETE).write_text(f"{completed_steps}\n")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        for _, old in complete_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint_into(rep, path: Path) -> int:
    """Collective: restore ``rep`` from checkpoint ``path``; push the restored weights into the
    rollout engine; return the number of completed steps (the step to run next)."""
    state = json.loads((path / "run_state.json").read_text())
    if state.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format {state.get('format')} is not "
                         f"{FORMAT_VERSION}; it was written by another version of this package")
    if state["seed"] != rep.cfg.run.seed:
        raise ValueError(f"{path} was written with run.seed={state['seed']}, this run has "
                         f"run.seed={rep.cfg.run.seed}: the resumed rollouts would differ; resume "
                         "with the same seed")
    load_trainer(rep.trainer, path / "megatron")
    rep.sampler.load_state_dict(state["sampler"])
    rep.state.weight_version = int(state["weight_version"])
    # The whole queue, as every rank keeps it: a resumed run drafts the same samples as an
    # uninterrupted one, whatever its DP size.
    rep.state.drafts.load_state_dict(state["draft_queue"])
    rep.state.responses.load_state_dict(state.get("responses", []))
    rng = path / "rng" / f"rank{dist.get_rank()}.pt"
    if rng.is_file():   # absent when resuming with more ranks than the checkpoint had
        _set_rng_state(torch.load(rng, weights_only=False))
    # The engine still holds the initial weights: give it the restored ones.
    rep.resharder.sync(rep.engine_shard, rep.state.weight_version)
    return int(state["completed_steps"])
