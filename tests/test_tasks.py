"""Tasks: synthetic prompts and shaped rewards (perfect, partial, format, variance under a random
policy), chat prompts and rewards with SmolLM2's tokenizer, factory and prompt-length errors,
data.max_prompts (a task cut to its first prompts)."""

import random
from pathlib import Path

import pytest

from megatron_bubblespec.data.tasks import (
    DIGIT0,
    EOS_ID,
    EQUALS,
    PLUS,
    ArithmeticWordTask,
    GSM8KTask,
    SyntheticArithmeticTask,
    Task,
    check_prompt_lengths,
    has_marked_answer,
)
from megatron_bubblespec.data.registry import TASKS, make_task


DEFAULT = str(Path(__file__).resolve().parents[1] / "configs" / "default.yaml")


def digits(number):
    return [DIGIT0 + int(c) for c in str(number)]


# ----------------------------------------------------------------------------- synthetic

@pytest.fixture(scope="module")
def synth():
    return SyntheticArithmeticTask(seed=3, size=64, max_operand=99)


def test_synthetic_prompts_are_deterministic(synth):
    assert isinstance(synth, Task) and synth.eos_token_ids == (EOS_ID,)
    again = SyntheticArithmeticTask(seed=3, size=128, max_operand=99)   # size does not move prompts
    for i in range(synth.size):
        p = synth.prompt(i)
        assert p == again.prompt(i) and p.uid == f"synth-3-{i}" and p.index == i
        a, b = (int(x) for x in p.text[:-1].split("+"))
        assert 0 <= a <= 99 and 0 <= b <= 99 and p.answer == str(a + b)
        assert p.token_ids == digits(a) + [PLUS] + digits(b) + [EQUALS]
    other = SyntheticArithmeticTask(seed=4, size=64)
    assert [other.prompt(i).text for i in range(64)] != [synth.prompt(i).text for i in range(64)]
    with pytest.raises(IndexError, match="out of range 0..63"):
        synth.prompt(64)


def test_synthetic_perfect_response_scores_one(synth):
    for i in range(synth.size):
        p = synth.prompt(i)
        r = synth.reward(p, digits(p.answer) + [EOS_ID])
        assert r.total == 1.0 and r.correct
        assert r.parts == pytest.approx({"correct": 0.6, "close": 0.3, "format": 0.1})
        assert sum(r.parts.values()) == pytest.approx(r.total)


def test_synthetic_partial_credit_and_format(synth):
    p = next(synth.prompt(i) for i in range(synth.size) if len(synth.prompt(i).answer) == 3)
    target = digits(p.answer)
    one_wrong = target[:2] + [DIGIT0 + (int(p.answer[2]) + 5) % 10]
    r = synth.reward(p, one_wrong + [EOS_ID])
    assert not r.correct
    assert r.parts["correct"] == pytest.approx(0.6 * 2 / 3)
    assert r.parts["close"] == pytest.approx(0.3 * (2 + 1 - 5 / 32) / 3)
    assert r.parts["format"] == pytest.approx(0.1)
    # Right digits, no EOS: no format part; EOS a little late still counts, too late does not.
    assert synth.reward(p, target).total == pytest.approx(0.9)
    assert synth.reward(p, target + [100, 101, EOS_ID]).parts["format"] == pytest.approx(0.1)
    assert synth.reward(p, target + [100, 101, 102, EOS_ID]).parts["format"] == 0
    # An extra digit after the answer is not the right answer.
    assert not synth.reward(p, target + [DIGIT0, EOS_ID]).correct
    # An early EOS ends the response: nothing after it counts, nor the EOS itself as a digit.
    early = synth.reward(p, [EOS_ID] + target)
    assert early.total == 0 and early.parts["format"] == 0
    assert synth.reward(p, [200, 201, 202, EOS_ID]).parts == {"correct": 0, "close": 0,
                                                               "format": pytest.approx(0.1)}


