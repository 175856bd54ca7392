"""Tasks: prompt index -> Prompt (uid, token ids, reference answer, the task's own data);
responses -> rewards.

A task is the learner's whole view of the data: ``size`` prompts addressed by index (the lookahead
sampler chooses indices), each with a stable ``uid`` (it enters every sample key) and token ids,
and a ``reward`` that maps a response (token ids, EOS included when the engine stopped on one) to a
``RewardBreakdown``: a total and its named, weighted parts, which sum to the total. ``rewards`` is
the batch form the loop's reward stage calls (``score``: a task without it is scored one response
at a time). Tasks are registered, with what preflight needs to know of them, in
``data.registry``.

Four tasks here, a fifth (``data.code_task``: Python functions run against test cases) beside:

``SyntheticArithmeticTask`` (tiny random models, no tokenizer) works in token-id space: digit d is
token ``DIGIT0 + d``, then ``PLUS`` and ``EQUALS``; EOS is 2, as in ``make_tiny_checkpoint``. The
prompt ``a + b =`` is the digits of a, PLUS, the digits of b, EQUALS; the perfect response is the
digits of a + b, then EOS. Its reward is shaped so that a near-uniform random policy already gets
different rewards within a group of samples of one prompt (non-zero GRPO advantages). Over the
first L response tokens (L = number of answer digits; tokens from the first EOS on do not count)::

    correct  0.6 * (fraction of the L positions holding the right digit)
    close    0.3 * mean over the L positions of max(0, 1 - |token - right digit token| / 32)
    format   0.1 if the response stops with EOS at position L .. L + 2

A perfect response scores exactly 1.0. ``close`` is numeric closeness for digit tokens (they are
consecutive ids) and extends to the ids around them, so about one random token in six earns some
of it; ``correct`` then dominates once the policy writes digits.

``GSM8KTask``, ``ArithmeticWordTask`` ("What is 37 + 45?") and ``JsonlTask`` (a user's file of
questions and answers, see ``data.jsonl``) use a chat tokenizer (SmolLM2's by default). The user
message asks for the final answer on its own line after ``####``. Reward::

    correct  1.0 if the final answer equals the reference (math-verify, ``answers.is_correct``)
    format   0.2 if the answer is marked ("#### <number>" or "\\boxed{<number>}"),
             else 0.1 if the response stopped with EOS within the token budget

so a perfect response scores 1.2. A weak model rarely gets ``correct`` early on; ``format`` is what
varies within its groups until it does.

Every task takes ``max_prompt_tokens``: a longer prompt raises a ValueError naming its uid when it
is built. ``check_prompt_lengths`` runs that check over a whole task before training starts.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Protocol, Sequence, runtime_checkable

from megatron_bubblespec.data.answers import is_correct
from megatron_bubblespec.data.gsm8k import GSM8KRecord, load_gsm8k
from megatron_bubblespec.data.jsonl import JsonlRecord, load_jsonl
from megatron_bubblespec.splitmix import chain, splitmix64

# Token ids of the synthetic task (ids 0 and 1 are pad and bos of ``make_tiny_checkpoint``).
EOS_ID = 2
DIGIT0 = 3                 # digit d is token DIGIT0 + d (3..12)
PLUS = DIGIT0 + 10         # 13
EQUALS = DIGIT0 + 11       # 14

DEFAULT_INSTRUCTION = (
    "{question}\n\n"
    "Think step by step. Then write the final answer as a number on its own line, "
    "after \"####\", like this:\n#### <number>")


@dataclass(frozen=True)
class Prompt:
    uid: str                  # stable across runs; part of every sample key
    index: int                # position in its task
    token_ids: list[int]
    answer: str               # reference answer: a normalised number ("82"), or "" when the
    #                           task's data holds what a response is checked against
    text: str = ""            # readable question, for logs
    data: Mapping[str, object] = field(default_factory=dict)   # the task's own (JSON values)


@dataclass(frozen=True)
class RewardBreakdown:
    total: float
    parts: Mapping[str, float] = field(default_factory=dict)   # weighted; they sum to ``total``
    correct: bool = False     # the response holds the right answer (for accuracy metrics)
    outcome: str = ""         # how checking it went, when that can fail (``data.sandbox``)


@runtime_checkable
class Task(Protocol):
    name: str
    size: int                            # number of prompts; indices 0 .. size - 1
    eos_token_ids: tuple[int, ...]

    def prompt(self, index: int) -> Prompt: ...

    def reward(self, prompt: Prompt, response_token_ids: Sequence[int]) -> RewardBreakdown: ...


def score(task: Task, prompts: Sequence[Prompt],
          responses: Sequence[Sequence[int]]) -> list[RewardBreakdown]:
    """A batch's rewards: the task's ``rewards`` when it has one, else one ``reward`` a response."""
    batch = getattr(task, "rewards", None)
    if batch is not None:
        return list(batch(prompts, responses))
    return [task.reward(p, r) for p, r in zip(prompts, responses)]


def check_prompt_lengths(task: Task, max_prompt_tokens: int,
                         indices: Sequence[int] | None = None) -> int:
    """The longest prompt length over ``indices`` (default: all); ValueError naming the uid of the
    first prompt longer than ``max_prompt_tokens`` and how many are too long."""
    too_long: list[Prompt] = []
    longest = 0
    for index in range(task.size) if indices is None else indices:
        prompt = task.prompt(index)
        longest = max(longest, len(prompt.token_ids))
        if len(prompt.token_ids) > max_prompt_tokens:
            too_long.append(prompt)
    if too_long:
        first = too_long[0]
        raise ValueError(
            f"task {task.name!r}: prompt {first.uid!r} has {len(first.token_ids)} tokens, more "
            f"than max_prompt_tokens={max_prompt_tokens} ({len(too_long)} prompt(s) too long, longest "
            f"{longest}); raise max_prompt_tokens or drop these prompts")
    return longest


def _check_length(task_name: str, uid: str, token_ids: list[int], limit: int | None) -> None:
    if limit is not None and len(token_ids) > limit:
        raise ValueError(f"task {task_name!r}: prompt {uid!r} has {len(token_ids)} tokens, more "
                         f"than max_prompt_tokens={limit}; raise max_prompt_tokens or drop it")


def _check_index(task_name: str, index: int, size: int) -> int:
    if not 0 <= index < size:
        raise IndexError(f"task {task_name!r}: prompt index {index} out of range 0..{size - 1}")
    return int(index)


def _operands(seed: int, index: int, max_operand: int) -> tuple[int, int]:
    """Two operands in 0..max_operand, a pure function of (seed, index) (splitmix64 chain)."""
    h = chain(seed, index)
    first, second = splitmix64(h), splitmix64(h ^ 0xD1B54A32D192ED03)
    return first % (max_operand + 1), second % (max_operand + 1)


# ----------------------------------------------------------------------------- synthetic task

class SyntheticArithmeticTask:
    """``a + b =`` in token-id space for tiny random models (see the module docstring)."""

    name = "synthetic"
    WEIGHTS = {"correct": 0.6, "close": 0.3, "format": 0.1}
    CLOSE_WIDTH = 32          # token-id distance at which ``close`` credit reaches 0
    FORMAT_SLACK = 2          # EOS may come up to this many tokens after the answer

    def __init__(self, seed: int = 0, size: int = 1024, vocab_size: int = 256,
                 max_operand: int = 99, *, max_prompt_tokens: int | None = None):
        if vocab_size <= EQUALS:
            raise ValueError(f"vocab_size={vocab_size} too small: the synthetic task uses token "
                             f"ids up to {EQUALS}")
        if size < 1 or max_operand < 1:
            raise ValueError(f"size and max_operand must be >= 1, got {size} and {max_operand}")
        self.seed, self.size, self.vocab_size = seed, size, vocab_size
        self.max_operand, self.max_prompt_tokens = max_operand, max_prompt_tokens
        self.eos_token_ids = (EOS_ID,)

    @staticmethod
    def digits(number: int) -> list[int]:
        return [DIGIT0 + int(c) for c in str(number)]

    def prompt(self, index: int) -> Prompt:
        index = _check_index(self.name, index, self.size)
        a, b = _operands(self.seed, index, self.max_operand)
        uid = f"synth-{self.seed}-{index}"
        token_ids = self.digits(a) + [PLUS] + self.digits(b) + [EQUALS]
        _check_length(self.name, uid, token_ids, self.max_prompt_tokens)
        return Prompt(uid, index, token_ids, str(a + b), f"{a}+{b}=")

    def reward(self, prompt: Prompt, response_token_ids: Sequence[int]) -> RewardBreakdown:
        target = self.digits(int(prompt.answer))
        response = [int(t) for t in response_token_ids]
        stop = response.index(EOS_ID) if EOS_ID in response else None
        body = response[:stop] if stop is not None else response
        head = body[:len(target)]
        exact = sum(t == d for t, d in zip(head, target)) / len(target)
        close = sum(max(0.0, 1.0 - abs(t - d) / self.CLOSE_WIDTH)
                    for t, d in zip(head, target)) / len(target)
        stops = stop is not None and len(target) <= stop <= len(target) + self.FORMAT_SLACK
        parts = {"correct": self.WEIGHTS["correct"] * exact,
                 "close": self.WEIGHTS["close"] * close,
                 "format": self.WEIGHTS["format"] * float(stops)}
        right = head == target and (len(body) == len(target)
                                    or not DIGIT0 <= body[len(target)] < DIGIT0 + 10)
        return RewardBreakdown(math.fsum(parts.values()), parts, right)


# ----------------------------------------------------------------------------- chat tasks

_MARKED = re.compile(r"\s*\$?\s*-?\d")                                   # right after "####"
_BOXED_NUMBER = re.compile(r"\\boxed\{\s*\$?\s*-?\d[\d,]*(?:\.\d+)?\s*\}")


def has_marked_answer(text: str) -> bool:
    """Whether the text ends its reasoning in a parseable marked answer: a number right after the
    last "####", or a number alone in a ``\\boxed{}``."""
    if "####" in text and _MARKED.match(text.rsplit("####", 1)[1]):
        return True
    return _BOXED_NUMBER.search(text) is not None


class _ChatTask:
    """Questions -> chat-template prompts; decoded responses -> correctness + format reward."""

    name = "chat"
    CORRECT = 1.0
    MARKED = 0.2             # format part for a marked, parseable final answer
    STOPPED = 0.1            # format part for stopping with EOS only

    def __init__(self, tokenizer=None, *, system_prompt: str | None = None,
                 instruction: str = DEFAULT_INSTRUCTION, max_prompt_tokens: int | None = None):
        if tokenizer is None:
            from megatron_bubblespec.models.smollm2 import load_tokenizer
            tokenizer = load_tokenizer()
        # A ``SmolLM2Tokenizer`` named tuple, or a transformers tokenizer with an eos token.
        self.tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            raise ValueError("the tokenizer has no eos_token_id; the chat tasks need one")
        if "{question}" not in instruction:
            raise ValueError(f"instruction must contain '{{question}}', got {instruction!r}")
        self.eos_token_ids = (int(eos),)
        self.system_prompt, self.instruction = system_prompt, instruction
        self.max_prompt_tokens = max_prompt_tokens
        self._cache: dict[int, Prompt] = {}

    def _question(self, index: int) -> tuple[str, str, str]:
        """(uid, question, reference answer) of prompt ``index``."""
        raise NotImplementedError

    def _data(self, index: int) -> dict:
        """The task's own data of prompt ``index`` (``Prompt.data``); none by default."""
        return {}

    def encode(self, question: str) -> list[int]:
        """The chat-template token ids of one question, ending in the assistant turn's header."""
        messages = [{"role": "user", "content": self.instruction.format(question=question)}]
        if self.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt(self, index: int) -> Prompt:
        index = _check_index(self.name, index, self.size)
        if index not in self._cache:
            uid, question, answer = self._question(index)
            token_ids = self.encode(question)
            self._cache[index] = Prompt(uid, index, token_ids, answer, question,
                                        self._data(index))
        prompt = self._cache[index]
        _check_length(self.name, prompt.uid, prompt.token_ids, self.max_prompt_tokens)
        return prompt

    def decode(self, response_token_ids: Sequence[int]) -> tuple[str, bool]:
        """(text up to the first EOS, whether there was an EOS)."""
        ids = [int(t) for t in response_token_ids]
        stops = [i for i, t in enumerate(ids) if t in self.eos_token_ids]
        if stops:
            ids = ids[:stops[0]]
        return self.tokenizer.decode(ids, skip_special_tokens=True), bool(stops)

    def reward(self, prompt: Prompt, response_token_ids: Sequence[int]) -> RewardBreakdown:
        text, stopped = self.decode(response_token_ids)
        return self.reward_text(prompt, text, stopped)

    def reward_text(self, prompt: Prompt, text: str, stopped: bool) -> RewardBreakdown:
        """The reward of a decoded response; ``stopped``: it ended with EOS within the budget."""
        right = is_correct(text, prompt.answer)
        form = self.MARKED if has_marked_answer(text) else self.STOPPED if stopped else 0.0
        parts = {"correct": self.CORRECT * right, "format": form}
        return RewardBreakdown(math.fsum(parts.values()), parts, right)


