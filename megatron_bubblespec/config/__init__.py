"""Configuration: YAML + dotted overrides -> validated typed Config (and a run's identity)."""

from megatron_bubblespec.config.identity import run_identity
from megatron_bubblespec.config.load import ConfigError, load_config, to_yaml, validate
from megatron_bubblespec.config.schema import Config

__all__ = ["Config", "ConfigError", "load_config", "run_identity", "to_yaml", "validate"]