def test_random_policy_gets_reward_variance_within_groups(synth):
    rng = random.Random(0)
    group = 8
    varied = 0
    for i in range(32):
        p = synth.prompt(i)
        rewards = [synth.reward(p, [rng.randrange(256) for _ in range(8)]).total
                   for _ in range(group)]
        varied += len(set(rewards)) > 1
    assert varied >= 28            # most groups give GRPO a non-zero advantage


def test_synthetic_settings_errors():
    with pytest.raises(ValueError, match="vocab_size=10 too small"):
        SyntheticArithmeticTask(vocab_size=10)
    with pytest.raises(ValueError, match="size and max_operand must be >= 1"):
        SyntheticArithmeticTask(size=0)


# ----------------------------------------------------------------------------- prompt length

def test_prompt_too_long_names_the_uid():
    task = SyntheticArithmeticTask(seed=0, size=16, max_operand=99, max_prompt_tokens=5)
    lengths = {i: len(SyntheticArithmeticTask(0, 16).prompt(i).token_ids) for i in range(16)}
    long_one = next(i for i, n in lengths.items() if n > 5)
    with pytest.raises(ValueError, match=rf"prompt 'synth-0-{long_one}' has \d tokens, more than "
                                         r"max_prompt_tokens=5"):
        task.prompt(long_one)
    first = min(i for i, n in lengths.items() if n > 5)
    too_many = sum(n > 5 for n in lengths.values())
    with pytest.raises(ValueError, match=rf"'synth-0-{first}'.*\({too_many} prompt\(s\) too long"):
        check_prompt_lengths(SyntheticArithmeticTask(0, 16), 5)
    assert check_prompt_lengths(SyntheticArithmeticTask(0, 16), 7) == max(lengths.values())


# ----------------------------------------------------------------------------- factory

def test_make_task():
    task = make_task("synthetic", seed=1, size=8)
    assert isinstance(task, SyntheticArithmeticTask) and task.size == 8
    with pytest.raises(ValueError, match="unknown task 'gsm9k': valid names are arithmetic, code, "
                                         "gsm8k, jsonl, synthetic"):
        make_task("gsm9k")


def test_a_task_has_one_name_the_config_and_its_class_share():
    assert all(entry.cls.name == name for name, entry in TASKS.items())


# ----------------------------------------------------------------------------- chat tasks

@pytest.fixture(scope="module")
def tokenizer():
    from megatron_bubblespec.models.smollm2 import load_tokenizer
    return load_tokenizer()


@pytest.fixture(scope="module")
def gsm8k(tokenizer):
    return GSM8KTask("test", tokenizer)


def _response(tokenizer, text, eos=True):
    ids = tokenizer.tokenizer.encode(text, add_special_tokens=False)
    return ids + [tokenizer.eos_token_id] if eos else ids


def test_gsm8k_prompt_uses_the_chat_template(gsm8k, tokenizer):
    p = gsm8k.prompt(0)
    assert isinstance(gsm8k, Task) and gsm8k.size == 1319
    assert p.uid == "gsm8k-test-0" and p.answer == gsm8k.records[0].answer
    text = tokenizer.tokenizer.decode(p.token_ids)
    assert text.startswith("<|im_start|>system\n")
    assert f"<|im_start|>user\n{p.text}" in text and "####" in text
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert gsm8k.eos_token_ids == (tokenizer.eos_token_id,)
    custom = GSM8KTask("test", tokenizer, system_prompt="Be brief.",
                       instruction="Q: {question}\nA:")
    assert tokenizer.tokenizer.decode(custom.prompt(0).token_ids).startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ: ")


