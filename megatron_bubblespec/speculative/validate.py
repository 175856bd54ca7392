"""A draft's token ids as received (another rank, a file) -> the ids the verifier may check, or None.

Drafts are only ever proposals to the exact verifier, so a malformed one may cost acceptance but
never a step or a token: an id that is not an integer in [0, vocab_size) drops the whole draft, a
draft longer than the response budget left is cut to it, and each case warns naming the draft.
"""

from __future__ import annotations

import operator
import warnings
from typing import Sequence


def verifiable_draft(tokens: Sequence, vocab_size: int, budget: int, name: str) -> list[int] | None:
    """``tokens`` as plain ints cut to ``budget``, or None (dropped) if any is not a token id;
    ``name`` (for example "request 'p3-s1'") says in the warning which draft it was."""
    checked = []
    for position, token in enumerate(tokens):
        try:
            value = operator.index(token)
        except TypeError:
            value = None
        if value is None or isinstance(token, bool) or not 0 <= value < vocab_size:
            warnings.warn(f"{name}: draft token {token!r} at draft position {position} is not a "
                          f"token id in [0, {vocab_size}); the draft is dropped", RuntimeWarning,
                          stacklevel=2)
            return None
        checked.append(value)
    budget = max(0, budget)
    if len(checked) > budget:
        warnings.warn(f"{name}: draft of {len(checked)} tokens exceeds the response budget left "
                      f"({budget} tokens); truncated to {budget} tokens", RuntimeWarning,
                      stacklevel=2)
        checked = checked[:budget]
    return checked


def request_draft(request, draft: Sequence, vocab_size: int) -> list[int]:
    """A rollout request's draft as a verifier may check it: cut to the budget the request has
    left after its fixed prefix, empty (one plain keyed draw) if it holds a non-token id."""
    budget = request.max_new_tokens - len(request.response_prefix)
    return verifiable_draft(draft, vocab_size, budget, f"request {request.request_id!r}") or []
