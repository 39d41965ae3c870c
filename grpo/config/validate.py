"""Checking a constructed config once: types coerced by each field's annotation, TRL's value forms resolved into
ours, then every rule that needs no model and no data. Each failure is one line naming the key
(reliability.md section 4.2)."""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
import warnings
from collections.abc import Callable
from typing import Any, get_type_hints

from grpo.config.base import ConfigError, check
from grpo.config.derived import needs_reference
from grpo.config.presets import LOSS_TYPES, PRESETS
from grpo.config.trl_fields import settings

SAMPLING_KWARGS = {"max_new_tokens": "max_completion_length", "temperature": "temperature", "top_p": "top_p",
                   "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty"}
SCHEDULE_KWARGS = {"constant": set(), "linear": set(), "constant_with_warmup": set(), "cosine": {"num_cycles"},
                   "cosine_with_min_lr": {"num_cycles", "min_lr", "min_lr_rate"}}


def resolve_and_validate(cfg) -> None:
    _trl_forms(cfg)
    _coerce_types(cfg)
    _resolve(cfg)
    _validate(cfg)


def _trl_forms(cfg) -> None:
    """TRL's spellings of our values: scale_rewards true/false, report_to 'none'/'all', bf16 null; router_replay
    true/false (NeMo-RL's router_replay.enabled; YAML reads `off` as false)."""
    if isinstance(cfg.scale_rewards, bool):
        cfg.scale_rewards = "group" if cfg.scale_rewards else "none"
    if isinstance(cfg.router_replay, bool):
        cfg.router_replay = "R3" if cfg.router_replay else "off"
    if isinstance(cfg.report_to, str):
        cfg.report_to = [cfg.report_to]
    if cfg.report_to is None:
        cfg.report_to = []
    cfg.report_to = [r for r in cfg.report_to if r != "none"]
    if "all" in cfg.report_to:  # every sink whose package is installed, as transformers' "all"
        import importlib.util

        rest = [r for r in cfg.report_to if r != "all"]
        found = ["tensorboard"] + [r for r in ("wandb", "trackio") if importlib.util.find_spec(r) is not None]
        cfg.report_to = list(dict.fromkeys(rest + found))
    if cfg.bf16 is None:
        cfg.bf16 = not cfg.fp16
    if cfg.output_dir is None:  # TRL's default
        cfg.output_dir = "trainer_output"
    from grpo.config.base import DEFAULT_MODEL, shipped_model

    if cfg.model_name_or_path is None:  # TRL ModelConfig's unset: the shipped model
        cfg.model_name_or_path = DEFAULT_MODEL
    cfg.model_name_or_path = shipped_model(cfg.model_name_or_path)  # `tiny-tools`: the one in the package
    if cfg.min_p is None:
        cfg.min_p = 0.0
    if cfg.use_chat_template == "auto":  # null's other spelling
        cfg.use_chat_template = None
    for key in ("open_r1_rewards", "vllm_engine_kwargs"):  # null (an argument parser's unset) is no settings
        if getattr(cfg, key) is None:
            setattr(cfg, key, {})


def _coerce_types(cfg) -> None:
    """YAML gives `1e-6` as a string and `1` where a float is meant, an argument parser gives a dict key's JSON as
    text: coerce by the field's annotation, or fail naming it."""
    hints = get_type_hints(type(cfg))
    for f in settings(cfg):
        value, hint = getattr(cfg, f.name), hints[f.name]
        options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        if value is None:
            if type(None) not in options:
                raise ConfigError(f"{f.name}: must be set (got null).")
            continue
        try:
            value = _count_or_fraction(value) if f.name in COUNT_OR_FRACTION else _coerce(value, options)
        except (TypeError, ValueError):
            kind = "a mapping (or its JSON text)" if dict in map(typing.get_origin, options) else _kind(hint)
            raise ConfigError(f"{f.name}: expected {kind}, got {value!r}.") from None
        setattr(cfg, f.name, value)


COUNT_OR_FRACTION = ("warmup_steps", "logging_steps", "eval_steps", "save_steps")
"""transformers' steps-or-ratio keys (annotated `float`, as in TrainingArguments): a count, or below 1 a fraction."""


def _count_or_fraction(value: Any) -> int | float:
    if isinstance(value, bool):
        raise ValueError(value)
    number = float(value)
    return int(number) if number == 0 or (number >= 1 and number.is_integer()) else number


