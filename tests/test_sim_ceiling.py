"""The decode-step ceiling of exact verification: bound, estimate and their edge cases."""

import math

import pytest

from megatron_bubblespec.measure.sim.ceiling import (accept_per_token_lower_bound,
                                             decode_steps_ratio_ceiling)


def test_ceiling_is_one_minus_acceptance_times_coverage():
    assert decode_steps_ratio_ceiling(0.98, 0.5) == pytest.approx(0.51)
    assert decode_steps_ratio_ceiling(0.98, 1.7) == pytest.approx(0.02)  # coverage counts up to 1
    assert decode_steps_ratio_ceiling(1.0, 0.0) == 1.0  # nothing drafted: nothing to save
    assert math.isnan(decode_steps_ratio_ceiling(math.nan, 0.5))
    with pytest.raises(ValueError):
        decode_steps_ratio_ceiling(1.2, 0.5)


def test_acceptance_from_verified_prefixes_matches_a_geometric_simulation():
    """Drafts long enough that every one ends in a miss: A / (A + N) is the per-token rate."""
    rng = __import__("random").Random(0)
    a, accepted, samples = 0.95, 0, 20000
    for _ in range(samples):
        while rng.random() < a:
            accepted += 1
    assert accept_per_token_lower_bound(accepted, samples) == pytest.approx(a, abs=0.003)
    assert math.isnan(accept_per_token_lower_bound(0, 0))
