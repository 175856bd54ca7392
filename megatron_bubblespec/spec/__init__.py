"""Speculative drafts: drafts made in the bubble -> exact verification by the next step's policy."""

from megatron_bubblespec.spec.verify import (
    Verification,
    verify_keyed,
    verify_lenient,
    verify_residual,
)

__all__ = ["Verification", "verify_keyed", "verify_lenient", "verify_residual"]
