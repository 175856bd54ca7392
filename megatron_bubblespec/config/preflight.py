"""Validated Config -> the model directory, dataset rows and prompt lengths checked, or one PreflightError saying what to fix.

``preflight(cfg)`` runs in the launching process after ``load_config`` and before any rank
starts, so a bad input costs seconds, not a launch. It reads files and tokenizes prompts but loads
no weights:

1. the model: ``tiny`` needs nothing; ``smollm2`` must be installed (it is converted on first use,
   as the ranks would do); a directory must be complete (``models.architecture.check_checkpoint``:
   config.json with a supported architecture, every weight shard, and for the chat tasks the
   tokenizer files and a chat template), and model.max_model_len must fit its position embeddings;
2. the data: the task is built once, which validates every row of a dataset file (``data.jsonl``:
   the first bad row, what is wrong, how many are bad), and it must hold at least
   rollout.prompts_per_step prompts;
3. the prompts: every prompt of a dataset file (the first ``GENERATED_PROMPTS_CHECKED`` of a
   generated task) must fit data.max_prompt_tokens (``data.tasks.check_prompt_lengths``) and use
   only token ids the model's vocabulary has.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_bubblespec.config.load import ConfigError
from megatron_bubblespec.config.schema import Config

CHAT_TASKS = ("arithmetic", "gsm8k", "jsonl")        # data.task values that need a tokenizer
FILE_TASKS = ("gsm8k", "jsonl")                      # every prompt is checked
GENERATED_PROMPTS_CHECKED = 4096


class PreflightError(ConfigError):
    """An input (model directory, dataset, prompt length) that would stop the run once started."""


@dataclass(frozen=True)
class PreflightReport:
    model_dir: Path | None        # the checkpoint directory (None for model.path=tiny)
    vocab_size: int
    num_prompts: int              # the task's size
    prompts_checked: int
    longest_prompt: int           # tokens


def preflight(cfg: Config) -> PreflightReport:
    """Check the model directory, the dataset rows and the prompt lengths of ``cfg``; raise
    PreflightError (a ConfigError) naming the problem and its fix, else report what was checked."""
    from megatron_bubblespec.data.tasks import check_prompt_lengths

    model_dir, vocab_size, max_positions = _check_model(cfg)
    if cfg.model.max_model_len > max_positions:
        raise PreflightError(
            f"model.max_model_len={cfg.model.max_model_len} exceeds the model's "
            f"max_position_embeddings={max_positions} (config.json of {model_dir}); lower "
            f"model.max_model_len to at most {max_positions}")
    task = _build_task(cfg, vocab_size)
    if task.size < cfg.rollout.prompts_per_step:
        raise PreflightError(
            f"{_source(cfg)} has {task.size} prompt(s), fewer than rollout.prompts_per_step="
            f"{cfg.rollout.prompts_per_step}; add prompts or lower rollout.prompts_per_step")
    count = task.size if cfg.data.task in FILE_TASKS else min(task.size, GENERATED_PROMPTS_CHECKED)
    prompts = _prompts(cfg, task, count)
    limit = cfg.data.max_prompt_tokens
    try:
        longest = check_prompt_lengths(task, limit, range(count))
    except ValueError as error:
        where = (f" (uid jsonl-N is line N of {cfg.data.path})" if cfg.data.task == "jsonl" else "")
        raise PreflightError(
            f"data.max_prompt_tokens={limit}: {error}{where}. Longer prompts need "
            f"data.max_prompt_tokens + rollout.max_new_tokens <= model.max_model_len (now {limit} "
            f"+ {cfg.rollout.max_new_tokens} <= {cfg.model.max_model_len})") from None
    _check_vocab(cfg, task, prompts, vocab_size)
    return PreflightReport(model_dir, vocab_size, task.size, count, longest)


def _check_model(cfg: Config) -> tuple[Path | None, int, int]:
    """(directory, vocab size, max positions) of model.path, after checking the directory."""
    m = cfg.model
    if m.path == "tiny":
        return None, m.tiny_vocab_size, max(m.max_model_len, 1024)
    from megatron_bubblespec.models.architecture import CheckpointError, check_checkpoint

    if m.path == "smollm2":
        from megatron_bubblespec.models.smollm2 import smollm2_checkpoint

        try:
            path = smollm2_checkpoint()
        except FileNotFoundError as error:
            raise PreflightError(f"model.path=smollm2: {error}") from None
    else:
        path = Path(m.path)
    try:
        spec = check_checkpoint(path, tokenizer=cfg.data.task in CHAT_TASKS)
    except CheckpointError as error:
        raise PreflightError(f"model.path={m.path!r}: {error}") from None
    return path, spec.vocab_size, spec.max_position_embeddings


def _build_task(cfg: Config, vocab_size: int):
    """The run's task, built as the ranks build it (``data.tasks.task_from_config``)."""
    from megatron_bubblespec.data.jsonl import DatasetError
    from megatron_bubblespec.data.tasks import task_from_config

    try:
        return task_from_config(cfg, vocab_size)
    except DatasetError as error:          # its message names the file
        key = "data.path" if cfg.data.task == "jsonl" else f"data.task={cfg.data.task}"
        raise PreflightError(f"{key}: {error}") from None
    except (ValueError, OSError) as error:
        raise PreflightError(f"data.task={cfg.data.task} with model.path={cfg.model.path!r}: "
                             f"{error}") from None


def _prompts(cfg: Config, task, count: int) -> list:
    """The first ``count`` prompts, tokenized; PreflightError if formatting one fails."""
    prompts = []
    for index in range(count):
        try:
            prompts.append(task.prompt(index))
        except Exception as error:    # the tokenizer's own error: chat template, encoding
            raise PreflightError(
                f"{_source(cfg)}: formatting prompt {index} with the tokenizer of model.path="
                f"{cfg.model.path!r} failed ({type(error).__name__}: {error}); check the "
                "model's tokenizer files and chat template") from None
    return prompts


def _check_vocab(cfg: Config, task, prompts: list, vocab_size: int) -> None:
    """Every prompt token and the task's EOS ids must be ids of the model's vocabulary."""
    top, uid = max([(max(p.token_ids, default=0), repr(p.uid)) for p in prompts]
                   + [(max(task.eos_token_ids), "the EOS token")])
    if top >= vocab_size:
        fix = ("use data.task=synthetic with model.path=tiny, or model.path=smollm2 for the "
               "chat tasks" if cfg.model.path == "tiny" else
               "the tokenizer and config.json's vocab_size disagree: make them match (resize "
               "the embeddings after adding tokens)")
        raise PreflightError(
            f"data.task={cfg.data.task}: token id {top} (in prompt {uid}) is outside the model's "
            f"vocabulary of {vocab_size} tokens (model.path={cfg.model.path!r}); {fix}")


def _source(cfg: Config) -> str:
    return f"data.path={cfg.data.path!r}" if cfg.data.task == "jsonl" else \
        f"data.task={cfg.data.task}"
