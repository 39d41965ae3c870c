"""What every part of the config package shares: the error type, the field helper and the shipped models' paths."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import field
from pathlib import Path
from typing import Any

ASSETS = Path(__file__).parent.parent / "assets"
DEFAULT_MODEL = str(ASSETS / "tiny-arith")
SHIPPED_MODELS = ("tiny-arith", "tiny-tools", "tiny-vision", "tiny-moe")
"""Models shipped in the package, which `model_name_or_path` (and `grpo eval --model`) may name by their name alone."""


def shipped_model(name: str) -> str:
    """The path of the shipped model `name` names, when no local directory of that name exists; else name."""
    return str(ASSETS / name) if name in SHIPPED_MODELS and not Path(name).exists() else name


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


# Annotations of GRPOConfig's fields, in the forms argument parsers read (HfArgumentParser, TrlParser):
Kwargs = dict[str, Any] | str | None
"""A mapping of settings, or its JSON text (how argument parsers give it, as transformers' TrainingArguments)."""
Names = list[str] | str
Paths = dict[str, str] | str | None
Specs = list[str | dict[str, Any] | Callable]

SCRIPT_KEYS = ("dataset_name", "dataset_config", "dataset_streaming", "model_name_or_path", "model_revision",
               "attn_implementation", "use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules",
               "lora_target_parameters", "lora_modules_to_save", "use_rslora", "use_dora", "load_in_4bit",
               "bnb_4bit_quant_type", "use_bnb_nested_quant", "reward_funcs")
"""Keys that TRL's scripts take from other dataclasses (`ScriptArguments`, `ModelConfig`, the scripts' own
`reward_funcs`) and hand to the trainer as its arguments. They are marked `init=False`, which is what
`HfArgumentParser` / `TrlParser` read to leave a field out, so `TrlParser((ScriptArguments, GRPOConfig,
ModelConfig))` defines each option once; `GRPOConfig(...)`, recipes and `grpo train` take them as any other key."""
