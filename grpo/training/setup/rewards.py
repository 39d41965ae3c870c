"""The run's rewards: the given functions, the config's specs or the task's, with their tokenizers and settings; the
step rewards of process supervision; the dataset columns the rewards read, checked.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable

import torch

from grpo.config import ConfigError, GRPOConfig


def make_reward_runner(cfg: GRPOConfig, reward_funcs, task, processing_classes=None, agents=None):
    """The run's rewards: the given ones (one spec or callable, a loaded reward model, or a list, as TRL takes
    them; `processing_classes` are the tokenizers of loaded reward models, one or one per function), else the
    config's, else the task's; and the environments' get_reward (weight 1) when `agents` has them."""
    from grpo.rewards import RewardRunner, resolve_reward

    if getattr(getattr(agents, "rollout_func", None), "reads_rows", False):
        task = None  # (an agent's episodes: its return is the reward; the task gives the data only)
    specs = reward_funcs if reward_funcs is not None else (cfg.reward_funcs or (task.reward_funcs if task else []))
    if not isinstance(specs, (list, tuple)):  # one reward, as TRL's quickstarts pass it
        specs = [specs]
    extra = agents.reward_funcs() if agents is not None else []
    if not specs and not extra:
        raise ConfigError("No reward source provided. reward_funcs: no reward function given; name at least one (e.g. "
                          "reward_funcs: [math_accuracy, think_format]), use a built-in task, or an environment with "
                          "get_reward" + (
                              " (with dataset_name set, a task's rewards are used only when task is set too: "
                              "task=arithmetic)." if cfg.dataset_name is not None else "."))
    weights = cfg.reward_weights
    if weights is None and task is not None and not cfg.reward_funcs and reward_funcs is None:
        weights = task.reward_weights
    if weights is not None and all(w == 0 for w in weights):
        warnings.warn("reward_weights: every weight is 0, so every reward is 0 and nothing will be learned.")
    if weights is not None and len(weights) != len(specs):
        raise ConfigError(f"reward_weights: {len(weights)} weights for {len(specs)} reward functions.")
    tokenizers = _reward_tokenizers(processing_classes, len(specs))
    try:
        funcs = [resolve_reward(_with_settings(s, cfg), tokenizer=tok) for s, tok in zip(specs, tokenizers)]
    except (ValueError, ImportError) as err:
        raise ConfigError(f"reward_funcs: {err}") from None
    if cfg.overlong_buffer_ratio > 0:
        from grpo.rewards import SoftOverlong

        # DAPO's soft overlong punishment over the last part of the length budget, added at weight 1.
        cache = max(1, math.ceil(cfg.overlong_buffer_ratio * cfg.max_completion_length))
        funcs.append(("soft_overlong", SoftOverlong(max_length=cfg.max_completion_length, cache_length=cache)))
        weights = (list(weights) if weights is not None else [1.0] * (len(funcs) - 1)) + [1.0]
    if extra:
        weights = (list(weights) if weights is not None else [1.0] * len(funcs)) + [1.0] * len(extra)
        funcs += extra
    names = [name for name, _ in funcs]
    runner = RewardRunner(funcs, weights, on_error=cfg.reward_on_error, on_nonfinite=cfg.reward_on_nonfinite,
                          timeout_s=cfg.reward_timeout, on_all_none=cfg.reward_on_all_none,
                          specs=[spec_text(s) for s in specs])
    return runner, names


def spec_text(spec):
    """A reward spec as config.yaml records it: a name, mapping or import path as given; a callable as its import
    path ("module:function"); a loaded reward model as its name_or_path."""
    if isinstance(spec, (str, dict)):
        return spec
    if isinstance(spec, torch.nn.Module):
        return getattr(spec, "name_or_path", None) or type(spec).__name__
    named = spec if hasattr(spec, "__qualname__") else type(spec)  # (a callable object: its class)
    return f"{named.__module__}:{named.__qualname__}"


def _reward_tokenizers(processing_classes, count: int) -> list:
    if processing_classes is None:
        return [None] * count
    if not isinstance(processing_classes, (list, tuple)):
        processing_classes = [processing_classes]
    if len(processing_classes) != count:
        raise ConfigError(f"reward_processing_classes: {len(processing_classes)} for {count} reward functions; the "
                          "counts must match: give one per function (None for those that are not models), as TRL "
                          "takes them.")
    return list(processing_classes)


def _with_settings(spec, cfg: GRPOConfig):
    """An open-r1 reward name with the recipe's settings for it (open-r1's get_reward_funcs does the same)."""
    from grpo.rewards.registry import open_r1_spec

    return open_r1_spec(spec, {**_open_r1_defaults(), **cfg.open_r1_rewards}) if isinstance(spec, str) else spec


def _open_r1_defaults() -> dict:
    from grpo.config.trl_keys import REWARD_SETTINGS

    return dict(REWARD_SETTINGS)


def check_reward_columns(rewards, dataset, agents=None) -> None:
    """Every column a reward function needs is in the dataset or comes from the rollouts (`agents`: their
    environments; a rollout_func's own fields are known only when it runs): checked before any model loads."""
    from grpo.rewards import RewardError
    from grpo.training.data.stream import stream_columns

    extra = agents.reward_columns() if agents is not None else []
    if extra is None:
        return
    try:
        rewards.check_columns(stream_columns(dataset) + extra)
    except RewardError as err:
        raise ConfigError(str(err).replace("\n", "; ")) from None


def make_step_rewards(cfg: GRPOConfig, step_reward_funcs) -> list[Callable]:
    from grpo.rewards import resolve_step_reward

    specs = step_reward_funcs if step_reward_funcs is not None else cfg.step_reward_funcs
    try:
        return [resolve_step_reward(s)[1] for s in specs]
    except (ValueError, ImportError) as err:
        raise ConfigError(f"step_reward_funcs: {err}") from None
