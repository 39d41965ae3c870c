"""From a config entry to a named reward function: one explicit table, plus import paths and checkpoints.

A spec is one of:
- a built-in name (`"think_format"`) or an open-r1 alias (`"accuracy"`, `"format"`);
- `"package.module:function"`, imported (a user's file on `sys.path`);
- a local directory holding a sequence-classification checkpoint (`config.json`), loaded as a `RewardModel`;
- an http(s) URL: a reward model behind a server in OpenRLHF's remote_rm_url protocol (`RemoteRewardModel`);
- a callable, named by its `__name__`;
- a dict `{"name": <one of the above>, **settings}`: the settings configure a built-in (`countdown` with
  `exact_use: true`), are passed to `RewardModel` for a checkpoint, or, for an imported object, are passed to it as
  a factory (`mymodule:get_cosine_scaled_reward` with `max_len: 500`, open-r1 style).
"""

import importlib
import inspect
import os
from collections.abc import Callable
from typing import Any

from .base import ConfigurableReward
from .coding import code, code_syntax
from .competitive import cf_code
from .countdown import countdown
from .format import code_format, r1_format, reasoning_steps, tag_count, think_format
from .ioi import ioi_code
from .judge import LLMJudge
from .math_accuracy import math_accuracy
from .remote import RemoteRewardModel
from .reward_model import RewardModel
from .shaping import cosine_length, kimi_length, repetition_penalty, soft_overlong
from .steps import arithmetic_steps

BUILTINS: dict[str, Callable] = {
    "code": code,
    "binary_code": code.configure(binary=True),  # open-r1's: 1 when every test passes (its pass rate > 0.99)
    "code_syntax": code_syntax,
    "cf_code": cf_code,
    "ioi_code": ioi_code,
    "think_format": think_format,
    "r1_format": r1_format,
    "countdown": countdown,
    "math_accuracy": math_accuracy,
    "tag_count": tag_count,
    "reasoning_steps": reasoning_steps,
    "cosine_length": cosine_length,
    "repetition_penalty": repetition_penalty,
    "soft_overlong": soft_overlong,
    "kimi_length": kimi_length,
    "code_format": code_format,
    # Rewards that ask a server; each needs its URL: {"name": "llm_judge", "base_url": ...}, or a bare URL (remote_rm).
    "llm_judge": LLMJudge,
    "remote_rm": RemoteRewardModel,
}
ALIASES = {"accuracy": "math_accuracy", "format": "r1_format", "length": "kimi_length"}  # open-r1's names
STEP_BUILTINS: dict[str, Callable] = {"arithmetic_steps": arithmetic_steps}


# open-r1's reward names (src/open_r1/rewards.py, get_reward_funcs) -> (our built-in, {its setting: open-r1 key}):
# a recipe's open-r1 keys (cosine_max_len, ...) configure them as open-r1's script does.
OPEN_R1_NAMES: dict[str, tuple[str, dict[str, Any]]] = {
    "cosine": ("cosine_length", {"min_value_wrong": "cosine_min_value_wrong",
                                 "max_value_wrong": "cosine_max_value_wrong",
                                 "min_value_correct": "cosine_min_value_correct",
                                 "max_value_correct": "cosine_max_value_correct", "max_len": "cosine_max_len"}),
    "repetition_penalty": ("repetition_penalty", {"ngram_size": "repetition_n_grams",
                                                  "max_penalty": "repetition_max_penalty"}),
    "soft_overlong_punishment": ("soft_overlong", {"max_length": "max_completion_len",
                                                   "cache_length": "soft_punish_cache"}),
    "code_format": ("code_format", {"language": "code_language"}),
    "cf_code": ("cf_code", {"scoring_mode": "code_eval_scoring_mode"}),
}


def open_r1_spec(spec: str, settings: dict[str, Any]) -> Any:
    """The spec an open-r1 reward name stands for, with `settings` (open-r1's keys) applied; other specs as given."""
    if spec in OPEN_R1_NAMES:
        name, keys = OPEN_R1_NAMES[spec]
        return {"name": name, **{arg: settings[key] for arg, key in keys.items()}}
    return spec


def get_reward_funcs(script_args: Any) -> list[Callable]:
    """open-r1's `get_reward_funcs(script_args)` (src/open_r1/rewards.py) with grpo's functions: each of open-r1's
    names in `script_args.reward_funcs`, configured by the open-r1 settings `script_args` has (cosine_max_len,
    code_language, ...; open-r1's defaults for those it lacks), as reward functions a GRPOTrainer takes."""
    from grpo.config.trl_keys import REWARD_SETTINGS

    settings = {key: getattr(script_args, key, default) for key, default in REWARD_SETTINGS.items()}
    return [resolve_reward(open_r1_spec(name, settings))[1] for name in script_args.reward_funcs]


