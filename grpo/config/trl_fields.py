"""TRL's and open-r1's config keys that are not settings of grpo (the alias, default and noop rows of
grpo.config.trl_keys for TRL's `GRPOConfig`, `TrainingArguments` and open-r1's `GRPOConfig`), as fields of a base of
`GRPOConfig`, so that argument parsers (`HfArgumentParser`, `TrlParser`) take them: a script's `--do_eval`, or a
recipe's `do_eval: false` under `parse_args_and_config(fail_with_unknown_args=True)`, is an option as in TRL.

Each field reads and writes through the table's row: an alias reads and sets our key of the same meaning, a key
accepted only at TRL's default refuses another value with the row's reason, a no-effect key checks its value as TRL
does. Their values live in the config's `_trl_extras` (grpo.config.build); `settings()` are the fields that are
grpo's own (docs/config.md, `--print-config`, validation), `to_dict()` writes these and the TRL keys set.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any, Union

from grpo.config.base import ConfigError, Kwargs
from grpo.config.trl_keys import TABLE, TRL_KEYS, accepted_default, canonical, split_keys

PARSER_SOURCES = ("trl", "ta", "open-r1")
SCRIPT_SIDE = ("dataset_prompt_column", "dataset_mixture")  # open-r1's (and TRL's) script arguments, not its config

# Annotations as TRL 1.16 gives them, where the default does not say the type (enums and accelerate's classes as
# the text a parser reads; a mapping as its JSON text).
TYPES: dict[str, Any] = {
    "num_generations_eval": int | None, "vllm_importance_sampling_cap": float | None, "pad_to_multiple_of":
    int | str | None, "activation_checkpointing": bool | None, "optim_target_modules": Union[None, str, list[str]],
    "label_smoothing_factor": float, "eval_delay": float, "include_num_input_tokens_seen": str | bool,
    "neftune_noise_alpha": float | None, "torch_empty_cache_steps": int | None, "eval_accumulation_steps": int | None,
    "include_for_metrics": list[str], "greater_is_better": bool | None, "label_names": list[str] | None,
    "ddp_find_unused_parameters": bool | None, "ddp_bucket_cap_mb": int | None, "ddp_broadcast_buffers": bool | None,
    "ddp_static_graph": bool | None, "dataloader_prefetch_factor": int | None, "benchmarks": list[str],
    "callbacks": list[str], "debug": str | list[str], "fsdp": str | None,
}
for _name in ("transformers_continuous_batching_config", "activation_checkpointing_kwargs", "liger_kernel_config",
              "parallelism_config", "fsdp_config", "deepspeed", "accelerator_config"):
    TYPES[_name] = Kwargs

ROWS = [row for row in TABLE if row.kind in ("alias", "default", "noop") and row.source in PARSER_SOURCES
        and row.name not in SCRIPT_SIDE]
NAMES = frozenset(row.name for row in ROWS)


def _annotation(row) -> Any:
    if row.name in TYPES:
        return TYPES[row.name]
    if row.default is None:
        return str | None
    return type(row.default)


def _help(row) -> str:
    kind = {"alias": f"{row.source}'s name for {row.target}", "default": "accepted at TRL's default only",
            "noop": "accepted, no effect here"}[row.kind]
    return f"TRL's key, {kind}" + (f": {row.note}" if row.note else "") + " (docs/from_trl.md)."


def _field(row) -> dataclasses.Field:
    meta = {"help": _help(row)}
    if isinstance(row.default, (list, dict)):
        return dataclasses.field(default_factory=lambda d=row.default: copy.deepcopy(d), repr=False, metadata=meta)
    return dataclasses.field(default=row.default, repr=False, metadata=meta)


def _property(name: str) -> property:
    def read(cfg):
        return accepted_default(cfg, name)

    def write(cfg, value):
        ours, extras, _ = split_keys(from_text({name: value}), set())
        for key, given in ours.items():  # an alias: our key of the same meaning
            setattr(cfg, key, given)
        cfg.__dict__.setdefault("_trl_extras", {}).update(extras)

    return property(read, write, doc=_help(TRL_KEYS[name]))


class _Base:
    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A `@dataclass` subclass of GRPOConfig (open-r1's adds its keys so) is built as GRPOConfig is: dataclass()
        does not replace an `__init__` the class has, so it keeps GRPOConfig's (aliases, TRL's keys, validation)."""
        super().__init_subclass__(**kwargs)
        if "__init__" not in cls.__dict__:
            cls.__init__ = cls.__init__

    # transformers' TrainingArguments reads that scripts call (open-r1's grpo.py logs them)
    def get_process_log_level(self) -> int:
        """The logging level of this process: log_level on the main process, log_level_replica on the others;
        passive: transformers' current verbosity (TrainingArguments')."""
        import logging
        import os

        from transformers.utils import logging as hf_logging

        level = self.log_level if int(os.environ.get("RANK", "0")) == 0 else self.log_level_replica
        return hf_logging.get_verbosity() if level == "passive" else getattr(logging, level.upper())

    @property
    def device(self):
        """The device this process trains on (accelerate's, as TrainingArguments'; the CPU under use_cpu)."""
        from accelerate import PartialState

        return PartialState(cpu=self.use_cpu).device

    @property
    def n_gpu(self) -> int:
        """GPUs this process uses: 1 on a GPU, 0 on the CPU (grpo does not split a batch over GPUs in one
        process, so never more, as TrainingArguments' under distributed training)."""
        return int(self.device.type == "cuda")

    def to_dict(self) -> dict[str, Any]:
        """grpo's settings, then the TRL keys set to other than TRL's default (config.yaml, dashboards' config)."""
        return {**{f.name: copy.deepcopy(getattr(self, f.name)) for f in settings(self)}, **set_values(self)}


TrlKeys = dataclasses.make_dataclass("TrlKeys", [(row.name, _annotation(row), _field(row)) for row in ROWS],
                                     bases=(_Base,), init=False, repr=False, eq=False)
TrlKeys.__module__ = __name__
TrlKeys.__doc__ = "TRL's and open-r1's keys that grpo takes but has no setting of its own for (module docstring)."
for _row in ROWS:  # (after the dataclass has read each field's default from the class)
    setattr(TrlKeys, _row.name, _property(_row.name))


def from_text(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with the mapping keys among these given as JSON text (how a parser gives them) read as mappings."""
    out = dict(values)
    for key, value in values.items():
        if key in NAMES and TYPES.get(key) is Kwargs and isinstance(value, str) and value.lstrip().startswith("{"):
            try:
                out[key] = json.loads(value)
            except ValueError:
                raise ConfigError(f"{key}: expected a mapping (or its JSON text), got {value!r}.") from None
    return out


def settings(cls_or_cfg) -> list[dataclasses.Field]:
    """The fields that are grpo's settings: every field but TRL's keys above."""
    return [f for f in dataclasses.fields(cls_or_cfg) if f.name not in NAMES]


def set_values(cfg) -> dict[str, Any]:
    """The TRL keys of `cfg` set to other than TRL's default, by name, in the table's order (for config.yaml)."""
    extras = cfg.__dict__.get("_trl_extras", {})
    return {row.name: canonical(extras[row.name]) for row in TABLE
            if row.name in extras and canonical(extras[row.name]) != canonical(row.default)}


def check_together(cfg) -> None:
    """transformers' rule across two of these keys (TrainingArguments.__post_init__)."""
    if cfg.dataloader_prefetch_factor is not None and not cfg.dataloader_num_workers:
        raise ConfigError("dataloader_prefetch_factor: can only be set when data is loaded in a different process, "
                          "i.e. when dataloader_num_workers > 0 (transformers' rule).")
