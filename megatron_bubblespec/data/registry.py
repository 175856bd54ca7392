"""``data.task`` names -> how each task is built from a run config, and what preflight needs to know
of it: the one place a task is registered.

Adding a task: a class with the ``data.tasks.Task`` protocol, and one ``register_task`` below.
Preflight reads this table (the name, which tasks read ``data.path``, which need the model's
tokenizer, which have every prompt checked); the config package sits below it and does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from megatron_bubblespec.data.code_task import CodeTask
from megatron_bubblespec.data.tasks import (ArithmeticWordTask, GSM8KTask, JsonlTask,
                                            SyntheticArithmeticTask, Task)
from megatron_bubblespec.registry import Registry

BUILTIN_MODELS = ("tiny", "smollm2")       # model.path values that are not a directory


@dataclass(frozen=True)
class TaskEntry:
    name: str                                    # the data.task value
    cls: type                                    # its class (``make_task``)
    build: Callable[[Any, int, Any], Task]       # (cfg, vocab_size, tokenizer or None) -> task
    chat: bool = True          # chat prompts: needs the model's tokenizer
    path: str = "never"        # data.path: "never" read, "optional" or "required"
    finite: bool = False       # prompts from a dataset (preflight checks every one), not generated
    #                            (a task that reads data.path is finite when it is set)
    summary: str = ""


TASKS = Registry("task")


def register_task(entry: TaskEntry) -> TaskEntry:
    return TASKS.register(entry.name, entry)


def task_entry(name: str) -> TaskEntry:
    return TASKS.entry(name)


def make_task(name: str, **kwargs) -> Task:
    """The task ``name`` (a data.task value) built directly from its class's ``kwargs``."""
    return task_entry(name).cls(**kwargs)


def task_from_config(cfg, vocab_size: int) -> Task:
    """The task of a run's config (``cfg.data``, ``cfg.run.seed``) for a model of ``vocab_size``
    tokens, cut to its first ``data.max_prompts`` prompts when that is set. The chat tasks use
    the tokenizer of model.path when it is a checkpoint directory, SmolLM2's for
    model.path=smollm2 (and tiny)."""
    entry = task_entry(cfg.data.task)
    tokenizer = None
    if entry.chat and cfg.model.path not in BUILTIN_MODELS:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    task = entry.build(cfg, vocab_size, tokenizer)
    if cfg.data.max_prompts:
        task.size = min(task.size, cfg.data.max_prompts)  # every task indexes prompts < size
    return task


def finite(cfg) -> bool:
    """Whether the run's prompts come from a dataset (preflight checks every one)."""
    entry = task_entry(cfg.data.task)
    return entry.finite or (entry.path != "never" and bool(cfg.data.path))


register_task(TaskEntry(
    "synthetic", SyntheticArithmeticTask, lambda cfg, vocab, _: SyntheticArithmeticTask(
        seed=cfg.run.seed, size=cfg.data.size, vocab_size=vocab), chat=False,
    summary="a + b = in token ids, for tiny random models"))
register_task(TaskEntry(
    "arithmetic", ArithmeticWordTask, lambda cfg, _, tok: ArithmeticWordTask(
        seed=cfg.run.seed, size=cfg.data.size, tokenizer=tok),
    summary='"What is a + b?" as chat prompts'))
register_task(TaskEntry(
    "gsm8k", GSM8KTask, lambda cfg, _, tok: GSM8KTask(split=cfg.data.split, tokenizer=tok),
    finite=True, summary="GSM8K word problems"))
register_task(TaskEntry(
    "jsonl", JsonlTask, lambda cfg, _, tok: JsonlTask(path=cfg.data.path, tokenizer=tok),
    path="required", finite=True, summary="a JSONL file of questions and numeric answers"))
register_task(TaskEntry(
    "code", CodeTask, lambda cfg, _, tok: CodeTask(
        seed=cfg.run.seed, size=cfg.data.size, tokenizer=tok, path=cfg.data.path or None,
        time_limit_s=cfg.data.reward_time_limit_s), path="optional",
    summary="Python functions run against test cases in a sandbox (generated, or a JSONL file)"))
