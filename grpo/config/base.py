"""What every part of the config package shares: the error type, the field helper and the shipped model's path."""

from __future__ import annotations

from dataclasses import field
from pathlib import Path
from typing import Any

DEFAULT_MODEL = str(Path(__file__).parent.parent / "assets" / "tiny-arith")


class ConfigError(ValueError):
    """A bad key or value in a config. The message names the key and says what to do."""


def _f(default: Any, help: str, choices: tuple | None = None, **kwargs: Any) -> Any:
    """A config field: its default, a one-line help text and, for a closed set of values, the choices."""
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta, **kwargs)
    return field(default=default, metadata=meta, **kwargs)


def check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")