def _kind(hint: Any) -> str:
    return str(hint).replace("<class '", "").replace("'>", "").replace("typing.", "").replace("collections.abc.", "")


def _coerce(value: Any, options: tuple) -> Any:
    """`value` as the first of a field's types (`options`, None left out) it already is, else the first it converts
    to; ValueError when none."""
    options = [o for o in options if o is not type(None)]
    if isinstance(value, str) and any((typing.get_origin(o) or o) is dict for o in options):
        parsed = json.loads(value)  # a mapping's key given as JSON text (an argument parser's --key '{"a": 1}')
        if not isinstance(parsed, dict):
            raise ValueError(value)
        return parsed
    for option in options:
        if _is(value, option):
            return value
    for option in options:
        try:
            return _convert(value, option)
        except (TypeError, ValueError):
            continue
    raise ValueError(value)


def _is(value: Any, option: Any) -> bool:
    if option is Any:
        return True
    if option is Callable or typing.get_origin(option) is Callable:
        return callable(value) and not isinstance(value, (str, list, dict))
    kind = typing.get_origin(option) or option
    if isinstance(value, bool):
        return kind is bool
    return isinstance(value, kind)


def _convert(value: Any, option: Any) -> Any:
    kind = typing.get_origin(option) or option
    if kind is bool:
        return _to_bool(value)
    if isinstance(value, bool):
        raise ValueError(value)
    if kind is int:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        return int(value)
    if kind is float:
        return float(value)
    if kind is list:
        return [value] if isinstance(value, (str, dict)) else list(value)
    raise ValueError(value)


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
        return value.lower() in ("true", "yes", "1")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(value)


def _resolve(cfg) -> None:
    """Keys that set others: loss_type, generation_kwargs, epsilon_high's default."""
    explicit = cfg.__dict__.get("_explicit", frozenset())
    if cfg.loss_type is not None:
        check(cfg.loss_type in LOSS_TYPES, "loss_type",
              f"unknown value {cfg.loss_type!r}; choose one of {', '.join(LOSS_TYPES)} (or set loss_aggregation and "
              "surrogate).")
        pair = LOSS_TYPES[cfg.loss_type]
        for key, value in zip(("loss_aggregation", "surrogate"), pair):
            if key in explicit and getattr(cfg, key) != value:
                raise ConfigError(f"loss_type: {cfg.loss_type!r} means {key}={value!r}, but {key} is "
                                  f"{getattr(cfg, key)!r}; set one of them.")
            setattr(cfg, key, value)
    for key, value in (cfg.generation_kwargs or {}).items():
        check(key != "num_beams" or value in (None, 1), "generation_kwargs",
              f"num_beams={value} is beam search: it returns the beams' highest-scoring sequences, not samples of the "
              "policy, which GRPO's group statistics and its ratio to the sampling policy assume (TRL hands it to "
              "transformers' generate, beam sampling with do_sample, and trains on those as samples; its vLLM path "
              "has no num_beams); leave it out, or raise num_generations for more completions per prompt.")
        if key == "num_beams":
            continue  # (1: sampling, as without it)
        check(key in SAMPLING_KWARGS or (key == "do_sample" and value is True), "generation_kwargs",
              f"{key!r} is not a setting of grpo's samplers; use {', '.join(SAMPLING_KWARGS)}.")
        if key in SAMPLING_KWARGS:
            setattr(cfg, SAMPLING_KWARGS[key], value)  # TRL: they override the other generation settings
    if cfg.generation_kwargs:
        _coerce_types(cfg)
    if cfg.epsilon_high is None:
        cfg.epsilon_high = cfg.epsilon
    if cfg.dataset_name is not None and "task" not in explicit:
        cfg.task = None  # a data file of its own; `task: NAME` with it takes that task's prefill and rewards
    if cfg.log_completions is not None and "log_completions_steps" in explicit:
        raise ConfigError("log_completions: set log_completions (TRL's: every logging step, or never) or "
                          "log_completions_steps, not both.")


def _validate(cfg) -> None:
    for f in settings(cfg):
        choices = f.metadata.get("choices")
        value = getattr(cfg, f.name)
        if choices and value not in choices:
            raise ConfigError(f"{f.name}: unknown value {value!r}; choose one of {', '.join(map(str, choices))}.")
    _validate_batch(cfg)
    _validate_optimization(cfg)
    _validate_loss(cfg)
    _validate_logging(cfg)


