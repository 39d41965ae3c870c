"""Reading recipes and `key=value` overrides."""

from __future__ import annotations

from enum import Enum
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


def plain(value: Any) -> Any:
    """`value` as YAML can write it: mappings and sequences walked, and any other object by its name: a torch
    dtype as `float32` (what `dtype` keys accept), an enum as its value, a class or function as `module:name` (an
    import path, as reward functions are given), anything else as its text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    if isinstance(value, Enum):
        return plain(value.value)
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return str(value).removeprefix("torch.")
    if hasattr(value, "__qualname__") and hasattr(value, "__module__"):
        return f"{value.__module__}:{value.__qualname__}"
    return str(value)
