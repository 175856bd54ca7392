"""Small Python functions to write (``data.task: code``) -> chat prompts whose data holds test cases
-> rewards from running the answer in the sandbox (``data.sandbox``).

Each prompt asks for ``def solve(...)`` doing one generated thing (a family of ``FAMILIES`` with
parameters drawn from (seed, index), like the arithmetic task's operands), or is a row of a JSONL
file (``data.path``)::

    {"question": "Write solve(s) returning s upper-cased.", "data": {"tests": [[["ab"], "AB"]]}}

(``data.entry`` names another function than ``solve``; uids are ``code-jsonl-<line number>``).
The prompt's ``data`` holds the entry point and the test cases, so the reward needs nothing but
the prompt. Reward::

    correct  1.0 x the share of the test cases the answer passes
    format   0.2 if the response holds a fenced code block that defines ``solve``

so a perfect response scores 1.2, and one that hangs, crashes or reaches outside the sandbox 0.
The answer is the last fenced code block (else the whole text).
A batch is scored by up to ``workers`` sandboxes at a time within one time limit for the whole
batch (``data.reward_time_limit_s``); a sample that runs past its share, crashes, or reaches for
the filesystem scores 0 for ``correct`` and says so in its outcome.
"""

from __future__ import annotations

import math
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from megatron_bubblespec.data.jsonl import read_rows
from megatron_bubblespec.data.sandbox import run_tests
from megatron_bubblespec.data.tasks import Prompt, RewardBreakdown, _ChatTask, _operands

INSTRUCTION = ("{question}\n\nWrite the function in Python, in one ```python code block, and "
               "nothing after it.")
ENTRY = "solve"
FORFEITS = ("timeout", "crashed", "refused")   # outcomes that cost the whole reward
_FENCED = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def _linear(a: int, b: int):
    return (f"Write a function solve(x) that returns {a} times the integer x plus {b}.",
            [[[x], a * x + b] for x in (0, 1, -3, 7, 12)])


def _divisible_sum(a: int, b: int):
    k = 2 + a % 5
    lists = [[1, 2, 3, 4, 5, 6], [], [k, 2 * k, 7], [b, b + 1, b + 2, -k]]
    return (f"Write a function solve(xs) that returns the sum of the integers in the list xs "
            f"that are divisible by {k}.", [[[xs], sum(x for x in xs if x % k == 0)]
                                            for xs in lists])


def _repeat_reversed(a: int, b: int):
    n = 1 + a % 3
    words = ["abc", "", "racecar", f"n{b}"]
    return (f"Write a function solve(s) that returns the string s reversed and repeated {n} "
            f"times.", [[[w], w[::-1] * n] for w in words])


def _count_char(a: int, b: int):
    c = "aeiou"[a % 5]
    words = ["banana", "", "queueing", "education", f"x{c}{c}y"]
    return (f"Write a function solve(s) that returns how many times the letter '{c}' occurs in "
            f"the string s.", [[[w], w.count(c)] for w in words])


FAMILIES = (_linear, _divisible_sum, _repeat_reversed, _count_char)
ROW_FORMAT = ('one JSON object per line, like {"question": "Write solve(x) returning x + 1.", '
              '"data": {"tests": [[[1], 2], [[5], 6]]}} (tests: [arguments list, expected '
              'value] pairs; data.entry: the function, default solve)')


def _parse_row(item: dict) -> tuple[str, dict]:
    """(question, data) of one row's object; ValueError saying what is wrong."""
    question, data = item.get("question"), item.get("data")
    if not isinstance(question, str) or not question.strip():
        raise ValueError("field 'question' must be a non-empty string")
    if not isinstance(data, dict) or not isinstance(data.get("tests"), list) or not data["tests"]:
        raise ValueError("field 'data' must be an object with a non-empty list 'tests'")
    for test in data["tests"]:
        if not (isinstance(test, list) and len(test) == 2 and isinstance(test[0], list)):
            raise ValueError(f"test {test!r} is not an [arguments list, expected value] pair")
    entry = data.get("entry", ENTRY)
    if not isinstance(entry, str) or not entry.isidentifier():
        raise ValueError(f"data.entry {entry!r} is not a Python name")
    return question, {"entry": entry, "tests": data["tests"]}


class CodeTask(_ChatTask):
    """Write ``solve``; rewarded by running it against its test cases (see the module doc)."""

    name = "code"
    CORRECT = 1.0
    FORMAT = 0.2

    def __init__(self, seed: int = 0, size: int = 1024, tokenizer=None, *, path=None,
                 time_limit_s: float = 30.0, sample_time_limit_s: float = 2.0,
                 memory_mb: int = 256, workers: int = 2, max_prompt_tokens: int | None = None):
        self.rows = read_rows(path, _parse_row, ROW_FORMAT) if path else None   # fail fast
        super().__init__(tokenizer, instruction=INSTRUCTION, max_prompt_tokens=max_prompt_tokens)
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.seed, self.size = seed, len(self.rows) if self.rows else size
        self.time_limit_s, self.sample_time_limit_s = time_limit_s, sample_time_limit_s
        self.memory_mb, self.workers = memory_mb, workers

    def _item(self, index: int) -> tuple[str, str, dict]:
        """(uid, question, data) of prompt ``index``: a JSONL row's, or generated."""
        if self.rows:
            line, (question, data) = self.rows[index]
            return f"code-jsonl-{line}", question, data
        a, b = _operands(self.seed, index, 99)
        question, tests = FAMILIES[(a + b) % len(FAMILIES)](a, b)
        return f"code-{self.seed}-{index}", question, {"entry": ENTRY, "tests": tests}

    def _question(self, index: int) -> tuple[str, str, str]:
        uid, question, _ = self._item(index)
        return uid, question, ""

    def _data(self, index: int) -> dict:
        return self._item(index)[2]

    def reward(self, prompt: Prompt, response_token_ids: Sequence[int]) -> RewardBreakdown:
        return self.rewards([prompt], [response_token_ids])[0]

    def rewards(self, prompts: Sequence[Prompt],
                responses: Sequence[Sequence[int]]) -> list[RewardBreakdown]:
        """The batch's rewards, every sandbox within the batch's time limit."""
        deadline = time.monotonic() + self.time_limit_s

        def score(pair) -> RewardBreakdown:
            prompt, response = pair
            text, _ = self.decode(response)
            blocks = _FENCED.findall(text)
            code = blocks[-1] if blocks else text
            left = min(self.sample_time_limit_s, deadline - time.monotonic())
            run = run_tests(code, prompt.data["entry"], prompt.data["tests"], time_limit_s=left,
                            memory_mb=self.memory_mb)
            form = self.FORMAT if blocks and f"def {prompt.data['entry']}" in code else 0.0
            if run.outcome in FORFEITS:
                form = 0.0
            parts = {"correct": self.CORRECT * run.share, "format": form}
            return RewardBreakdown(math.fsum(parts.values()), parts, run.outcome == "passed",
                                   run.outcome)

        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            return list(pool.map(score, zip(prompts, responses)))
