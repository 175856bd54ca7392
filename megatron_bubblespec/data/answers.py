"""Text -> a number's normal form; a model's output -> its final numeric answer; two answers -> equal or not.

Numbers are compared in a normal form (``normalize_number``): commas and a leading ``$`` dropped,
exact decimal value, integers without a fractional part. So "1,000", "1000.0" and "1000" are equal.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# A number: optional minus, digits with optional thousands commas, optional decimals; never
# starting after a digit or a point (so "10-3" holds 10 and 3, not -3).
_NUMBER = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")


def normalize_number(text: str | None) -> str | None:
    """A number's normal form ("1,000" / "$1000.0" -> "1000", "0.50" -> "0.5"), None if not one."""
    if text is None:
        return None
    text = text.strip().rstrip(".").replace(",", "").lstrip("$").strip()
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_answer(text: str) -> str | None:
    """The final numeric answer of a model's output, normalised; None if it has no number.

    The first number after the last ``####`` if there is one; else the last number inside the
    last ``\\boxed{...}``; else the last number in the text.
    """
    if "####" in text:
        numbers = _NUMBER.findall(text.rsplit("####", 1)[1])
        if numbers:
            return normalize_number(numbers[0])
    boxed = _BOXED.findall(text)
    if boxed:
        numbers = _NUMBER.findall(boxed[-1].replace("{,}", ","))
        if numbers:
            return normalize_number(numbers[-1])
    numbers = _NUMBER.findall(text)
    return normalize_number(numbers[-1]) if numbers else None


def answers_match(predicted: str | None, reference: str | None) -> bool:
    """Whether two numbers are equal after normalisation ("1,000" == "1000.0" == "1000")."""
    a, b = normalize_number(predicted), normalize_number(reference)
    return a is not None and a == b
