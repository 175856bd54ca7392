"""Display formatting: step record values -> short strings for tables, progress lines and plots.

A missing value (NaN) shows as MISSING; infinities as inf / -inf.
"""

from __future__ import annotations

import math
from typing import Mapping

MISSING = "-"


def value(record: Mapping[str, object], key: str) -> float:
    """``record[key]`` as a float; NaN when the record lacks it or holds None."""
    v = record.get(key)
    return math.nan if v is None else float(v)


def _non_finite(x: float) -> str:
    return MISSING if math.isnan(x) else str(x)


def number(x: float, digits: int = 3) -> str:
    """A float with ``digits`` decimals (scientific when smaller than that shows)."""
    if not math.isfinite(x):
        return _non_finite(x)
    return f"{x:.1e}" if x and abs(x) < 10 ** -digits else f"{x:.{digits}f}"


def count(x: float) -> str:
    """An integer count with thousands separators."""
    return f"{round(x):,}" if math.isfinite(x) else _non_finite(x)


def percent(x: float) -> str:
    """A fraction as a percentage with one decimal."""
    return f"{100 * x:.1f}%" if math.isfinite(x) else _non_finite(x)


def seconds(x: float) -> str:
    """A duration in seconds."""
    return f"{x:.2f}s" if math.isfinite(x) else _non_finite(x)


def scientific(x: float) -> str:
    """A small quantity (a KL) in short scientific notation: 1.5e-3."""
    if not math.isfinite(x):
        return _non_finite(x)
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"