def _validate_batch(cfg) -> None:
    # G first, before any division by it (TRL 1.16 fails with ZeroDivisionError on num_generations=0).
    check(cfg.num_generations >= 2, "num_generations",
          f"must be an integer >= 2 (got {cfg.num_generations}): GRPO normalizes rewards within each group.")
    check(cfg.prompts_per_step is None or cfg.prompts_per_step >= 1, "prompts_per_step", "must be >= 1.")
    for key in ("per_device_train_batch_size", "max_completion_length", "per_device_eval_batch_size",
                "num_iterations", "max_generation_rounds", "max_nonfinite_steps", "eval_num_samples",
                "shuffle_buffer_size"):
        check(getattr(cfg, key) >= 1, key, "must be >= 1.")
    check(cfg.max_tokens_per_micro_batch is None or cfg.max_tokens_per_micro_batch >= 1,
          "max_tokens_per_micro_batch", "must be >= 1 tokens, or null (micro-batches of per_device_train_batch_size "
          "completions).")
    check(cfg.sequence_parallel_size >= 1, "sequence_parallel_size", "must be >= 1 (1: no sequence parallelism).")
    check(cfg.sequence_parallel_size == 1 or cfg.use_remove_padding, "sequence_parallel_size",
          "splits the packed (padding-free) micro-batch; it needs use_remove_padding: true.")
    check(cfg.expert_parallel_size >= 1, "expert_parallel_size", "must be >= 1 (1: every process holds every expert).")
    for key in ("gradient_accumulation_steps", "steps_per_generation", "generation_batch_size"):
        check(getattr(cfg, key) is None or getattr(cfg, key) >= 1, key, "must be >= 1, or null.")
    if cfg.generation_batch_size is not None and cfg.steps_per_generation is not None:  # (asdict of a TRL config)
        check(cfg.generation_batch_size % (cfg.per_device_train_batch_size * cfg.steps_per_generation) == 0,
              "generation_batch_size", "set generation_batch_size or steps_per_generation, not both (with both, "
              "generation_batch_size must be per_device_train_batch_size x processes x steps_per_generation).")
    if cfg.generation_batch_size is not None:
        check(cfg.generation_batch_size % cfg.num_generations == 0, "generation_batch_size",
              f"{cfg.generation_batch_size} completions is not a multiple of num_generations={cfg.num_generations}; "
              "each prompt needs a full group.")
    check(cfg.max_prompt_length is None or cfg.max_prompt_length >= 1, "max_prompt_length", "must be >= 1 or null.")
    check(not cfg.dataset_streaming or cfg.max_steps > 0, "max_steps", "dataset_streaming: a stream has no length, "
          "so num_train_epochs cannot say when to stop; set max_steps (TRL's rule for an IterableDataset).")
    check(not cfg.dataset_streaming or cfg.dataset_name is not None, "dataset_streaming",
          "streams dataset_name; set dataset_name (a built-in task is generated in memory).")
    check(cfg.temperature > 0, "temperature", f"must be > 0 (got {cfg.temperature}); sampling needs diversity.")
    check(0 < cfg.top_p <= 1, "top_p", f"must be in (0, 1] (got {cfg.top_p}).")
    check(cfg.top_k >= 0, "top_k", "must be >= 0 (0 turns it off).")
    check(0 <= cfg.min_p < 1, "min_p", "must be in [0, 1).")
    check(cfg.repetition_penalty > 0, "repetition_penalty", "must be > 0.")
    check(0 < cfg.vllm_gpu_memory_utilization <= 1, "vllm_gpu_memory_utilization", "must be in (0, 1].")
    check(cfg.vllm_tensor_parallel_size >= 1, "vllm_tensor_parallel_size", "must be >= 1.")
    check(cfg.vllm_importance_sampling_clip_max is None or cfg.vllm_importance_sampling_clip_max > 0,
          "vllm_importance_sampling_clip_max", "must be > 0, or null.")
    check(not (cfg.dynamic_sampling and (cfg.steps_per_generation or cfg.generation_batch_size)), "dynamic_sampling",
          "refills each rollout's groups for one optimizer step; leave steps_per_generation and "
          "generation_batch_size unset.")
    check(cfg.task_train_size >= 1 and cfg.task_eval_size >= 0, "task_train_size", "sizes must be >= 1 (eval >= 0).")
    _validate_staleness(cfg)