class GSM8KTask(_ChatTask):
    """GSM8K word problems (``data.gsm8k``) as chat prompts."""

    name = "gsm8k"

    def __init__(self, split: str = "train", tokenizer=None, *, path: str | Path | None = None,
                 system_prompt: str | None = None, instruction: str = DEFAULT_INSTRUCTION,
                 max_prompt_tokens: int | None = None):
        super().__init__(tokenizer, system_prompt=system_prompt, instruction=instruction,
                         max_prompt_tokens=max_prompt_tokens)
        self.split = split
        self.records: list[GSM8KRecord] = load_gsm8k(split, path)
        self.size = len(self.records)

    def _question(self, index: int) -> tuple[str, str, str]:
        record = self.records[index]
        return record.uid, record.question, record.answer


class ArithmeticWordTask(_ChatTask):
    """"What is a + b?" as chat prompts: easier than GSM8K, same reward shape."""

    name = "arithmetic"

    def __init__(self, seed: int = 0, size: int = 1024, tokenizer=None, *, max_operand: int = 99,
                 system_prompt: str | None = None, instruction: str = DEFAULT_INSTRUCTION,
                 max_prompt_tokens: int | None = None):
        super().__init__(tokenizer, system_prompt=system_prompt, instruction=instruction,
                         max_prompt_tokens=max_prompt_tokens)
        if size < 1 or max_operand < 1:
            raise ValueError(f"size and max_operand must be >= 1, got {size} and {max_operand}")
        self.seed, self.size, self.max_operand = seed, size, max_operand

    def _question(self, index: int) -> tuple[str, str, str]:
        a, b = _operands(self.seed, index, self.max_operand)
        return f"arith-{self.seed}-{index}", f"What is {a} + {b}?", str(a + b)


class JsonlTask(_ChatTask):
    """A user's JSONL file of questions and answers (``data.jsonl``) as chat prompts, rewarded
    like GSM8K. Every row is validated when the task is built; uids are ``jsonl-<line number>``."""

    name = "jsonl"

    def __init__(self, path: str | Path, tokenizer=None, *, system_prompt: str | None = None,
                 instruction: str = DEFAULT_INSTRUCTION, max_prompt_tokens: int | None = None):
        self.path = Path(path)
        self.records: list[JsonlRecord] = load_jsonl(self.path)   # before the tokenizer: fail fast
        self.size = len(self.records)
        super().__init__(tokenizer, system_prompt=system_prompt, instruction=instruction,
                         max_prompt_tokens=max_prompt_tokens)

    def _question(self, index: int) -> tuple[str, str, str]:
        record = self.records[index]
        return record.uid, record.question, record.answer
