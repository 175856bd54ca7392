"""Token-id lists -> right-padded int64 tensors [rows, width] and their lengths."""

from __future__ import annotations

from typing import Sequence

import torch


def pad_token_rows(rows: Sequence[Sequence[int]], pad_id: int = 0, *, width: int | None = None,
                   batch: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad ``rows`` to one width (at least ``width``); ``batch`` adds all-padding rows.

    Returns the tokens [batch or len(rows), width] and the lengths [len(rows)]. Empty rows are
    allowed (a batch of empty rows has width 0)."""
    lengths = [len(r) for r in rows]
    width = max(lengths + [width or 0])
    tokens = torch.full((batch or len(rows), width), pad_id, dtype=torch.int64)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = torch.as_tensor(list(row), dtype=torch.int64)
    return tokens, torch.tensor(lengths, dtype=torch.int64)
