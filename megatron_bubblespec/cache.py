"""Environment -> the project's cache directory (converted checkpoints, vLLM / inductor caches).

``BUBBLESPEC_CACHE`` if set, else ``~/.cache/megatron-bubblespec``. Kept outside the repository so
that fresh clones (CI) reuse conversions, and so that runs leave nothing in system-wide places.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """The cache directory (or a sub-directory of it), created on first use."""
    root = Path(os.environ.get("BUBBLESPEC_CACHE") or Path.home() / ".cache" / "megatron-bubblespec")
    path = root.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path
