"""Every key of TRL 1.16's `GRPOConfig` (its own and `TrainingArguments`'), the `GRPOTrainer` arguments that are also
config keys here (tools, environment_factory, rollout_func), TRL's `ModelConfig` and `ScriptArguments`, and
open-r1's GRPO config and script arguments: one row each, and what grpo does with it.

    field    a key of GRPOConfig under TRL's name, with TRL's meaning (its default may be ours: README)
    alias    TRL's or open-r1's name for a key of ours that means the same; the value moves to it
    reward   an open-r1 reward-function setting (cosine_max_len, ...), kept in `open_r1_rewards`
    default  not built: accepted at TRL's default (or an `accept`ed value, which is grpo's behaviour), refused
             otherwise with the reason and what to use
    noop     accepted at any valid value, which changes nothing here (the note says why: e.g. DataLoader settings,
             where grpo has no DataLoader); `check` refuses values TRL refuses too

docs/from_trl.md is generated from this table (tests/test_trl_config.py checks it against TRL's own classes).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

from grpo.config.base import ConfigError


@dataclass(frozen=True)
class TRLKey:
    name: str
    kind: str  # field | alias | reward | default
    default: Any  # the source's default
    source: str  # trl (GRPOConfig), trainer (GRPOTrainer's arguments), ta (TrainingArguments), model (ModelConfig),
    #   script, open-r1, legacy
    note: str = ""  # default: why it is not built and what to use; others: what to know
    target: str | None = None  # alias: our key
    accept: tuple = ()  # default: further values accepted (grpo's own behaviour)
    check: Any = None  # noop: value -> an error text for a value TRL refuses too, or None


def _rows(source: str, kind: str, *rows: tuple) -> list[TRLKey]:
    out = []
    for row in rows:
        if kind == "alias":
            name, target, default, *note = row
            out.append(TRLKey(name, kind, default, source, note[0] if note else "", target=target))
        elif kind == "default":
            name, default, note, *accept = row
            out.append(TRLKey(name, kind, default, source, note, accept=tuple(accept[0]) if accept else ()))
        elif kind == "noop":
            name, default, note, *check = row
            out.append(TRLKey(name, kind, default, source, note, check=check[0] if check else None))
        else:
            name, default, *note = row
            out.append(TRLKey(name, kind, default, source, note[0] if note else ""))
    return out


_NO_LOADER_NOOP = ("get_train_dataloader and get_eval_dataloader pass it to their DataLoader, as transformers' "
                   "Trainer does; train() and evaluate() read prompts from memory, not through those loaders, so "
                   "there it changes nothing")
_LAUNCH = ("multi-process training is set up by `accelerate launch --config_file recipes/accelerate/...` "
           "(DDP and DeepSpeed ZeRO-2 are tested)")
_EVAL = "grpo's eval samples completions and scores the rewards (accuracy, pass@k); it computes no loss"
_BEST = "best-checkpoint tracking is not built; pick a checkpoint from metrics.jsonl"
# transformers' AcceleratorConfig() as TRL's __post_init__ fills it in (and dataclasses.asdict writes it out)
_ACCELERATOR_DEFAULTS = {"split_batches": False, "dispatch_batches": None, "even_batches": True,
                         "use_seedable_sampler": True, "non_blocking": False, "gradient_accumulation_kwargs": None,
                         "use_configured_state": False}

_LOADER_KEYS = ("split_batches", "dispatch_batches", "even_batches", "use_seedable_sampler", "non_blocking")


def _count(value) -> str | None:
    return None if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else "must be a count >= 0"


def _positive(value) -> str | None:
    ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0)
    return None if ok else "must be a positive integer or null"


def _boolean(value) -> str | None:
    return None if isinstance(value, bool) else "must be true or false"


def _names(value) -> str | None:
    ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    return None if ok else "must be a list of names"


def _open_r1_callbacks(value) -> str | None:
    if _names(value) is not None:
        return _names(value)
    other = [v for v in value if v != "push_to_hub_revision"]
    return None if not other else (f"has {', '.join(other)}, not one of open-r1's callbacks (push_to_hub_revision); "
                                   "pass callback objects to GRPOTrainer(callbacks=...)")


def _settings(value) -> str | None:
    return None if value is None or isinstance(value, dict) or hasattr(value, "to_dict") else "must be a mapping"


def _pad_multiple(value) -> str | None:
    ok = value in (None, "auto") or (isinstance(value, int) and not isinstance(value, bool) and value > 0)
    return None if ok else "must be a positive integer, 'auto' or null"


def _accelerator_config(value) -> str | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        value = canonical(value)
    if not isinstance(value, dict):
        return "must be a mapping of AcceleratorConfig's keys"
    other = {k: v for k, v in value.items() if k not in _LOADER_KEYS and _ACCELERATOR_DEFAULTS.get(k, object()) != v}
    return (None if not other else f"{', '.join(sorted(other))} set: not supported ({_LAUNCH}); leave "
            + ", ".join(f"{k}={_ACCELERATOR_DEFAULTS.get(k)!r}" for k in sorted(other)))


TABLE: list[TRLKey] = [
    # ---- TRL GRPOConfig's own keys ---------------------------------------------------------------------------
    *_rows("trl", "field",
           ("model_init_kwargs", None), ("ds3_gather_for_generation", True, "FSDP2 too (docs/distributed.md)"),
           ("trust_remote_code", False), ("disable_dropout", False),
           ("router_aux_loss_coef", None, "over the tokens of grpo's padding-free passes (docs/moe.md)"),
           ("cast_lm_head_to_fp32", False, "tied embeddings too, their outputs cast back (as TRL's code does)"),
           ("num_generations", 8), ("max_completion_length", 512), ("shuffle_dataset", True),
           ("generation_batch_size", None), ("steps_per_generation", None), ("temperature", 1.0), ("top_p", 1.0),
           ("top_k", 0), ("min_p", None, "null and 0 both mean off"),
           ("generation_kwargs", None, "the sampling keys grpo's samplers have; others are refused by name"),
           ("chat_template_kwargs", None), ("repetition_penalty", 1.0), ("use_vllm", False),
           ("vllm_mode", "colocate"), ("vllm_model_impl", "vllm"), ("vllm_enable_sleep_mode", False),
           ("vllm_server_base_url", None), ("vllm_server_host", "0.0.0.0"), ("vllm_server_port", 8000),
           ("vllm_server_timeout", 240.0), ("vllm_gpu_memory_utilization", 0.3), ("vllm_max_model_length", None),
           ("vllm_tensor_parallel_size", 1), ("vllm_group_port", 51216), ("beta", 0.0), ("num_iterations", 1),
           ("epsilon", 0.2),
           ("delta", None), ("epsilon_high", None), ("sapo_temperature_neg", 1.05), ("sapo_temperature_pos", 1.0),
           ("vespo_k_pos", 2.0), ("vespo_lambda_pos", 3.0), ("vespo_k_neg", 3.0), ("vespo_lambda_neg", 2.0),
           ("importance_sampling_level", "token"), ("reward_weights", None),
           ("multi_objective_aggregation", "sum_then_normalize"), ("scale_rewards", "group", "true = group, "
                                                                   "false = none"),
           ("loss_type", "dapo", "sets loss_aggregation and surrogate (README: our default is grpo's pair)"),
           ("mask_truncated_completions", False), ("sync_ref_model", False), ("ref_model_mixup_alpha", 0.6),
           ("ref_model_sync_steps", 512), ("top_entropy_quantile", 1.0), ("entropy_coef", 0.0),
           ("use_adaptive_entropy", False), ("entropy_coef_min", 0.0), ("entropy_coef_max", 1.0),
           ("entropy_coef_delta", 0.005), ("entropy_target", 0.2), ("vllm_importance_sampling_correction", True),
           ("vllm_importance_sampling_mode", "sequence_mask"), ("vllm_importance_sampling_clip_max", 3.0),
           ("vllm_importance_sampling_clip_min", None), ("off_policy_mask_threshold", None),
           ("use_bias_correction_kl", True), ("log_completions", False, "samples go to output_dir/samples/"),
           ("num_completions_to_print", None), ("log_unique_prompts", False),
           ("max_tool_calling_iterations", None, "rounds of tool calls per completion (docs/agents.md)")),
    *_rows("trl", "alias",
           ("num_generations_eval", "eval_num_samples", None), ("vllm_importance_sampling_cap",
                                                                "vllm_importance_sampling_clip_max", None)),
    *_rows("trl", "default",
           ("cache_implementation", None, "grpo's samplers keep their own KV cache"),
           ("vllm_structured_outputs_regex", None, "regex-guided decoding is not built"),
           ("log_multimodal", True, "grpo trains text models"),
           ("log_completions_hub_repo", None, "samples are written to output_dir/samples/; uploading them to a "
            "dataset repository is not built"),
           ("use_transformers_paged", False, "grpo's samplers batch generation (or set use_vllm)")),
    *_rows("trl", "noop",
           ("pad_to_multiple_of", "auto", "each micro-batch is padded to its own longest row; padding further (for "
            "Neuron's compiler) adds only masked positions, so the loss is the same", _pad_multiple),
           ("use_transformers_continuous_batching", False, "grpo's samplers already batch each rollout's generation "
            "(the same samples of the policy); no separate batching mode to switch on", _boolean),
           ("transformers_continuous_batching_config", None, "settings of transformers' continuous-batching engine "
            "(blocks, batch tokens, ...), which grpo does not run: its samplers batch each rollout themselves (the "
            "same samples of the policy)", _settings)),
    # ---- TRL GRPOTrainer's arguments that grpo also takes as config keys (docs/agents.md) --------------------------
    *_rows("trainer", "field",
           ("tools", None, "GRPOTrainer(tools=...) or a list of built-in names / 'module:function' paths; ours: "
            "the task's"),
           ("environment_factory", None, "GRPOTrainer(environment_factory=...) or a 'module:Class' path (a map of "
            "them by the environment column)"),
           ("rollout_func", None, "GRPOTrainer(rollout_func=...) or a 'module:function' path")),
    # ---- transformers TrainingArguments (TRL's defaults) ------------------------------------------------------
    *_rows("ta", "field",
           ("output_dir", None, "TRL: trainer_output"), ("per_device_train_batch_size", 8), ("num_train_epochs", 3.0),
           ("max_steps", -1, "optimizer steps, as TRL counts them"), ("learning_rate", 1e-6),
           ("lr_scheduler_type", "linear"), ("lr_scheduler_kwargs", None), ("warmup_steps", 0),
           ("weight_decay", 0.0), ("adam_beta1", 0.9), ("adam_beta2", 0.999), ("adam_epsilon", 1e-8),
           ("gradient_accumulation_steps", 1), ("max_grad_norm", 1.0),
           ("bf16", None, "null: true unless fp16 (TRL)"), ("fp16", False), ("tf32", None),
           ("gradient_checkpointing", True), ("gradient_checkpointing_kwargs", None), ("use_liger_kernel", False),
           ("logging_strategy", "steps"), ("logging_steps", 10), ("logging_first_step", False),
           ("log_level", "passive"), ("disable_tqdm", None), ("report_to", "none"), ("run_name", None),
           ("project", "huggingface", "Trackio's project"),
           ("eval_strategy", "no"), ("eval_steps", None), ("per_device_eval_batch_size", 8),
           ("eval_on_start", False), ("save_only_model", False), ("save_strategy", "steps"), ("save_steps", 500),
           ("save_total_limit", None), ("push_to_hub", False), ("hub_token", None), ("hub_private_repo", None),
           ("hub_model_id", None), ("hub_strategy", "every_save"), ("hub_revision", None),
           ("full_determinism", False), ("seed", 42), ("data_seed", None), ("use_cpu", False),
           ("remove_unused_columns", False), ("resume_from_checkpoint", None)),
    *_rows("ta", "alias",
           ("activation_checkpointing", "gradient_checkpointing", None, "transformers 5's name"),
           ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs", None, "transformers 5's name")),
    *_rows("ta", "default",
           ("optim", "adamw_torch_fused", "the optimizer is torch's AdamW (fused where every parameter allows "
            "it); others are not built", ["adamw_torch"]),
           ("optim_args", None, "AdamW's settings are adam_beta1, adam_beta2, adam_epsilon, weight_decay"),
           ("optim_target_modules", None, "GaLore-style optimizers are not built"),
           ("average_tokens_across_devices", True, "token means count every process's tokens (true's meaning)"),
           ("label_smoothing_factor", 0.0, "GRPO has no labels"),
           ("bf16_full_eval", False, "eval runs in the training precision"),
           ("fp16_full_eval", False, "eval runs in the training precision"),
           ("torch_compile", False, "torch.compile of the model is not built (the CPU engine compiles its own "
            "kernels)"),
           ("torch_compile_backend", None, "torch.compile of the model is not built"),
           ("torch_compile_mode", None, "torch.compile of the model is not built"),
           ("liger_kernel_config", None, "Liger's layer kernels are applied with their defaults (use_liger_kernel)"),
           ("use_cache", False, "the KV cache is used in sampling, never in the update"),
           ("neftune_noise_alpha", None, "NEFTune embedding noise is an SFT technique; not built"),
           ("torch_empty_cache_steps", None, "not built: buffers are released between rollout and update"),
           ("auto_find_batch_size", False, "halving the batch would split groups (TRL refuses it too); lower "
            "per_device_train_batch_size"),
           ("log_on_each_node", True, "the main process logs"),
           ("logging_nan_inf_filter", True, "a NaN loss is always logged as NaN and its step skipped (README)",
            [False]),
           ("include_num_input_tokens_seen", "no", "num_tokens is always logged", [False]),
           ("log_level_replica", "warning", "the main process logs"),
           ("trackio_space_id", None, "Trackio on a hub Space is not built: trackio logs locally"),
           ("trackio_bucket_id", None, "Trackio on a hub Space is not built: trackio logs locally"),
           ("trackio_static_space_id", None, "Trackio on a hub Space is not built: trackio logs locally"),
           ("eval_delay", 0, "eval_steps counts from the start"),
           ("prediction_loss_only", False, _EVAL), ("eval_do_concat_batches", True, _EVAL),
           ("eval_use_gather_object", False, _EVAL), ("eval_accumulation_steps", None, _EVAL),
           ("include_for_metrics", [], _EVAL), ("batch_eval_metrics", False, _EVAL),
           ("save_on_each_node", False, "the main process writes checkpoints"),
           ("enable_jit_checkpoint", False, "a killed run resumes exactly from its last checkpoint (README)"),
           ("hub_always_push", False, "every save is uploaded, the next one after it (true's meaning)", [True]),
           ("load_best_model_at_end", False, _BEST), ("metric_for_best_model", None, _BEST),
           ("greater_is_better", None, _BEST),
           ("ignore_data_skip", False, "resume restores the prompt order exactly: nothing is skipped"),
           ("restore_callback_states_from_checkpoint", False, "callback states are not checkpointed"),
           ("parallelism_config", None, "context (cp_size) and tensor (tp_size) parallelism are not built; "
            "{sp_size: N} alone is sequence_parallel_size"),
           ("label_names", None, "GRPO has no labels"),
           ("train_sampling_strategy", "random", "prompts are shuffled each epoch (shuffle_dataset)"),
           ("length_column_name", "length", "length grouping is not built"),
           ("ddp_find_unused_parameters", None, _LAUNCH), ("ddp_bucket_cap_mb", None, _LAUNCH),
           ("ddp_broadcast_buffers", None, _LAUNCH), ("ddp_static_graph", None, _LAUNCH),
           ("ddp_backend", None, _LAUNCH), ("ddp_timeout", 1800, _LAUNCH),
           ("fsdp", None, _LAUNCH, ["", []]), ("fsdp_config", None, _LAUNCH), ("deepspeed", None, _LAUNCH),
           ("debug", "", "accelerate's debug options are not built", [[], None]),
           ("skip_memory_metrics", True, "memory is measured by bench/ (README, Benchmark)"),
           ("do_train", False, "`grpo train` and train() always train", [True]),
           ("do_predict", False, "prediction is not built; `grpo eval` scores a model"),
           ("local_rank", -1, "set by the launcher")),
    *_rows("ta", "noop",
           ("dataloader_num_workers", 0, _NO_LOADER_NOOP, _count), ("dataloader_pin_memory", True, _NO_LOADER_NOOP,
                                                                    _boolean),
           ("dataloader_persistent_workers", False, _NO_LOADER_NOOP, _boolean),
           ("dataloader_prefetch_factor", None, _NO_LOADER_NOOP, _positive), ("dataloader_multiprocessing_context", None,
                                                                   _NO_LOADER_NOOP),
           ("dataloader_in_order", True, _NO_LOADER_NOOP, _boolean),
           ("dataloader_drop_last", False, _NO_LOADER_NOOP, _boolean),
           ("do_eval", False, "for scripts, as in transformers (whose Trainer does not read it either): open-r1's "
            "grpo.py calls trainer.evaluate() after training when it is true; the trainer scores the eval set as "
            "eval_strategy says", _boolean),
           ("accelerator_config", None, "its DataLoader settings (split_batches, dispatch_batches, even_batches, "
            "use_seedable_sampler, non_blocking) have nothing to act on: grpo reads prompts from memory; the rest "
            "is refused (" + _LAUNCH + ")", _accelerator_config)),
    # ---- TRL ModelConfig and ScriptArguments (TRL's grpo.py and open-r1's scripts) ----------------------------
    *_rows("model", "field",
           ("model_name_or_path", None, "ours: the shipped tiny model"), ("model_revision", "main"),
           ("torch_dtype", "float32", "TRL 1.16: dtype"), ("attn_implementation", None), ("use_peft", False),
           ("lora_r", 16), ("lora_alpha", 32), ("lora_dropout", 0.05),
           ("lora_target_modules", None, "null: peft's per-model default; ours: all-linear"),
           ("lora_target_parameters", None), ("lora_modules_to_save", None), ("use_rslora", False),
           ("use_dora", False), ("load_in_4bit", False),
           ("bnb_4bit_quant_type", "nf4"), ("use_bnb_nested_quant", False)),
    *_rows("model", "alias", ("dtype", "torch_dtype", "float32")),
    *_rows("model", "default",
           ("lora_task_type", "CAUSAL_LM", "grpo trains causal LMs"),
           ("load_in_8bit", False, "8-bit loading is not built; load_in_4bit (QLoRA) is"),
           ("bnb_4bit_quant_storage", None, "4-bit weights are stored as bitsandbytes chooses")),
    *_rows("script", "field", ("dataset_name", None), ("dataset_config", None),
           ("dataset_streaming", False, "needs max_steps, as TRL's IterableDataset does")),
    *_rows("script", "alias", ("dataset_train_split", "dataset_split", "train"),
           ("dataset_test_split", "eval_split", "test")),
    *_rows("script", "default",
           ("ignore_bias_buffers", False, "a DDP detail of TRL's scripts, not needed here")),
    # ---- open-r1 (src/open_r1/configs.py) and keys of older TRL / transformers in its recipes --------------------
    *_rows("open-r1", "field",
           ("chat_template", None), ("system_prompt", None, "with a chat template, prompts become [system, user] "
                                     "messages, as open-r1's script builds them"),
           ("wandb_entity", None), ("wandb_project", None), ("wandb_run_group", None),
           ("reward_funcs", ["accuracy", "format", "tag_count"], "ours: the task's")),
    *_rows("open-r1", "alias",
           ("hub_model_revision", "hub_revision", "main"),
           ("wandb_log_unique_prompts", "log_unique_prompts", True), ("dataset_prompt_column", "prompt_column",
                                                                      "prompt")),
    *_rows("open-r1", "reward",
           ("cosine_min_value_wrong", 0.0), ("cosine_max_value_wrong", -0.5), ("cosine_min_value_correct", 0.5),
           ("cosine_max_value_correct", 1.0), ("cosine_max_len", 1000), ("repetition_n_grams", 3),
           ("repetition_max_penalty", -1.0), ("code_language", "python"), ("max_completion_len", 16384),
           ("soft_punish_cache", 4096), ("code_eval_test_batch_size", 1), ("code_eval_scoring_mode", "weighted_sum"),
           ("parallel_code_exec_per_proc", 2), ("code_provider", "e2b"), ("ioi_provider", "piston"),
           ("e2b_router_url", None), ("morph_router_url", None)),
    *_rows("open-r1", "default",
           ("overwrite_hub_revision", False, "pushing a branch per checkpoint is not built (hub_revision)"),
           ("push_to_hub_revision", False, "pushing a branch per checkpoint is not built (hub_revision)"),
           ("dataset_mixture", None, "dataset mixtures are not built: mix the data into one file")),
    *_rows("open-r1", "noop",
           ("benchmarks", [], "lighteval benchmarks after training are open-r1's Slurm jobs: skipped, with one line "
            "at the start saying so; run them on final/", _names),
           ("callbacks", [], "open-r1's push_to_hub_revision (each checkpoint pushed to a branch of its own) is "
            "skipped, with one line at the start saying so; push_to_hub uploads to hub_revision. Pass callback "
            "objects to GRPOTrainer(callbacks=...)", _open_r1_callbacks)),
    *_rows("legacy", "field", ("max_prompt_length", 512, "TRL < 1.0"), ("warmup_ratio", 0.0, "transformers < 5"),
           ("overwrite_output_dir", False, "transformers < 5; an output_dir holding a run is refused without it "
            "(or resume)")),
    *_rows("legacy", "default",
           ("vllm_device", "auto", "removed in TRL 0.18: colocated vLLM runs on the trainer's device")),
]
TRL_KEYS: dict[str, TRLKey] = {row.name: row for row in TABLE}
REWARD_SETTINGS = {row.name: row.default for row in TABLE if row.kind == "reward"}


def canonical(value: Any) -> Any:
    """A value as compared with a table default: enums by their value, tuples as lists."""
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, tuple):
        return [canonical(v) for v in value]
    if isinstance(value, list):
        return [canonical(v) for v in value]
    return value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return a == b


def _blank(row: TRLKey, value: Any) -> bool:
    value = canonical(value)
    return value is None or value == "" or value == [] or (value is False and not isinstance(row.default, bool))


def accepts(row: TRLKey, value: Any) -> bool:
    value = canonical(value)
    return any(_same(value, ok) for ok in (row.default, *row.accept))


def split_keys(values: dict[str, Any], fields: set[str]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(values for our fields, TRL keys accepted at their default, open-r1 reward settings) from the given keys.

    Table aliases move to our key unless they hold the source's default (then they were not set); a `default` row
    at another value is a ConfigError naming the key, why and what to use."""
    ours, extras, rewards = {}, {}, {}
    for key, value in values.items():
        row = TRL_KEYS.get(key)
        if row is None or row.kind == "field" or (key in fields and row.source not in ("trl", "ta", "open-r1")):
            ours[key] = value
        elif row.kind == "alias":
            if not _same(canonical(value), row.default):
                if row.target in values and not _same(values[row.target], value):
                    raise ConfigError(f"both {key!r} and {row.target!r} are set; {key} is {row.source}'s name for "
                                      f"{row.target}, keep one.")
                ours[row.target] = value
        elif row.kind == "reward":
            rewards[key] = value
        elif row.kind == "noop":
            problem = row.check(canonical(value)) if row.check is not None else None
            if problem is not None:
                raise ConfigError(f"{key}: {value!r} {problem}.")
            extras[key] = value
        elif accepts(row, value):
            if not _blank(row, value):  # (a parser's blank for a key accepted at its default: the default)
                extras[key] = value
        else:
            also = "".join(f" or {a!r}" for a in row.accept if not isinstance(a, dict))
            raise ConfigError(f"{key}: {value!r} is not supported ({row.note}); leave it at {row.default!r}{also}.")
    return ours, extras, rewards


def accepted_default(cfg, name: str) -> Any:
    """What `cfg.<name>` reads for a TRL key that is not a field: its accepted value, else the table default."""
    extras = cfg.__dict__.get("_trl_extras", {})
    if name in extras:
        return extras[name]
    row = TRL_KEYS.get(name)
    if row is not None and row.kind == "alias":
        return getattr(cfg, row.target)
    if row is None or row.kind == "field":
        raise AttributeError(f"'GRPOConfig' object has no attribute {name!r}")
    if row.kind == "reward":
        return cfg.__dict__.get("open_r1_rewards", {}).get(name, row.default)
    return row.default
