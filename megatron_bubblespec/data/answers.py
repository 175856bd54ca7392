"""Response text + reference answer -> math-verify's ``parse`` of each -> ``verify`` -> correct or not.

Grading is HF's ``math_verify`` (the grader of verl, TRL and open-r1): ``parse`` finds a text's
final answer (``\\boxed{}``, LaTeX, "the answer is ...", else the last expression) and ``verify``
compares it with the parsed reference (numerically, symbolically, percentages). One hand-written
rule remains, for a disagreement measured on GSM8K (``tests/test_graders.py``): math-verify does
not know GSM8K's ``####`` marker. On GSM8K's own worked solutions it takes a number after an
earlier "answer" instead of the marked one (22 of the 7,473 train solutions graded wrong), and on
a response that writes on after its "#### 72" it takes a later number. So a text holding ``####``
is graded on the first non-empty line after its last ``####`` (on the whole text if math-verify
finds no answer in that line).

math-verify bounds each parse and comparison with ``signal.alarm`` (a model may write
``9^9^9^9``, which sympy would evaluate for ever). Signals work only in the main thread: off it
the bound is left out. An interval timer already running (a caller's, pytest-timeout's) is set
again afterwards, as math-verify's clean-up cancels it.

``normalize_number`` is the normal form in which the datasets store reference numbers ("1,000" /
"$1000.0" -> "1000"). math-verify is imported on first use (importing sympy and its LaTeX parser
takes about a second, which runs that never grade text need not pay).
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
import time
from decimal import Decimal, InvalidOperation
from typing import Iterator


MARKER = "####"
TIMEOUT_S = 5                 # math-verify's default bound, per parse and per comparison


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


def marked_line(text: str) -> str | None:
    """The first non-empty line after the last ``####``; None without a marker or such a line."""
    if MARKER not in text:
        return None
    lines = [line for line in text.rsplit(MARKER, 1)[1].splitlines() if line.strip()]
    return lines[0] if lines else None


def parse_response(text: str) -> list:
    """math-verify's parse of a response's final answer (of its marked line if it has one)."""
    from math_verify import parse

    with _bounded() as timeout:
        marked = marked_line(text)
        parsed = parse(marked, parsing_timeout=timeout) if marked is not None else []
        return parsed or parse(text, parsing_timeout=timeout)


def is_correct(response: str, reference: str) -> bool:
    """Whether a response's final answer equals the reference answer (math-verify's ``verify``)."""
    from math_verify import verify

    gold = _parse_reference(reference)
    if not gold:
        return False
    predicted = parse_response(response)
    with _bounded() as timeout:
        return verify(gold, predicted, timeout_seconds=timeout)


@functools.lru_cache(maxsize=1 << 16)
def _parse_reference(reference: str) -> list:
    from math_verify import parse

    with _bounded() as timeout:
        return parse(reference, parsing_timeout=timeout)


@contextlib.contextmanager
def _bounded() -> Iterator[int | None]:
    """math-verify's time bound for this thread (None off the main thread); re-arms a running
    interval timer afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    remaining, interval = signal.getitimer(signal.ITIMER_REAL)
    start = time.monotonic()
    try:
        yield TIMEOUT_S
    finally:
        if remaining > 0:
            left = max(remaining - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, interval)