def _validate_staleness(cfg) -> None:
    """What a rollout worker with a lag cannot do yet, each refused with its reason (docs/async.md)."""
    check(cfg.max_staleness >= 0, "max_staleness", "must be >= 0 (0: synchronous rollouts).")
    if cfg.max_staleness == 0:
        return
    check(not cfg.use_vllm or cfg.vllm_mode == "server", "max_staleness", "a colocated vLLM engine shares the "
          "trainer's process and device, so it cannot generate while the update runs; use vllm_mode: server (a "
          "`grpo vllm-serve` on other devices), or set max_staleness: 0.")
    check(not cfg.rollout_func, "max_staleness", "a rollout_func is handed the trainer itself, whose weights a "
          "rollout made ahead would see mid-update; set max_staleness: 0.")
    check(cfg.use_vllm or not (cfg.tools or cfg.environment_factory), "max_staleness", "multi-turn rollouts "
          "(tools, environment_factory) with a lag run on the vLLM server path (use_vllm, vllm_mode: server), "
          "where they stay in the trainer's process; a forked rollout worker would share the trainer's tool "
          "processes and environment instances. Use the server, or set max_staleness: 0.")


def _validate_optimization(cfg) -> None:
    check(math.isfinite(cfg.learning_rate) and cfg.learning_rate > 0, "learning_rate",
          f"must be a finite number > 0 (got {cfg.learning_rate}).")
    check(0 <= cfg.warmup_ratio < 1, "warmup_ratio", "must be in [0, 1).")
    check(cfg.warmup_steps >= 0, "warmup_steps", "must be >= 0 (below 1: a fraction of the steps).")
    allowed = SCHEDULE_KWARGS[cfg.lr_scheduler_type]
    extra = sorted(set(cfg.lr_scheduler_kwargs or {}) - allowed)
    check(not extra, "lr_scheduler_kwargs", f"{extra[0] if extra else ''!r} is not a setting of "
          f"{cfg.lr_scheduler_type}; it takes {', '.join(sorted(allowed)) or 'none'}.")
    if cfg.lr_scheduler_type == "cosine_with_min_lr":
        given = {"min_lr", "min_lr_rate"} & set(cfg.lr_scheduler_kwargs or {})
        check(len(given) == 1, "lr_scheduler_kwargs", "cosine_with_min_lr needs one of min_lr or min_lr_rate.")
    check(cfg.max_grad_norm >= 0, "max_grad_norm", "must be >= 0 (0 turns clipping off).")
    check(cfg.max_steps == -1 or cfg.max_steps >= 1, "max_steps", "must be >= 1, or -1 to use num_train_epochs.")
    check(cfg.max_steps >= 1 or cfg.num_train_epochs > 0, "num_train_epochs", "must be > 0.")
    check(cfg.num_threads is None or cfg.num_threads >= 1, "num_threads", "must be >= 1, or null.")
    check(cfg.max_tool_calling_iterations is None or cfg.max_tool_calling_iterations >= 0,
          "max_tool_calling_iterations", "must be >= 0, or null (no limit but the completion length).")
    check(cfg.tool_timeout > 0, "tool_timeout", "must be > 0 seconds.")
    check(cfg.max_tool_output_chars >= 1, "max_tool_output_chars", "must be >= 1.")
    check(not (cfg.bf16 and cfg.fp16), "fp16", "set bf16 or fp16, not both.")
    check(cfg.preset is None or cfg.preset in PRESETS, "preset",
          f"unknown value {cfg.preset!r}; choose one of {', '.join(PRESETS)}.")
    check(not (cfg.load_in_4bit and not cfg.use_peft), "load_in_4bit", "4-bit weights train through LoRA adapters "
          "only; set use_peft (or pass peft_config).")
    check(not (cfg.load_in_4bit and cfg.use_vllm), "load_in_4bit", "4-bit (QLoRA) weights cannot be handed to vLLM: "
          "the packed 4-bit base would need dequantizing before the LoRA delta merges into it, which is not built. "
          "Set use_vllm: false (the transformers sampler runs the 4-bit model) or load the base in bfloat16.")


