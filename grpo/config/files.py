"""Reading recipes and `key=value` overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from grpo.config.base import ConfigError


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"recipe {str(path)!r} not found.")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"recipe {str(path)!r} is not valid YAML: {err}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"recipe {str(path)!r} must be a mapping of key: value lines.")
    return values


def parse_override(item: str) -> tuple[str, Any]:
    """`key=value` with the value parsed as YAML (so `beta=0`, `report_to=[]`, `lora_target_modules=[q_proj]`)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key=value.")
    key, raw = item.split("=", 1)
    key = key.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key, value