def test_gsm8k_rewards_on_written_responses(gsm8k, tokenizer):
    p = gsm8k.prompt(0)
    answer = p.answer
    cases = [
        (f"Some steps.\n#### {answer}", True, 1.2, True),
        (f"So the answer is \\boxed{{{answer}}}.", True, 1.2, True),
        (f"The total is {answer}.", True, 1.1, True),           # right, unmarked, stopped
        (f"The total is {answer}.", False, 1.0, True),          # right, unmarked, cut off
        (f"#### {int(answer) + 1}", True, 0.2, False),          # marked but wrong
        (f"#### {int(answer) + 1}", False, 0.2, False),
        ("I do not know.", True, 0.1, False),
        ("I do not know and", False, 0.0, False),
    ]
    for text, eos, total, right in cases:
        r = gsm8k.reward(p, _response(tokenizer, text, eos))
        assert (r.total, r.correct) == (pytest.approx(total), right), text
        assert sum(r.parts.values()) == pytest.approx(r.total)
    # Tokens after the first EOS do not count.
    tail = _response(tokenizer, "I give up.") + _response(tokenizer, f"#### {answer}", False)
    assert gsm8k.reward(p, tail).total == pytest.approx(0.1)


def test_marked_answer_format():
    assert has_marked_answer("so\n#### 1,200")
    assert has_marked_answer("#### $5")
    assert has_marked_answer("#### -3.5")
    assert has_marked_answer("\\boxed{42}")
    assert not has_marked_answer("#### the answer is 4")
    assert not has_marked_answer("#### 4 and then #### none")    # the last marker counts
    assert not has_marked_answer("\\boxed{x + 1}")
    assert not has_marked_answer("42")


def test_arithmetic_word_task(tokenizer):
    task = make_task("arithmetic", seed=2, size=32, tokenizer=tokenizer)
    p = task.prompt(5)
    a, b = (int(x) for x in p.text.removeprefix("What is ").removesuffix("?").split(" + "))
    assert p.uid == "arith-2-5" and p.answer == str(a + b)
    assert p == ArithmeticWordTask(seed=2, size=64, tokenizer=tokenizer).prompt(5)
    assert task.reward(p, _response(tokenizer, f"{a} + {b} = {a + b}\n#### {a + b}")).total == \
        pytest.approx(1.2)
    assert task.reward(p, _response(tokenizer, f"{a} + {b} = {a + b + 1}")).total == \
        pytest.approx(0.1)
    with pytest.raises(ValueError, match=r"prompt 'arith-2-0' has \d+ tokens"):
        ArithmeticWordTask(seed=2, size=4, tokenizer=tokenizer, max_prompt_tokens=10).prompt(0)


def test_data_max_prompts_cuts_gsm8k_to_its_first_prompts_so_they_recur():
    """data.max_prompts=8 with 2 prompts per step: the run sees GSM8K's first 8 questions, each
    once every 4 steps (the history source needs prompts that come back)."""
    from megatron_bubblespec.config import load_config
    from megatron_bubblespec.data.lookahead import LookaheadSampler
    from megatron_bubblespec.data.registry import task_from_config

    cfg = load_config(DEFAULT, ["data.max_prompts=8"])
    whole = task_from_config(load_config(DEFAULT, []), 49152)
    task = task_from_config(cfg, 49152)
    assert (task.size, whole.size) == (8, 7473)
    assert task.prompt(7) == whole.prompt(7)
    with pytest.raises(IndexError, match="out of range 0..7"):
        task.prompt(8)
    sampler = LookaheadSampler(cfg.run.seed, task.size, cfg.rollout.prompts_per_step, dp_size=2)
    steps = [sampler.batch(step).prompt_indices for step in range(16)]
    seen = [i for indices in steps for i in indices]
    assert sorted(seen) == sorted(list(range(8)) * 4)
    assert all(sorted(i for s in steps[4 * e:4 * e + 4] for i in s) == list(range(8))
               for e in range(4))


def test_data_max_prompts_must_not_be_negative():
    from megatron_bubblespec.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"data.max_prompts=-1 must be >= 0 \(0: every prompt"):
        load_config(DEFAULT, ["data.max_prompts=-1"])