def _validate_loss(cfg) -> None:
    check(cfg.beta >= 0 and math.isfinite(cfg.beta), "beta", "must be >= 0.")
    check(cfg.epsilon > 0, "epsilon", "must be > 0.")
    check(cfg.epsilon_high >= cfg.epsilon or cfg.surrogate == "cispo", "epsilon_high",
          f"must be >= epsilon ({cfg.epsilon}).")
    check(cfg.delta is None or cfg.delta > 0, "delta", "must be > 0 (INTELLECT-2 uses more than 1 + epsilon).")
    check(cfg.off_policy_mask_threshold is None or cfg.off_policy_mask_threshold > 0, "off_policy_mask_threshold",
          "must be > 0 (DeepSeek-V3.2 uses e.g. 0.5), or null.")
    check(0 <= cfg.top_entropy_quantile <= 1, "top_entropy_quantile", "must be in [0, 1].")
    check(cfg.entropy_coef_min <= cfg.entropy_coef_max, "entropy_coef_min", "must be <= entropy_coef_max.")
    check(cfg.entropy_coef_delta >= 0, "entropy_coef_delta", "must be >= 0.")
    check(0 <= cfg.ref_model_mixup_alpha <= 1, "ref_model_mixup_alpha", "must be in [0, 1].")
    check(cfg.ref_model_sync_steps >= 1, "ref_model_sync_steps", "must be >= 1.")
    check(not cfg.sync_ref_model or needs_reference(cfg), "sync_ref_model", "beta is 0, so there is no reference "
          "model to sync; set beta > 0 or sync_ref_model false (TRL refuses it too).")
    check(not (cfg.sync_ref_model and cfg.use_peft), "sync_ref_model", "with LoRA the reference is the model with its "
          "adapters off, nothing to sync (TRL refuses it too); train all weights or turn it off.")
    if cfg.surrogate == "vespo" and cfg.use_vllm and cfg.vllm_importance_sampling_correction:
        check(cfg.vllm_importance_sampling_mode in ("token_truncate", "token_mask"), "vllm_importance_sampling_mode",
              "vespo takes per-token vLLM ratios into its sequence weight: use token_truncate or token_mask.")
    if cfg.loss_aggregation == "sequence_sum" and cfg.importance_sampling_level != "sequence":
        warnings.warn("luspo (loss_aggregation=sequence_sum) is GSPO's sequence-level ratio with each sequence's loss "
                      "scaled by its length; the paper sets importance_sampling_level=sequence.", stacklevel=4)
    check(cfg.advantage_eps >= 0, "advantage_eps", "must be >= 0.")
    check(cfg.process_weight >= 0 and cfg.outcome_weight >= 0, "process_weight",
          "process_weight and outcome_weight must be >= 0.")
    check(0 <= cfg.overlong_buffer_ratio < 1, "overlong_buffer_ratio", "must be in [0, 1).")
    check(cfg.reward_timeout is None or cfg.reward_timeout > 0, "reward_timeout", "must be > 0 seconds, or null.")
    if cfg.reward_weights is not None:
        check(all(isinstance(w, (int, float)) and math.isfinite(w) for w in cfg.reward_weights),
              "reward_weights", f"must be finite numbers (got {cfg.reward_weights}).")
        if cfg.reward_funcs:
            check(len(cfg.reward_weights) == len(cfg.reward_funcs), "reward_weights",
                  f"has {len(cfg.reward_weights)} entries but reward_funcs has {len(cfg.reward_funcs)}; "
                  "give one weight per function.")


STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP")


def _validate_logging(cfg) -> None:
    check(cfg.logging_steps > 0, "logging_steps", "must be > 0 (below 1: a fraction of the steps).")
    check(cfg.save_steps >= 0 and cfg.log_completions_steps >= 0, "save_steps",
          "save_steps and log_completions_steps must be >= 0.")
    check(cfg.eval_steps is None or cfg.eval_steps >= 0, "eval_steps", "must be >= 0, or null.")
    check(cfg.save_total_limit is None or cfg.save_total_limit >= 1, "save_total_limit", "must be >= 1, or null.")
    check(cfg.num_completions_to_print is None or cfg.num_completions_to_print >= 0, "num_completions_to_print",
          "must be >= 0, or null.")
    unknown_sinks = set(cfg.report_to) - {"tensorboard", "wandb", "trackio"}
    check(not unknown_sinks, "report_to", f"unknown sink {sorted(unknown_sinks)}; use tensorboard, wandb, trackio, "
          "all or none.")
    if isinstance(cfg.stop_signals, str):
        cfg.stop_signals = [cfg.stop_signals]
    cfg.stop_signals = [s.upper() if s.upper().startswith("SIG") else f"SIG{s.upper()}" for s in cfg.stop_signals]
    unknown = sorted(set(cfg.stop_signals) - set(STOP_SIGNALS))
    check(not unknown, "stop_signals", f"{unknown} cannot stop a run; choose from {', '.join(STOP_SIGNALS)} (or [] "
          "to leave every signal at Python's default).")
