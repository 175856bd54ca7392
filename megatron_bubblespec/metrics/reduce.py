"""Step records -> run-level numbers: totals, means, weighted means and pooled ratios of one metric.

Every reduction skips the records where the metric (or its weight) is missing or not finite, and
gives NaN when no record is left or a denominator is 0.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

from megatron_bubblespec.metrics.formatting import value

Record = Mapping[str, object]


def finite_values(xs: Iterable[float]) -> list[float]:
    return [x for x in xs if math.isfinite(x)]


def total_of(records: Sequence[Record], key: str) -> float:
    xs = finite_values(value(r, key) for r in records)
    return sum(xs) if xs else math.nan


def mean_of(records: Sequence[Record], key: str) -> float:
    xs = finite_values(value(r, key) for r in records)
    return sum(xs) / len(xs) if xs else math.nan


def _weighted(records: Sequence[Record], key: str, weight: str, scale: bool) -> float:
    top = bottom = 0.0
    for r in records:
        x, w = value(r, key), value(r, weight)
        if math.isfinite(x) and math.isfinite(w):
            top, bottom = top + (x * w if scale else x), bottom + w
    return top / bottom if bottom else math.nan


def weighted_mean_of(records: Sequence[Record], key: str, weight: str) -> float:
    """sum(key * weight) / sum(weight) over the records reporting both."""
    return _weighted(records, key, weight, scale=True)


def pooled_ratio(records: Sequence[Record], num: str, den: str) -> float:
    """sum(num) / sum(den) over the records reporting both."""
    return _weighted(records, num, den, scale=False)


def bubble_utilization(records: Sequence[Record]) -> float:
    """Drafting share of the bubbles that could draft: total drafting / total bubble/draftable_s.

    Records without bubble/draftable_s (written before it existed) count their idle time instead,
    except the last step's (nothing after it to draft).
    """
    if any(math.isfinite(value(r, "bubble/draftable_s")) for r in records):
        return pooled_ratio(records, "bubble/drafting_s", "bubble/draftable_s")
    last = max((value(r, "step") for r in records), default=math.nan)
    return pooled_ratio([r for r in records if value(r, "step") < last],
                        "bubble/drafting_s", "bubble/idle_s")
