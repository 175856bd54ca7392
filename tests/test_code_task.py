"""The code task and its sandbox: answers that pass, fail, hang, crash, eat memory and try to reach
the filesystem, other processes or modules score what they earn and nothing else happens; the
batch keeps its time limit; the task is registered once and reads JSONL rows of test cases.

The sandbox tests start processes (one per answer), so they are in the slow tier; each takes well
under a second except the hanging answers, which take their time limit."""

import json
import time

import pytest

from megatron_bubblespec.config import ConfigError, load_config
from megatron_bubblespec.data.code_task import CodeTask
from megatron_bubblespec.data.jsonl import DatasetError
from megatron_bubblespec.data.registry import TASKS, task_from_config
from megatron_bubblespec.data.sandbox import run_tests
from megatron_bubblespec.preflight import check_registered

TESTS = [[[1], 3], [[2], 5], [[10], 21]]
GOOD = "def solve(x):\n    return 2 * x + 1\n"


@pytest.fixture(scope="module")
def task():
    return CodeTask(seed=3, size=16, sample_time_limit_s=1.0, time_limit_s=10.0)


def _response(task, text: str) -> list[int]:
    return task.tokenizer.encode(text, add_special_tokens=False) + list(task.eos_token_ids)


def test_prompts_carry_their_test_cases(task):
    prompts = [task.prompt(i) for i in range(task.size)]
    assert len({p.uid for p in prompts}) == task.size and all(p.answer == "" for p in prompts)
    assert all(p.data["entry"] == "solve" and p.data["tests"] for p in prompts)
    assert task.prompt(5) == CodeTask(seed=3, size=16).prompt(5)     # a function of (seed, index)
    kinds = {k for p in prompts for k in ("times the integer", "divisible", "reversed", "occurs")
             if k in p.text}
    assert len(kinds) >= 3, kinds


@pytest.mark.slow
@pytest.mark.parametrize("code, outcome, passed", [
    (GOOD, "passed", 3),
    ("def solve(x):\n    return 2 * x\n", "failed", 0),
    ("import math\ndef solve(x):\n    return int(math.floor(2 * x + 1))\n", "passed", 3),
    ("def solve(x)\n    return x\n", "invalid", 0),                   # a syntax error
    ("def other(x):\n    return x\n", "invalid", 0),                   # no solve
    ("raise SystemExit(3)\n", "crashed", 0),
    ("import os\ndef solve(x):\n    return len(os.listdir('/'))\n", "refused", 0),
    ("import subprocess\n", "refused", 0),
    ("__import__('socket')\n", "refused", 0),
    ("def solve(x):\n    return open('/etc/hostname').read()\n", "failed", 0),   # no open
    # the os module reached through a class's globals: its calls are refused all the same
    ("w = [c for c in ().__class__.__base__.__subclasses__() if c.__name__ == '_wrap_close']\n"
     "def solve(x):\n    return w[0].__init__.__globals__['system']('true') if w else 0\n",
     "refused", 0),
    ("def solve(x):\n    a = [0] * (10 ** 10)\n    return 2 * x + 1\n", "failed", 0),  # memory
    ("print('x' * 100000)\n" + GOOD, "passed", 3),                 # output does not matter
])
def test_answers_score_what_they_earn(code, outcome, passed):
    run = run_tests(code, "solve", TESTS, time_limit_s=5.0)
    assert (run.outcome, run.passed, run.total) == (outcome, passed, 3), run.detail


@pytest.mark.slow
def test_a_hanging_answer_is_stopped_at_its_limit():
    start = time.monotonic()
    run = run_tests("def solve(x):\n    while True:\n        pass\n", "solve", TESTS,
                    time_limit_s=1.0)
    assert run.outcome == "timeout" and run.share == 0.0
    assert time.monotonic() - start < 5.0


