"""math-verify alone vs the project's grader (math-verify + the ``####`` rule) on GSM8K's 7,473 train
gold solutions and on real SmolLM2-135M-Instruct responses: where they disagree, by category;
grading off the main thread and under a running interval timer."""

import json
import signal
import threading
import time
from pathlib import Path

import pytest
from math_verify import parse, verify

from megatron_bubblespec.data import answers
from megatron_bubblespec.data.gsm8k import load_gsm8k

OUTPUTS = Path(__file__).parent / "data" / "smollm2_gsm8k_outputs.jsonl"

# Train rows whose worked solution math-verify alone grades wrong: an earlier "answer"
# ("answered 43-3=40", "the answer is 15 gallons * 8 ...") anchors its pick, not the "####" line.
GOLD_MISSES = [356, 626, 1742, 1769, 1887, 1983, 2031, 2048, 2416, 3299, 3379, 3490, 3520, 3526,
               3851, 4254, 4752, 5065, 5940, 6425, 6629, 7157]


def plain(text: str, reference: str) -> bool:
    """math-verify with its defaults on the whole text."""
    return verify(parse(reference), parse(text))


@pytest.mark.slow
def test_gold_solutions():
    train = load_gsm8k("train")
    assert len(train) == 7473
    assert [r.uid for r in train if not answers.is_correct(r.answer_text, r.answer)] == []
    misses = [i for i, r in enumerate(train) if not plain(r.answer_text, r.answer)]
    assert misses == GOLD_MISSES
    for i in misses:
        body = train[i].answer_text.rsplit(answers.MARKER, 1)[0]
        picked = parse(train[i].answer_text)[-1]      # the matched text of math-verify's pick
        anchor = body.lower().find("answer")
        assert 0 <= anchor < body.rfind(picked), (i, picked)


# Fixture responses (uid, temperature) whose final answer the two graders read differently: each
# writes on after its "####" line, and math-verify alone takes a later answer.
OUTPUT_MISREADS = [("gsm8k-test-14", 1.0), ("gsm8k-test-46", 1.0), ("gsm8k-test-86", 1.0),
                   ("gsm8k-test-88", 1.0)]


def test_smollm2_outputs():
    rows = [json.loads(line) for line in OUTPUTS.read_text(encoding="utf-8").splitlines()]
    assert len(rows) >= 200 and {r["temperature"] for r in rows} == {0.0, 1.0}
    references = {r.uid: r.answer for r in load_gsm8k("test")}
    verdicts, misreads = [], []
    for row in rows:
        text, reference = row["response"], references[row["uid"]]
        ours, alone = answers.parse_response(text), parse(text)
        verdicts.append((answers.is_correct(text, reference), plain(text, reference)))
        if bool(ours) != bool(alone) or (ours and not verify(ours, alone)):
            misreads.append((row["uid"], row["temperature"]))
            marked = answers.marked_line(text)
            assert marked is not None and text.rfind(alone[-1]) > text.rfind(marked), row["uid"]
    assert [i for i, (ours, alone) in enumerate(verdicts) if ours != alone] == []
    assert misreads == OUTPUT_MISREADS


def test_grading_off_the_main_thread():
    """math-verify's signal-based bound fails off the main thread; the grader leaves it out there."""
    got = {}

    def grade():
        got["ours"] = answers.is_correct("So 8 * 9 = 72.\n#### 72", "72")
        try:
            parse("#### 72")
        except ValueError as error:
            got["alone"] = str(error)

    thread = threading.Thread(target=grade)
    thread.start()
    thread.join()
    assert got["ours"] is True
    assert "threaded environment" in got["alone"]


def test_grading_keeps_a_running_interval_timer():
    before = signal.getitimer(signal.ITIMER_REAL)
    signal.setitimer(signal.ITIMER_REAL, 300.0)
    try:
        assert answers.is_correct("#### 72", "72")
        assert not answers.is_correct("#### 71", "72")
        assert 250 < signal.getitimer(signal.ITIMER_REAL)[0] <= 300
    finally:
        signal.setitimer(signal.ITIMER_REAL, *before)


def test_a_runaway_answer_is_cut_off(monkeypatch):
    monkeypatch.setattr(answers, "TIMEOUT_S", 1)
    start = time.monotonic()
    assert not answers.is_correct("#### 9^9^9^9^9", "72")     # sympy alone would not finish
    assert time.monotonic() - start < 30
