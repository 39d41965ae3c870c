"""Building a run from its config, before the loop starts: task, rewards, datasets, batch layout, schedule.

Every check here runs before any model is loaded, so a bad config fails in milliseconds with the key's name.
"""

from __future__ import annotations

import math
import random
import warnings
from typing import Callable

import numpy as np
import torch

from grpo.config import ConfigError, GRPOConfig
from grpo.training.data import load_dataset_any


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def load_task(cfg: GRPOConfig):
    from grpo.tasks import get_task

    try:
        return get_task(cfg.task)
    except ValueError as err:
        raise ConfigError(f"task: {err}") from None


def make_reward_runner(cfg: GRPOConfig, reward_funcs, task, agents=None):
    """The weighted reward functions, and the environments' get_reward (weight 1) when `agents` has them."""
    from grpo.rewards import RewardRunner, resolve_reward

    specs = reward_funcs if reward_funcs is not None else (cfg.reward_funcs or (task.reward_funcs if task else []))
    if callable(specs) or isinstance(specs, (str, dict)):  # one reward, as TRL's quickstarts pass it
        specs = [specs]
    extra = agents.reward_funcs() if agents is not None else []
    if not specs and not extra:
        raise ConfigError("reward_funcs: no reward function given; name at least one (e.g. reward_funcs: "
                          "[math_accuracy, think_format]), use a built-in task, or an environment with get_reward.")
    weights = cfg.reward_weights
    if weights is None and task is not None and not cfg.reward_funcs and reward_funcs is None:
        weights = task.reward_weights
    if weights is not None and all(w == 0 for w in weights):
        warnings.warn("reward_weights: every weight is 0, so every reward is 0 and nothing will be learned.")
    if weights is not None and len(weights) != len(specs):
        raise ConfigError(f"reward_weights: {len(weights)} weights for {len(specs)} reward functions.")
    try:
        funcs = [resolve_reward(s) for s in specs]
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
                          timeout_s=cfg.reward_timeout)
    return runner, names


def check_reward_columns(rewards, columns: list[str], agents=None) -> None:
    """Every column a reward function needs is in the dataset or comes from the rollouts (`agents`: their
    environments; a rollout_func's own fields are known only when it runs): checked before any model loads."""
    from grpo.rewards import RewardError

    extra = agents.reward_columns() if agents is not None else []
    if extra is None:
        return
    try:
        rewards.check_columns(list(columns) + extra)
    except RewardError as err:
        raise ConfigError(str(err).replace("\n", "; ")) from None


def make_step_rewards(cfg: GRPOConfig, step_reward_funcs) -> list[Callable]:
    from grpo.rewards import resolve_step_reward

    specs = step_reward_funcs if step_reward_funcs is not None else cfg.step_reward_funcs
    try:
        return [resolve_step_reward(s)[1] for s in specs]
    except (ValueError, ImportError) as err:
        raise ConfigError(f"step_reward_funcs: {err}") from None


def make_datasets(cfg: GRPOConfig, task, train_dataset, eval_dataset):
    if train_dataset is None:
        if cfg.dataset_name is None and task is None:
            raise ConfigError("dataset_name: set dataset_name (a data file or directory) or task (arithmetic, "
                              "countdown), or pass train_dataset.")
        if cfg.dataset_name is not None:
            train_dataset = load_dataset_any(cfg.dataset_name, cfg.dataset_split, cfg.dataset_config)
        else:
            train_dataset = task.dataset("train", n=cfg.task_train_size, seed=cfg.seed, **_level(cfg))
    if eval_dataset is None:
        if cfg.eval_dataset_name is not None:
            eval_dataset = load_dataset_any(cfg.eval_dataset_name, cfg.eval_split, key="eval_dataset_name")
        elif task is not None and cfg.task_eval_size > 0:
            eval_dataset = task.dataset("test", n=cfg.task_eval_size, seed=cfg.seed, **_level(cfg))
    return train_dataset, eval_dataset


def _level(cfg: GRPOConfig) -> dict:
    return {} if cfg.task_difficulty is None else {"difficulty": cfg.task_difficulty}


def batch_layout(cfg: GRPOConfig, world: int) -> tuple[int, int]:
    if cfg.dynamic_sampling and world > 1:
        raise ConfigError("dynamic_sampling: runs on one process for now; with several processes the refilled "
                          "groups would need moving between processes. Turn it off or run one process.")
    G = cfg.num_generations
    B = cfg.prompts_per_step
    if B is None:
        B = max(1, cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * world // G)
    if (B * G) % world:
        raise ConfigError(f"prompts_per_step: {B} prompts x {G} generations = {B * G} completions cannot be split "
                          f"evenly over {world} processes; choose prompts_per_step so that B x G divides by {world}.")
    return B, G


def check_sizes(cfg: GRPOConfig, n_prompts: int, B: int, prompt_ids: list[list[int]], model_config=None) -> None:
    """Enough prompts for one step, and prompt + completion within the model's context (reliability.md 4.2)."""
    if n_prompts < B:
        raise ConfigError(f"dataset_name: the dataset has {n_prompts} prompts but one step needs {B} "
                          f"(prompts_per_step); add prompts or lower prompts_per_step.")
    if model_config is None:
        from transformers import AutoConfig

        try:
            model_config = AutoConfig.from_pretrained(cfg.model_name_or_path)
        except OSError as err:
            raise ConfigError(f"model_name_or_path: cannot read the config of {cfg.model_name_or_path!r}: "
                              f"{err}") from None
    context = getattr(model_config, "max_position_embeddings", None)
    longest = max(len(p) for p in prompt_ids) + cfg.max_completion_length
    if context is not None and longest > context:
        raise ConfigError(f"max_completion_length: the longest prompt ({longest - cfg.max_completion_length} "
                          f"tokens) plus max_completion_length ({cfg.max_completion_length}) is {longest}, beyond "
                          f"the model's context of {context} tokens; lower max_completion_length or "
                          "max_prompt_length.")


def total_steps(cfg: GRPOConfig, n_prompts: int, B: int) -> int:
    if cfg.max_steps > 0:
        return cfg.max_steps
    return max(1, math.ceil(cfg.num_train_epochs * n_prompts / B))


def make_schedule(cfg: GRPOConfig, total: int) -> Callable[[int], float]:
    warmup = cfg.warmup_steps or int(cfg.warmup_ratio * total)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if cfg.lr_scheduler_type == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        if cfg.lr_scheduler_type == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def make_optimizer(model, cfg: GRPOConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters. The fused implementation (one kernel per step instead of a dozen
    elementwise passes; 0.06 s instead of 0.30 s for 43M float32 parameters on one CPU core) where every parameter
    is a plain float tensor on CPU or CUDA, the default implementation otherwise."""
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs = dict(lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon,
                  weight_decay=cfg.weight_decay)
    fusable = bool(params) and all(type(p.data) is torch.Tensor and p.is_floating_point()
                                   and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(params, fused=True if fusable else None, **kwargs)


def fill_deepspeed_auto(accelerator, cfg: GRPOConfig) -> None:
    """The DeepSpeed config's "auto" values that accelerate would read from a prepared dataloader (this loop has
    none): the micro-batch size and the gradient clipping."""
    if accelerator.distributed_type != "DEEPSPEED":
        return
    ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
    for key, value in (("train_micro_batch_size_per_gpu", cfg.per_device_train_batch_size),
                       ("gradient_clipping", cfg.max_grad_norm if cfg.max_grad_norm > 0 else 0.0)):
        if ds_config.get(key) in (None, "auto"):
            ds_config[key] = value
