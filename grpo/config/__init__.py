"""The one typed configuration of a `grpo` run.

Every setting is a field of `GRPOConfig` (grpo.config.schema) with its default and a one-line help text; the
reference documentation (`docs/config.md`, `grpo train --help-config`) is generated from these definitions, so it
cannot drift. TRL's and open-r1's keys are rows of one table (grpo.config.trl_keys, docs/from_trl.md). A config is
validated once, when it is built, and every error names the key.

A `preset` (grpo, dr_grpo, dapo, gspo, trl) is a starting point for every key not given, in a recipe, on the
command line or in the constructor: `GRPOConfig(preset="trl", ...)`.
"""

from grpo.config.base import DEFAULT_MODEL, ConfigError
from grpo.config.files import parse_override, read_yaml
from grpo.config.presets import ALIASES, LOSS_TYPES, PRESETS
from grpo.config.schema import GRPOConfig

from_trl = GRPOConfig.from_trl


def config_reference() -> str:
    from grpo.config.reference import config_reference as reference

    return reference()


__all__ = ["ALIASES", "DEFAULT_MODEL", "LOSS_TYPES", "PRESETS", "ConfigError", "GRPOConfig", "config_reference",
           "from_trl", "parse_override", "read_yaml"]
