"""Typed Hydra configuration: schema, MTP-knob propagation, validation and loading."""

from skyrl_mtp.config.loader import compose_config, load_config, to_yaml
from skyrl_mtp.config.schema import SkyRLConfig
from skyrl_mtp.config.validation import validate_config
from skyrl_mtp.errors import ConfigError

__all__ = ["ConfigError", "SkyRLConfig", "compose_config", "load_config", "to_yaml",
           "validate_config"]
