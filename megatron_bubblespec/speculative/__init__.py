"""Speculative drafts: drafts made in the bubble -> exact verification by the next step's policy."""

from megatron_bubblespec.speculative.verify import (
    Verdict,
    verify_keyed,
    verify_lenient,
    verify_residual,
)

__all__ = ["Verdict", "verify_keyed", "verify_lenient", "verify_residual"]
