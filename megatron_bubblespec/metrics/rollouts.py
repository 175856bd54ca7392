"""A run's responses: step -> (global sample index -> response tokens) <-> ``rollouts.jsonl``.

One line per step, ``{"step": t, "responses": {"<g>": [token, ...], ...}}``, samples in global
order. ``append_rollouts`` is the run's one writer, ``read_rollouts`` every reader's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Sequence

ROLLOUTS_FILE = "rollouts.jsonl"


def rollouts_file(run_dir: str | Path) -> Path:
    return Path(run_dir) / ROLLOUTS_FILE


def rollout_line(step: int, responses: Mapping[int, Sequence[int]]) -> str:
    """One line of rollouts.jsonl: the step's response tokens by global sample index."""
    return json.dumps({"step": step, "responses": {str(g): list(t) for g, t in
                                                   sorted(responses.items())}}) + "\n"


def append_rollouts(run_dir: str | Path, step: int, responses: Mapping[int, Sequence[int]]) -> None:
    with open(rollouts_file(run_dir), "a", encoding="utf-8") as f:
        f.write(rollout_line(step, responses))


def write_rollouts(run_dir: str | Path, rollouts: Sequence[Mapping[int, Sequence[int]]]) -> None:
    """Rewrite the file with ``rollouts[t]`` as step t's line (a fresh or a resumed run)."""
    with open(rollouts_file(run_dir), "w", encoding="utf-8") as f:
        f.writelines(rollout_line(step, responses) for step, responses in enumerate(rollouts))


def read_rollouts(run_dir: str | Path, before_step: int | None = None) -> list[dict[int, list[int]]]:
    """The steps' responses in file order (``[t][g]`` -> tokens), only steps < ``before_step`` if
    given; a missing file reads as no steps."""
    path = rollouts_file(run_dir)
    if not path.is_file():
        return []
    rollouts = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                step, responses = int(entry["step"]), entry["responses"]
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"{path}:{lineno} is not a rollouts line ({err}); the file was "
                                 "cut or edited: rerun the run or delete the line") from None
            if before_step is None or step < before_step:
                rollouts.append({int(g): list(t) for g, t in responses.items()})
    return rollouts