@pytest.mark.slow
def test_an_escaping_answer_writes_nothing(tmp_path):
    target = tmp_path / "escaped"
    attempts = [f"open({str(target)!r}, 'w').write('x')\n",
                f"__builtins__['__import__']('pathlib').Path({str(target)!r}).touch()\n",
                f"import os\nos.system('touch {target}')\n"]
    for code in attempts:
        run_tests(code, "solve", TESTS, time_limit_s=2.0)
    assert not target.exists()


@pytest.mark.slow
def test_rewards_of_a_batch_with_hostile_answers(task):
    prompt = task.prompt(0)
    prompt = type(prompt)(prompt.uid, prompt.index, prompt.token_ids, "", prompt.text,
                          {"entry": "solve", "tests": TESTS})
    texts = [f"```python\n{GOOD}```", GOOD,
             "```python\ndef solve(x):\n    while True:\n        pass\n```",
             "```python\nimport os\ndef solve(x):\n    return 3\n```",
             "```python\ndef solve(x):\n    raise SystemExit(1)\nsolve(0)\n```",
             "```python\ndef solve(x):\n    return 3\n```", "no code at all"]
    rewards = task.rewards([prompt] * len(texts), [_response(task, t) for t in texts])
    assert [r.outcome for r in rewards] == ["passed", "passed", "timeout", "refused", "crashed",
                                            "failed", "invalid"]
    # a hang, a crash or an escape costs the whole reward, format included
    assert [r.total for r in rewards] == [pytest.approx(1.2), 1.0, 0.0, 0.0, 0.0,
                                          pytest.approx(0.2 + 1 / 3), 0.0]
    assert rewards[0].correct and not rewards[1].parts["format"] and not rewards[5].correct


@pytest.mark.slow
def test_a_batch_keeps_its_time_limit(task):
    slow = CodeTask(seed=3, size=4, sample_time_limit_s=2.0, time_limit_s=1.5, workers=1)
    hang = _response(slow, "```python\ndef solve(x):\n    while True:\n        pass\n```")
    start = time.monotonic()
    rewards = slow.rewards([slow.prompt(0)] * 4, [hang] * 4)
    assert [r.outcome for r in rewards] == ["timeout"] * 4
    assert time.monotonic() - start < 4.0       # not 4 x 2 s: the batch's limit holds


def test_the_task_is_registered_once_and_read_from_config(tmp_path):
    assert TASKS["code"].cls is CodeTask and TASKS["code"].path == "optional"
    rows = tmp_path / "code.jsonl"
    rows.write_text(json.dumps({"question": "Write solve(s) returning s upper-cased.",
                                "data": {"tests": [[["ab"], "AB"], [[""], ""]]}}) + "\n\n"
                    + json.dumps({"question": "Write twice(x).", "data": {
                        "entry": "twice", "tests": [[[2], 4]]}}) + "\n")
    cfg = load_config(None, ["data.task=code", f"data.path={rows}"])
    task = task_from_config(cfg, 49152)
    assert task.size == 2 and task.prompt(1).uid == "code-jsonl-3"
    assert task.prompt(1).data == {"entry": "twice", "tests": [[[2], 4]]}
    assert task_from_config(load_config(None, ["data.task=code"]), 49152).size == cfg.data.size


def test_bad_code_rows_and_config_name_the_fix(tmp_path):
    rows = tmp_path / "bad.jsonl"
    rows.write_text(json.dumps({"question": "q", "data": {"tests": [[1, 2]]}}) + "\n")
    with pytest.raises(DatasetError, match=r"row 1: test \[1, 2\] is not an \[arguments list"):
        CodeTask(path=rows)
    with pytest.raises(ConfigError, match="data.task='cobol' is not a task; choose one of"):
        check_registered(load_config(None, ["data.task=cobol"]))
    with pytest.raises(ConfigError, match=r"data.path='.*' is only read with data.task in "
                                          r"\['jsonl', 'code'\]"):
        check_registered(load_config(None, ["data.task=gsm8k", f"data.path={rows}"]))
    with pytest.raises(ConfigError, match="data.task=jsonl needs data.path"):
        check_registered(load_config(None, ["data.task=jsonl"]))
