"""YAML file + dotted overrides (``spec.enabled=false``) -> validated ``Config``, or a ConfigError naming the key.

Merging is OmegaConf's, onto the structured schema (whose defaults are the main job), so unknown
keys and wrong types are caught by the schema itself; a file that is not YAML, or whose top level
is not a mapping of sections, is named with the line and column; choices, bounds and cross-field
rules are ``config.rules``. Runs before any process group starts; what needs the model or the data
themselves is checked by ``megatron_bubblespec.preflight``.
"""

from __future__ import annotations

import dataclasses
import io
import typing
import warnings
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_bubblespec.config.rules import VLLM_MAX_SPEC_TOKENS, ConfigError, validate
from megatron_bubblespec.config.schema import Config

__all__ = ["VLLM_MAX_SPEC_TOKENS", "ConfigError", "load_config", "to_yaml", "validate"]

# Keys that moved, old -> new: run directories written before and old commands still load (the
# value goes to the new key, with a warning naming it).
MOVED = {"spec.speculative_continuation": "ablation.speculative_continuation",
         "spec.reuse_draft_kv": "ablation.reuse_draft_kv",
         "ablation.proposal_sources": "spec.proposal_sources"}


def _friendly(err: OmegaConfBaseException, source: str) -> ConfigError:
    key = getattr(err, "full_key", None) or "?"
    msg = str(err).splitlines()[0]
    return ConfigError(f"{source}: invalid config key '{key}': {msg}")


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Schema defaults <- YAML file <- ``key=value`` overrides, then validation."""
    merged = OmegaConf.structured(Config)
    if path is not None:
        path = Path(path)
        try:
            merged = OmegaConf.merge(merged, _moved_keys(_read_file(path), str(path)))
        except OmegaConfBaseException as err:
            raise _friendly(err, str(path)) from None
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value "
                              "(for example spec.enabled=false)")
    overrides = [_moved_override(item) for item in overrides]
    try:
        merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
        for key, text in _text_overrides(overrides):
            OmegaConf.update(merged, key, text)
    except OmegaConfBaseException as err:
        raise _friendly(err, "command line") from None
    cfg: Config = OmegaConf.to_object(merged)
    cfg.config_path = str(path) if path is not None else None
    validate(cfg)
    return cfg


def _read_file(path: Path) -> DictConfig:
    """The config file's sections, or a ConfigError naming the file (and where YAML stopped)."""
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist (see configs/ for examples)")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeError) as err:
        raise ConfigError(f"config file {path} cannot be read ({err}); it must be a readable "
                          "UTF-8 YAML file") from None
    try:
        loaded = OmegaConf.load(io.StringIO(text))
    except yaml.YAMLError as err:
        raise _syntax_error(err, path) from None
    except OSError:              # what OmegaConf raises for a top level that is a single value
        loaded = None
    if not isinstance(loaded, DictConfig):
        shape = "a list" if loaded is not None else "a single value"
        raise ConfigError(f"{path}: the top level is {shape}; a config file is a mapping of "
                          "sections (run:, model:, rollout:, spec:, ...), each a mapping of keys")
    return loaded


def _moved_keys(loaded: DictConfig, source: str) -> DictConfig:
    """A file's sections with every key of ``MOVED`` under its new name."""
    sections = OmegaConf.to_container(loaded)
    for old, new in MOVED.items():
        (room, key), (new_room, new_key) = old.split("."), new.split(".")
        if isinstance(sections.get(room), dict) and key in sections[room]:
            sections.setdefault(new_room, {})[new_key] = sections[room].pop(key)
            warnings.warn(f"{source}: {old} is now {new}; rename it there", FutureWarning,
                          stacklevel=3)
    return OmegaConf.create(sections)


def _moved_override(item: str) -> str:
    key, _, value = item.partition("=")
    if key.strip() not in MOVED:
        return item
    new = MOVED[key.strip()]
    warnings.warn(f"command line: {key} is now {new}; use {new}={value}", FutureWarning,
                  stacklevel=3)
    return f"{new}={value}"


def _syntax_error(err: yaml.YAMLError, path: Path) -> ConfigError:
    mark = getattr(err, "problem_mark", None)
    where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    context = getattr(err, "context", None)
    start = getattr(err, "context_mark", None)
    if context and start is not None:
        problem += f" ({context} that starts at line {start.line + 1}, column {start.column + 1})"
    return ConfigError(f"{path}{where}: not valid YAML: {problem}; correct the file there")


def _text_overrides(overrides) -> list[tuple[str, str]]:
    """The overrides of text fields, with their text verbatim: ``run.name=off`` names a run "off"
    (the dotlist parser reads YAML, where off is the boolean false and 1e3 a float)."""
    out = []
    for item in overrides:
        key, _, text = item.partition("=")
        node, hint = Config, None
        for part in key.split("."):
            hints = typing.get_type_hints(node) if dataclasses.is_dataclass(node) else {}
            node = hint = hints.get(part)
        if hint in (str, typing.Optional[str]):
            out.append((key, text))
    return out


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
