"""Constructing a `GRPOConfig`: aliases, TRL's keys, the preset for every key not given, then the fields.

`GRPOConfig(...)`, `from_dict`, `load` and a `trl.GRPOConfig` passed as `args` (`trl_values`) all come here, so a key
means the same whichever way it arrives. The keys given are remembered (`_explicit`): a preset fills only the others,
and `loss_type` yields to an aggregation or surrogate set by hand.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
from typing import Any

from grpo.config.base import ConfigError
from grpo.config.presets import ALIASES, PRESETS
from grpo.config.trl_fields import NAMES as TRL_FIELDS
from grpo.config.trl_fields import check_together, from_text
from grpo.config.trl_keys import TRL_KEYS, canonical, split_keys


def construct(cfg, args: tuple, kwargs: dict[str, Any]) -> None:
    if args:  # TRL's GRPOConfig takes output_dir first
        if len(args) > 1 or "output_dir" in kwargs:
            raise TypeError("GRPOConfig takes output_dir as its only positional argument; give the rest by name")
        kwargs = {"output_dir": args[0], **kwargs}
    fields = {f.name: f for f in dataclasses.fields(type(cfg))}
    values = _own_aliases(from_text(_as_given(dict(kwargs), fields)))
    values, extras, rewards = split_keys(values, set(fields))
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"unknown config key {unknown[0]!r}" + _suggest(unknown[0], set(fields) | set(TRL_KEYS)) +
                          "; `grpo train --help-config` lists every key (docs/from_trl.md: TRL's and open-r1's).")
    explicit = frozenset(values)
    preset = values.get("preset")
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"preset: unknown value {preset!r}; choose one of {', '.join(PRESETS)}.")
        hand_loss = bool({"loss_aggregation", "surrogate"} & explicit)
        for key, value in PRESETS[preset].items():
            if key not in explicit and not (key == "loss_type" and hand_loss):
                values[key] = copy.deepcopy(value)
    if rewards:
        values["open_r1_rewards"] = {**(values.get("open_r1_rewards") or {}), **rewards}
    cfg.__dict__["_explicit"] = explicit
    cfg.__dict__["_trl_extras"] = extras
    check_together(cfg)
    for name, f in fields.items():
        if name not in TRL_FIELDS:  # (TRL's keys read through their row: grpo.config.trl_fields)
            setattr(cfg, name, canonical(values[name] if name in values else _default(f)))
    cfg.__post_init__()


def _as_given(values: dict[str, Any], fields: dict[str, dataclasses.Field]) -> dict[str, Any]:
    """The keys the user set. An argument parser (`HfArgumentParser`, `TrlParser`) passes every field it shows
    (those with init=True), defaults included (and `dataclasses.replace` does too): then a key at its field's default
    counts as not set, so a `preset` and `loss_type` behave as they do for `GRPOConfig(...)` (a parser cannot tell
    `--key <default>` from no flag), and a TRL key's alias at its default does not clash with our key."""
    if set(values) != {name for name, f in fields.items() if f.init}:
        return values
    return {key: value for key, value in values.items() if not _same_value(value, _default(fields[key]))}


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _own_aliases(values: dict[str, Any]) -> dict[str, Any]:
    for alias, key in ALIASES.items():
        if alias in values:
            if key in values:
                raise ConfigError(f"both {alias!r} and {key!r} are set; they are the same setting, keep one.")
            values[key] = values.pop(alias)
    return _sequence_parallel_of(values)


def _sequence_parallel_of(values: dict[str, Any]) -> dict[str, Any]:
    """accelerate's `parallelism_config` (TRL's TrainingArguments key) holding only `sp_size` (its backend
    "deepspeed": ALST/Ulysses, the same splitting) becomes sequence_parallel_size; any other size (cp_size: ring
    attention, tp_size, dp sizes) stays for TRL's row of that key to refuse."""
    config = values.get("parallelism_config")
    if not isinstance(config, dict) or config.get("sp_backend") not in (None, "deepspeed"):
        return values
    others = {k: v for k, v in config.items()
              if k not in ("sp_size", "sp_backend", "sp_handler") and v not in (None, 1)}
    if others or config.get("sp_size") in (None, 1):
        return values
    if values.get("sequence_parallel_size", config["sp_size"]) != config["sp_size"]:
        raise ConfigError("both 'parallelism_config.sp_size' and 'sequence_parallel_size' are set; they are the same "
                          "setting, keep one.")
    values.pop("parallelism_config")
    values["sequence_parallel_size"] = config["sp_size"]
    return values


def _suggest(name: str, known: set[str]) -> str:
    close = difflib.get_close_matches(name, sorted(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def trl_values(args, ours: set[str]) -> dict[str, Any]:
    """The keys of a `trl.GRPOConfig` (or a subclass, such as open-r1's) to build ours from (`GRPOConfig.from_trl`),
    TRL's values and meaning winning; `ours` are our config's field names.

    Every key is passed as given, except those TRL's own `__post_init__` derived rather than the user set (its
    `generation_batch_size`, `dataloader_pin_memory` under use_cpu, `accelerator_config`, ...): a fresh object of
    the same class built from the same few settings shows what TRL derives, and keys equal to it are left out
    (then grpo derives them the same way)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
    seeds = ("output_dir", "use_cpu", "bf16", "fp16", "per_device_train_batch_size", "gradient_accumulation_steps",
             "num_generations", "gradient_checkpointing")
    reference = type(args)(**{k: values[k] for k in seeds if k in values})
    # TRL resolves generation_batch_size = per_device_train_batch_size x processes x steps_per_generation in
    # either direction: steps_per_generation alone says it.
    values.pop("generation_batch_size", None)
    kept = {}
    for key, value in values.items():
        derived = _same_value(value, getattr(reference, key, object()))
        if derived and (key not in ours or key == "steps_per_generation"):
            continue  # derived by TRL (or TRL's default): grpo derives it the same way
        kept[key] = value
    return kept


def _same_value(a: Any, b: Any) -> bool:
    a, b = canonical(a), canonical(b)
    if hasattr(a, "to_dict") and hasattr(b, "to_dict"):
        return a.to_dict() == b.to_dict()
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # noqa: BLE001 - objects without a usable ==
        return False
