"""Speculative drafts: drafts made in the bubble -> exact verification by the next step's policy."""

from megatron_bubblespec.spec.verify import (
    EXACT_RULES,
    Verification,
    verify_keyed,
    verify_lenient,
    verify_residual,
)

__all__ = ["EXACT_RULES", "Verification", "verify_keyed", "verify_lenient", "verify_residual"]
