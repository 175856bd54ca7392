"""Per-token acceptance + draft coverage -> the decode-step ratio exact verification could reach.

Exact (keyed) verification keeps a drafted token only where the target policy's own keyed draw is
that token. With per-token acceptance ``a`` (each covered position agrees independently with
probability ``a``) and drafts that cover a share ``c`` of the response tokens, the best any
proposal scheme can do (verified prefix plus continuation that re-aligns after every miss, with no
cap on tokens per step) is to skip a decode step for every covered token that agrees:

    decode steps on / off >= 1 - a * c

So a measured ratio close to this bound with ``c`` well below 1 is a drafting shortfall (the
bubbles drafted too little of the responses); a bound that stays high with ``c`` near 1 is an
acceptance limit. ``a`` is estimated from the verified prefixes: ``A`` accepted tokens over ``N``
drafted samples, each ending in at most one miss, give ``a >= A / (A + N)`` (the geometric
estimate, a lower bound when some drafts end before any miss).
"""

from __future__ import annotations

import math


def accept_per_token_lower_bound(accepted_tokens: float, drafted_samples: float) -> float:
    """``A / (A + N)``: per-token acceptance implied by the verified prefixes (NaN without data)."""
    if not (math.isfinite(accepted_tokens) and math.isfinite(drafted_samples)) \
            or accepted_tokens + drafted_samples <= 0:
        return math.nan
    return accepted_tokens / (accepted_tokens + drafted_samples)


def decode_steps_ratio_ceiling(accept_per_token: float, coverage: float) -> float:
    """``1 - a * min(c, 1)``: the lowest decode steps on / off that exact verification allows."""
    if not (math.isfinite(accept_per_token) and math.isfinite(coverage)):
        return math.nan
    if not 0.0 <= accept_per_token <= 1.0 or coverage < 0.0:
        raise ValueError(f"need 0 <= acceptance <= 1 and coverage >= 0, got {accept_per_token}, "
                         f"{coverage}")
    return 1.0 - accept_per_token * min(coverage, 1.0)
