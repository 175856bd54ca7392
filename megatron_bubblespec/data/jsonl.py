"""A JSONL file of questions -> validated records (uid, question, answer), or one error naming the first bad row.

The user's dataset format (``data.task: jsonl``, ``data.path: FILE.jsonl``) is one JSON object per
line::

    {"question": "Tom has 3 apples and buys 4 more. How many does he have?", "answer": "7"}
    {"question": "...", "answer": "He has 3 + 4 = 7 apples.\\n#### 7"}

``question`` is a non-empty string. ``answer`` is the final numeric answer, as a string or a JSON
number, or a GSM8K-style worked solution whose number after the last ``####`` is the answer. It is
stored normalised (``answers.normalize_number``), so "1,000" and 1000 are the same answer. Other
keys are ignored. Blank lines are skipped (a trailing newline or a spacer line is not an error),
but rows keep their line numbers: row N is line N of the file, and a record's uid is
``jsonl-<line number>``, stable as long as the file's lines do not move.

``read_rows`` is the reader every JSONL dataset uses (the GSM8K loader too): it checks every row
before anything else happens and raises one ``DatasetError`` naming the file, the first bad row and
what is wrong with it, and how many rows are bad in all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

from megatron_bubblespec.data.answers import normalize_number

T = TypeVar("T")

ROW_FORMAT = ('one JSON object per line, like {"question": "What is 3 + 4?", "answer": "7"} '
              '(answer: a number, or a solution ending in "#### <number>")')
LISTED_BAD_ROWS = 10          # bad rows named in the error message; the rest are counted


class DatasetError(ValueError):
    """A dataset file that cannot be used as it is: which file, which rows, what to fix."""


@dataclass(frozen=True)
class JsonlRecord:
    uid: str            # "jsonl-<line number>"
    line: int           # 1-based line of the file
    question: str
    answer: str         # normalised number ("1000", "-3.5")


def read_rows(path: str | Path, parse: Callable[[dict], T],
              row_format: str = ROW_FORMAT) -> list[tuple[int, T]]:
    """``(line number, parse(object))`` for every non-blank line of a JSONL file.

    ``parse`` gets each line's JSON object and raises ValueError saying what is wrong with it. All
    rows are checked; if any is bad (not JSON, not an object, rejected by ``parse``), or the file
    has no rows, one DatasetError names the file, the first bad row, the number of bad rows and the
    expected ``row_format``.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset file {path} does not exist; expected a JSONL file with "
                           f"{row_format}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise DatasetError(f"{path} is not UTF-8 text ({error.reason} at byte {error.start}); "
                           f"save it as UTF-8 JSONL with {row_format}") from None
    rows: list[tuple[int, T]] = []
    bad: list[tuple[int, str]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append((number, parse(_object(line))))
        except ValueError as error:
            bad.append((number, str(error)))
    if bad:
        first, problem = bad[0]
        named = ", ".join(str(n) for n, _ in bad[:LISTED_BAD_ROWS])
        more = f" and {len(bad) - LISTED_BAD_ROWS} more" if len(bad) > LISTED_BAD_ROWS else ""
        total = len(bad) + len(rows)
        raise DatasetError(
            f"{path}, row {first}: {problem}. {len(bad)} of {total} rows are bad "
            f"(row{'s' if len(bad) > 1 else ''} {named}"
            f"{more}; a row number is its line number, blank lines are skipped). Each row must be "
            f"{row_format}: fix or delete the bad rows")
    if not rows:
        raise DatasetError(f"{path} has no rows (the file is empty or only blank lines); write "
                           f"{row_format}")
    return rows


def _object(line: str) -> dict:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"invalid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(item, dict):
        raise ValueError(f"expected a JSON object, got {type(item).__name__}")
    return item


def parse_record(item: dict) -> tuple[str, str]:
    """(question, normalised answer) of one row's object; ValueError saying what is wrong."""
    question = item.get("question")
    if question is None:
        raise ValueError("missing field 'question'" + _keys_hint(item))
    if not isinstance(question, str):
        raise ValueError(f"field 'question' must be a string, got {type(question).__name__}")
    if not question.strip():
        raise ValueError("field 'question' is empty")
    return question, parse_answer(item)


def parse_answer(item: dict) -> str:
    """The normalised number a row's ``answer`` holds; ValueError if it has none."""
    if "answer" not in item or item["answer"] is None:
        raise ValueError("missing field 'answer'" + _keys_hint(item))
    answer = item["answer"]
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ValueError(f"field 'answer' must be a string or a number, got "
                         f"{type(answer).__name__}")
    text = str(answer)
    if not text.strip():
        raise ValueError("field 'answer' is empty")
    final = text.rsplit("####", 1)[1] if "####" in text else text
    number = normalize_number(final)
    if number is None:
        where = "after '####' " if "####" in text else ""
        raise ValueError(f"field 'answer' has no number {where}({_short(final)}); write the final "
                         "answer as a number, or end the solution with \"#### <number>\"")
    return number


def load_jsonl(path: str | Path) -> list[JsonlRecord]:
    """The validated records of a user's JSONL dataset (see the module docstring)."""
    return [JsonlRecord(f"jsonl-{line}", line, question, answer)
            for line, (question, answer) in read_rows(path, parse_record)]


def _keys_hint(item: dict) -> str:
    return f" (the row has keys {sorted(item)})" if item else " (the row is an empty object)"


def _short(text: str, limit: int = 40) -> str:
    text = text.strip()
    return repr(text if len(text) <= limit else text[:limit] + "...")