def resolve_reward(spec: Any, tokenizer: Any = None) -> tuple[str, Callable]:
    """(name, function) for an outcome reward spec; `ValueError` listing the built-ins for an unknown name. A loaded
    sequence-classification model (TRL's form) becomes a `RewardModel`, scored with `tokenizer` (default: its own)."""
    if _is_module(spec) or (tokenizer is not None and isinstance(spec, str) and os.path.isdir(spec)):
        model = RewardModel(spec, tokenizer=tokenizer)  # (a checkpoint's directory with the tokenizer given for it)
        return model.__name__, model
    return _resolve(spec, BUILTINS, ALIASES, allow_model=True)


def _is_module(spec: Any) -> bool:
    import torch

    return isinstance(spec, torch.nn.Module)


def resolve_step_reward(spec: Any) -> tuple[str, Callable]:
    """(name, function) for a step-reward spec: `arithmetic_steps`, an import path, a callable, or a dict."""
    return _resolve(spec, STEP_BUILTINS, {}, allow_model=False)


def _resolve(spec: Any, table: dict, aliases: dict, allow_model: bool) -> tuple[str, Callable]:
    settings: dict[str, Any] = {}
    if isinstance(spec, dict):
        if "name" not in spec:
            raise ValueError(f"a reward given as a mapping needs a 'name' key, got keys {sorted(spec)}")
        settings = {key: value for key, value in spec.items() if key != "name"}
        spec = spec["name"]
    if callable(spec):
        func = _configured(spec, settings, _name_of(spec, "reward"))
        return _name_of(func, _name_of(spec, "reward")), func
    if not isinstance(spec, str):
        raise ValueError(f"a reward spec must be a name, a path, a callable or a mapping, got {type(spec).__name__}")
    name = aliases.get(spec, spec)
    if name in table:
        return name, _configured(table[name], settings, name)
    if allow_model and spec.startswith(("http://", "https://")):  # OpenRLHF's remote_rm_url
        return RemoteRewardModel.name, _configured(RemoteRewardModel, {"url": spec, **settings}, spec)
    if allow_model and os.path.isdir(spec):
        if not os.path.isfile(os.path.join(spec, "config.json")):
            raise ValueError(f"reward model directory {spec!r} has no config.json")
        model = RewardModel(spec, **settings)
        return model.__name__, model
    if ":" in spec:
        func = _configured(_import(spec), settings, spec)
        return _name_of(func, spec.rsplit(":", 1)[1]), func
    known = sorted(table) + [f"{alias} (= {target})" for alias, target in sorted(aliases.items())]
    forms = "'package.module:function'" + (", a checkpoint directory" if allow_model else "")
    raise ValueError(f"unknown reward {spec!r}; built-ins: {', '.join(known)}; or give {forms}")


def _configured(target: Callable, settings: dict, label: str) -> Callable:
    """The target itself, or the reward it builds from the settings."""
    if isinstance(target, ConfigurableReward):
        return target.configure(**settings) if settings else target
    if inspect.isclass(target) and issubclass(target, ConfigurableReward):
        unknown = sorted(set(settings) - set(target.setting_names()))
        if unknown:
            raise ValueError(f"reward {label!r} has no setting {', '.join(map(repr, unknown))}; its settings are: "
                             f"{', '.join(target.setting_names())}")
    if inspect.isclass(target):
        return target(**settings)  # a reward class: instantiate it (with or without settings)
    if not settings:
        return target
    try:
        inspect.signature(target).bind(**settings)
    except TypeError as error:
        raise ValueError(f"reward {label!r} does not accept the settings {sorted(settings)}: {error}") from None
    try:
        built = target(**settings)
    except Exception as error:
        raise ValueError(f"building reward {label!r} from settings {settings} failed: {error!r}") from error
    if not callable(built):
        raise ValueError(f"reward factory {label!r} returned {type(built).__name__}, not a reward function")
    return built


def _import(path: str) -> Any:
    module_name, _, attribute = path.rpartition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"cannot import module {module_name!r} for reward {path!r}: {error}") from error
    if not hasattr(module, attribute):
        raise ValueError(f"module {module_name!r} has no attribute {attribute!r} (reward {path!r})")
    return getattr(module, attribute)


def _name_of(func: Callable, default: str) -> str:
    name = getattr(func, "__name__", None)
    return name if isinstance(name, str) and name else default
