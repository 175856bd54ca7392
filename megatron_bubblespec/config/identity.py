"""Config -> the YAML of what a run's tokens, counts and rollout work depend on (its identity).

Two configs with the same identity make the same run: a finished run can stand in for another.
The keys left out are declared in the schema beside each key (field metadata ``OBSERVER``: no run
depends on them; ``OFF_RUN``: a run with BubbleSpec off does not either). A run with BubbleSpec off
reads nothing of ``spec`` but ``spec.enabled``, and nothing of ``ablation``: every other key of
theirs is gated on it.
"""

from __future__ import annotations

import dataclasses

from megatron_bubblespec.config.load import to_yaml
from megatron_bubblespec.config.schema import OBSERVER, OFF_RUN, AblationConfig, Config, SpecConfig


def neutral_keys(spec_enabled: bool) -> dict[str, tuple[str, ...]]:
    """Room -> the keys a run with BubbleSpec on (or off) does not depend on."""
    kinds = [OBSERVER] if spec_enabled else [OBSERVER, OFF_RUN]
    rooms, defaults = {}, Config()
    for room in dataclasses.fields(Config):
        section = getattr(defaults, room.name)
        if not dataclasses.is_dataclass(section):
            continue
        keys = tuple(f.name for f in dataclasses.fields(section) if dict(f.metadata) in kinds)
        if keys:
            rooms[room.name] = keys
    return rooms


def run_identity(cfg: Config) -> str:
    """The config as the run reads it, in YAML: the keys that cannot change its records set to
    their defaults (with ``spec.enabled=false`` also every ``spec`` key but ``enabled``, every
    ``ablation`` key and the ``OFF_RUN`` keys)."""
    if not cfg.spec.enabled:
        cfg = dataclasses.replace(cfg, spec=SpecConfig(enabled=False), ablation=AblationConfig())
    for room, keys in neutral_keys(cfg.spec.enabled).items():
        section = getattr(cfg, room)
        defaults = type(section)()
        cfg = dataclasses.replace(cfg, **{room: dataclasses.replace(
            section, **{key: getattr(defaults, key) for key in keys})})
    return to_yaml(cfg)
