"""The one typed configuration of a `grpo` run.

Every setting is a field of `GRPOConfig` with its default and a one-line help text in the field's metadata; the
reference documentation (`docs/config.md`, `grpo train --help-config`) is generated from these definitions, so it
cannot drift. A config is validated once, when it is built (`__post_init__`), and every error names the key.

Key names follow TRL's `GRPOConfig` and open-r1's recipes where those exist, so a TRL user's knobs carry over;
the seed tutorial's names (`kl_penalty`, `clip_range`) and TRL's `loss_type` are accepted as aliases.
A `preset` (grpo, dr_grpo, dapo, gspo) is a starting point applied by `from_dict` / `load` (recipes and the
command line); keys the recipe sets win. In Python, `GRPOConfig.from_dict({"preset": "dapo", ...})`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import yaml

DEFAULT_MODEL = str(Path(__file__).parent / "assets" / "tiny-arith")


class ConfigError(ValueError):
    """A bad key or value in a config. The message names the key and says what to do."""


def _f(default: Any, help: str, choices: tuple | None = None, **kwargs: Any) -> Any:
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta, **kwargs)
    return field(default=default, metadata=meta, **kwargs)


# Names other tools use for the same setting: alias -> our key. A value for an alias is moved to the key.
ALIASES = {
    "kl_penalty": "beta",  # seed tutorial 004
    "clip_range": "epsilon",  # seed tutorial 004
    "dtype": "torch_dtype",  # transformers >= 4.56
    "num_epochs": "num_train_epochs",
    "vllm_importance_sampling_cap": "vllm_importance_sampling_clip_max",  # TRL's deprecated name
    "ppo_max_token_len_per_gpu": "max_tokens_per_micro_batch",  # verl (with use_dynamic_bsz: true)
}

# Named starting points (`preset: dapo`); any key the recipe or command line sets wins over the preset's.
PRESETS: dict[str, dict[str, Any]] = {
    # DeepSeekMath (2402.03300): group-normalized advantages, per-sequence mean, k3 KL at 0.04.
    "grpo": {"beta": 0.04, "kl_estimator": "k3", "epsilon": 0.2, "epsilon_high": 0.2, "scale_rewards": "group",
             "loss_aggregation": "sequence_mean", "importance_sampling_level": "token"},
    # Dr. GRPO (2503.20783): no std division, no 1/|o| length normalization (a constant instead), no KL.
    "dr_grpo": {"beta": 0.0, "scale_rewards": "none", "loss_aggregation": "constant"},
    # DAPO (2503.14476): clip-higher, token-level mean, no KL, dynamic sampling, soft overlong punishment
    # (their buffer is 4,096 of 20,480 tokens: a fifth of the length limit).
    "dapo": {"beta": 0.0, "epsilon": 0.2, "epsilon_high": 0.28, "loss_aggregation": "token_mean",
             "dynamic_sampling": True, "overlong_buffer_ratio": 0.2},
    # GSPO (2507.18071): sequence-level (geometric-mean) ratio with the paper's clip range, no KL.
    "gspo": {"beta": 0.0, "importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4,
             "loss_aggregation": "sequence_mean"},
}

# TRL's `loss_type` chooses the aggregation; we keep aggregation as its own named setting.
LOSS_TYPE_TO_AGGREGATION = {
    "grpo": "sequence_mean",
    "bnpo": "token_mean",
    "dapo": "token_mean",
    "dr_grpo": "constant",
}


@dataclass
class GRPOConfig:
    # ---- model -------------------------------------------------------------------------------------------------
    model_name_or_path: str = _f(DEFAULT_MODEL, "Model to train: a local Hugging Face directory or a hub name. "
                                 "Default: the tiny arithmetic model shipped in the package.")
    torch_dtype: str = _f("float32", "Weights dtype.", ("float32", "bfloat16", "float16", "auto"))
    bf16: bool = _f(False, "TRL compatibility: true means torch_dtype=bfloat16.")
    attn_implementation: str | None = _f(None, "Attention kernel passed to from_pretrained (eager, sdpa, "
                                         "flash_attention_2). Default: transformers' choice.")
    gradient_checkpointing: bool = _f(False, "Recompute activations in backward to save memory (slower).")
    gradient_checkpointing_kwargs: dict | None = _f(None, "Passed to gradient_checkpointing_enable().")
    load_in_4bit: bool = _f(False, "QLoRA: load the base model in 4 bits through bitsandbytes (needs a CUDA GPU).")
    use_peft: bool = _f(False, "Train LoRA adapters (peft) instead of all weights.")
    lora_r: int = _f(16, "LoRA rank.")
    lora_alpha: int = _f(32, "LoRA alpha (scaling = alpha / r).")
    lora_dropout: float = _f(0.05, "LoRA dropout.")
    lora_target_modules: Any = _f("all-linear", "Modules that get adapters: a list of names or 'all-linear'.")
    merge_lora_on_save: bool = _f(True, "Merge adapters into the base weights in final/ (adapters are also "
                                  "saved separately in final/adapter/).")

    # ---- data --------------------------------------------------------------------------------------------------
    task: str | None = _f("arithmetic", "Built-in task (arithmetic, countdown) used when dataset_name is "
                          "not set; it also supplies default rewards and prefill.")
    task_difficulty: int | None = _f(None, "Difficulty level of the built-in task (default: the task's own).")
    task_train_size: int = _f(20000, "Number of generated training problems of the built-in task.")
    task_eval_size: int = _f(200, "Number of held-out problems of the built-in task used for eval during training.")
    dataset_name: str | None = _f(None, "Training data: a jsonl/json/csv/parquet file, a save_to_disk "
                                  "directory, or a hub dataset name.")
    dataset_config: str | None = _f(None, "Hub dataset configuration name.")
    dataset_split: str = _f("train", "Split of dataset_name to train on.")
    eval_dataset_name: str | None = _f(None, "Eval data (same forms as dataset_name).")
    eval_split: str = _f("test", "Split of eval_dataset_name.")
    prompt_column: str | None = _f(None, "Column holding the prompt text or chat messages. Default: the first "
                                   "of prompt, problem, question present.")
    system_prompt: str | None = _f(None, "System prompt (a system message for chat models, a prefix otherwise).")
    prefill: str | None = _f(None, "Text the completion is forced to start with, e.g. '<think>'. Default: the "
                             "task's prefill, else none.")
    use_chat_template: Any = _f("auto", "Render prompts with the tokenizer's chat template: true, false or auto "
                                "(when the tokenizer has one).")
    max_prompt_length: int | None = _f(512, "Longest prompt in tokens (null: no limit).")
    prompt_truncation: str = _f("error", "What to do with a longer prompt.", ("error", "left"))

    # ---- rewards -----------------------------------------------------------------------------------------------
    reward_funcs: list = _f([], "Reward functions: built-in names, 'module:function' paths, reward-model "
                            "directories, or {name: ..., <factory args>} maps. Default: the task's.")
    reward_weights: list | None = _f(None, "One weight per reward function. Default: the task's, else all 1.")
    reward_on_error: str = _f("raise", "A reward function that raises: stop with an error naming it, or count "
                              "it and score 0.", ("raise", "zero"))
    reward_on_nonfinite: str = _f("raise", "A NaN/inf reward: stop with an error, or treat it as 'does not "
                                  "apply' (None) and count it.", ("raise", "none"))
    reward_timeout: float | None = _f(60.0, "Seconds one reward-function call may take before it counts as failed "
                                      "(reward_on_error decides: stop, or score the batch 0). null: no limit.")
    step_reward_funcs: list = _f([], "Step-reward functions for process supervision (e.g. arithmetic_steps).")
    process_weight: float = _f(1.0, "Weight of the process (step) advantages when step_reward_funcs is set.")
    outcome_weight: float = _f(1.0, "Weight of the outcome advantages when step_reward_funcs is set "
                               "(0 = process supervision alone).")

    # ---- generation --------------------------------------------------------------------------------------------
    num_generations: int = _f(8, "Completions per prompt: the group size G.")
    prompts_per_step: int | None = _f(None, "Prompts per step, all processes together. Default: enough to fill "
                                      "per_device_train_batch_size x gradient_accumulation_steps x processes "
                                      "completions, at least 1.")
    generation_batch_size: int | None = _f(None, "TRL compatibility: completions per step, all processes "
                                           "together; must be a multiple of num_generations. Sets prompts_per_step.")
    max_completion_length: int = _f(256, "Most tokens generated per completion.")
    temperature: float = _f(1.0, "Sampling temperature (log-probs are computed at the same temperature).")
    top_p: float = _f(1.0, "Nucleus sampling threshold.")
    top_k: int = _f(0, "Top-k sampling (0: off).")
    min_p: float = _f(0.0, "Min-p sampling (0: off).")
    repetition_penalty: float = _f(1.0, "Repetition penalty in sampling (1: off).")
    engine: str = _f("auto", "Rollout and update engine: cpu (compiled paths for a float32 model in one process on "
                     "the CPU), transformers (any model and device), or auto: cpu where it applies, transformers "
                     "otherwise. The run prints which it took and why.", ("auto", "transformers", "cpu"))
    use_vllm: bool = _f(False, "Generate with vLLM (TRL's key): pip install 'grpo[vllm]' on a GPU machine, or the "
                        "CPU build in an environment of its own (bash scripts/vllm_env.sh).")
    vllm_mode: str = _f("colocate", "colocate: a vLLM engine in the trainer's process, on its device; server: a "
                        "`grpo vllm-serve` process that every trainer process sends prompts to. Either is given the "
                        "policy's weights after every optimizer step.", ("colocate", "server"))
    vllm_server_base_url: str | None = _f(None, "Server mode: the server's URL, e.g. http://10.0.0.2:8000 (then "
                                          "vllm_server_host and vllm_server_port are not used).")
    vllm_server_host: str = _f("0.0.0.0", "Server mode: the server's host.")
    vllm_server_port: int = _f(8000, "Server mode: the server's port.")
    vllm_server_timeout: float = _f(240.0, "Server mode: seconds to wait for the server to answer at start.")
    vllm_gpu_memory_utilization: float = _f(0.3, "Fraction of the device's memory vLLM may take (its weights and KV "
                                            "cache; on vLLM's CPU build, of the machine's RAM).")
    vllm_tensor_parallel_size: int = _f(1, "Devices one vLLM engine shards the model over.")
    vllm_enable_sleep_mode: bool = _f(False, "Free vLLM's device memory during the update (vLLM's sleep mode; "
                                      "GPU only) and take it back for the next rollout.")
    vllm_max_model_length: int | None = _f(None, "Context length of the vLLM engine (null: the model's).")
    vllm_model_impl: str = _f("vllm", "Model implementation vLLM runs: its own or transformers'.",
                              ("vllm", "transformers"))
    vllm_engine_kwargs: dict = _f({}, "Further keyword arguments for vllm.LLM (e.g. enforce_eager: true).")
    vllm_importance_sampling_correction: bool = _f(True, "Weight each token's surrogate by pi_old / pi_vllm, "
                                                   "bounded as vllm_importance_sampling_mode says (TRL 1.16's).")
    vllm_importance_sampling_mode: str = _f("sequence_mask", "token_truncate, token_mask, sequence_truncate or "
                                            "sequence_mask (grpo.core.engine_importance_weights).",
                                            ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"))
    vllm_importance_sampling_clip_max: float | None = _f(3.0, "Upper bound of the importance ratio (null: none).")
    vllm_importance_sampling_clip_min: float | None = _f(None, "Lower bound of the importance ratio (null: none).")

    # ---- optimization ------------------------------------------------------------------------------------------
    learning_rate: float = _f(1e-6, "Peak AdamW learning rate.")
    lr_scheduler_type: str = _f("constant", "Learning-rate schedule after warmup.", ("constant", "linear", "cosine"))
    warmup_ratio: float = _f(0.0, "Fraction of steps spent warming up linearly (used when warmup_steps is 0).")
    warmup_steps: int = _f(0, "Warmup steps.")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    adam_beta1: float = _f(0.9, "AdamW beta1.")
    adam_beta2: float = _f(0.999, "AdamW beta2.")
    adam_epsilon: float = _f(1e-8, "AdamW epsilon.")
    max_grad_norm: float = _f(1.0, "Clip the gradient norm to this (0: no clipping).")
    max_nonfinite_steps: int = _f(3, "Stop after this many optimizer steps in a row with a non-finite gradient "
                                  "(each one is skipped and its inputs saved under output_dir/nonfinite/).")
    max_steps: int = _f(-1, "Steps to train; a step is one rollout batch. -1: use num_train_epochs.")
    num_train_epochs: float = _f(1.0, "Passes over the training prompts (when max_steps is -1).")
    per_device_train_batch_size: int = _f(8, "Completions per forward/backward pass on one process (memory knob).")
    max_tokens_per_micro_batch: int | None = _f(None, "Token-budget micro-batches (verl's use_dynamic_bsz with "
                                                "ppo_max_token_len_per_gpu, an alias): fill each micro-batch of the "
                                                "update and the reference pass with completions up to this many "
                                                "tokens on one process, instead of per_device_train_batch_size "
                                                "completions (null), so long and short completions cost what they "
                                                "are. A completion longer than the budget goes alone.")
    use_remove_padding: bool = _f(True, "Padding-free passes (verl's key): the update's and the reference pass's "
                                  "sequences packed end to end, a group's prompt once where the attention takes a "
                                  "custom mask (sdpa, eager), so the model computes real tokens only (docs/engines.md). "
                                  "false: rows padded to the longest. The run prints which it took.")
    gradient_accumulation_steps: int = _f(1, "TRL compatibility: only sizes the default prompts_per_step.")
    num_iterations: int = _f(1, "Optimizer updates per rollout batch (mu in the paper).")
    num_threads: int | None = _f(None, "CPU threads for torch (null: torch's default). Small models on a busy "
                                 "machine run far faster on 1 thread than on oversubscribed cores.")
    seed: int = _f(42, "Seed of data order, sampling and initialization: a CPU run repeats exactly.")

    # ---- loss --------------------------------------------------------------------------------------------------
    beta: float = _f(0.04, "KL penalty coefficient (DeepSeekMath: 0.04). 0 skips the reference model.")
    reference_weights: str = _f("auto", "Where the reference model's weights stay between reference passes (beta > 0, "
                                "full fine-tuning): memory, or disk (a file in output_dir that each pass maps back "
                                "in, so the process holds them only during that pass; ~10 ms per step for a 170 MB "
                                "reference). auto: disk with the cpu engine, memory otherwise.",
                                ("auto", "memory", "disk"))
    kl_estimator: str = _f("k3", "KL estimator (Schulman): k1, k2 or k3 (the paper's).", ("k1", "k2", "k3"))
    epsilon: float = _f(0.2, "Clip range: ratio clipped to [1-epsilon, 1+epsilon_high].")
    epsilon_high: float | None = _f(None, "Upper clip range (DAPO clip-higher uses 0.28). Default: epsilon.")
    importance_sampling_level: str = _f("token", "Ratio per token (GRPO) or per sequence (GSPO).",
                                        ("token", "sequence"))
    loss_aggregation: str = _f("sequence_mean", "How token losses are averaged: per sequence then over "
                               "sequences (paper), over all tokens (DAPO), or by a constant (Dr. GRPO).",
                               ("sequence_mean", "token_mean", "constant"))
    loss_type: str | None = _f(None, "TRL compatibility: grpo, bnpo, dapo or dr_grpo; sets loss_aggregation.")
    scale_rewards: str = _f("group", "Std used to scale advantages.", ("group", "batch", "none"))
    advantage_eps: float = _f(1e-4, "Added to the std before dividing.")
    unbiased_std: bool = _f(True, "Bessel-corrected (n-1) std, as the seeds compute it.")
    dynamic_sampling: bool = _f(False, "DAPO dynamic sampling: drop groups whose rewards are all equal and sample "
                                "more prompts until the step has prompts_per_step groups (one process only).")
    max_generation_rounds: int = _f(3, "Most generation rounds per step with dynamic_sampling; after that the step "
                                    "trains on the groups it has.")
    overlong_buffer_ratio: float = _f(0.0, "DAPO soft overlong punishment: completions longer than (1 - ratio) x "
                                      "max_completion_length lose up to 1 reward, linearly (0: off).")
    mask_truncated_completions: bool = _f(False, "Leave completions cut at max_completion_length out of the loss.")

    # ---- logging, eval, checkpoints ----------------------------------------------------------------------------
    output_dir: str = _f("runs/default", "Run directory: metrics, samples, checkpoints, final model.")
    logging_steps: int = _f(1, "Print and log metrics every N steps.")
    log_completions_steps: int = _f(10, "Write sample completions with their rewards every N steps (0: never).")
    report_to: list = _f(["tensorboard"], "Metric sinks besides metrics.jsonl: tensorboard, wandb.")
    eval_steps: int = _f(0, "Score the eval set every N steps (0: only at the end when an eval set exists).")
    eval_num_samples: int = _f(1, "Completions per eval prompt (k of pass@k).")
    eval_temperature: float = _f(1.0, "Sampling temperature for eval.")
    save_steps: int = _f(50, "Write a checkpoint every N steps (0: only the final model).")
    save_total_limit: int = _f(2, "Checkpoints kept (oldest deleted first).")
    resume: bool = _f(False, "Continue from the newest complete checkpoint in output_dir.")
    preset: str | None = _f(None, "Named starting point (grpo, dr_grpo, dapo, gspo) that the rest overrides.")
    _preset_applied: dataclasses.InitVar[bool] = False  # set by from_dict, which merged the preset already

    def __post_init__(self, _preset_applied: bool = False) -> None:
        if self.preset in PRESETS and not _preset_applied:
            # Constructed directly: the preset fills every key still at its default.
            for key, value in PRESETS[self.preset].items():
                f = self.__dataclass_fields__[key]
                if getattr(self, key) == f.default:
                    setattr(self, key, value)
        _coerce_types(self)
        if self.bf16:
            self.torch_dtype = "bfloat16"
        if self.loss_type is not None:
            if self.loss_type not in LOSS_TYPE_TO_AGGREGATION:
                raise ConfigError(f"loss_type: unknown value {self.loss_type!r}; choose one of "
                                  f"{', '.join(LOSS_TYPE_TO_AGGREGATION)} (or set loss_aggregation).")
            self.loss_aggregation = LOSS_TYPE_TO_AGGREGATION[self.loss_type]
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        _validate(self)

    # -- construction from files and the command line ----------------------------------------------------------
    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "GRPOConfig":
        values = _apply_aliases(dict(values))
        preset = values.get("preset")
        if preset is not None:
            if preset not in PRESETS:
                raise ConfigError(f"preset: unknown value {preset!r}; choose one of {', '.join(PRESETS)}.")
            values = {**PRESETS[preset], **values, "_preset_applied": True}  # the recipe's own keys win
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known - {"_preset_applied"})
        if unknown:
            raise ConfigError(f"unknown config key {unknown[0]!r}" + _suggest(unknown[0], known) +
                              "; `grpo train --help-config` lists every key.")
        return cls(**values)

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] = ()) -> "GRPOConfig":
        """Read a YAML recipe (or none: the defaults), apply `key=value` overrides, validate once."""
        values: dict[str, Any] = {}
        if path is not None:
            values = read_yaml(path)
        for item in overrides:
            key, value = parse_override(item)
            values[key] = value
        return cls.from_dict(values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


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


def _apply_aliases(values: dict[str, Any]) -> dict[str, Any]:
    for alias, key in ALIASES.items():
        if alias in values:
            if key in values:
                raise ConfigError(f"both {alias!r} and {key!r} are set; they are the same setting, keep one.")
            values[key] = values.pop(alias)
    return values


def _suggest(name: str, known: set[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, sorted(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _coerce_types(cfg: GRPOConfig) -> None:
    """YAML gives `1e-6` as a string and `1` where a float is meant: coerce by the field's type, or fail naming it."""
    hints = get_type_hints(GRPOConfig)
    for f in dataclasses.fields(cfg):
        value, hint = getattr(cfg, f.name), str(hints[f.name])
        if value is None:
            if "None" not in hint and hint != "typing.Any":
                raise ConfigError(f"{f.name}: must be set (got null).")
            continue
        try:
            if hint == "<class 'bool'>":
                value = _to_bool(value)
            elif "float" in hint and not isinstance(value, bool):
                value = float(value)
            elif "int" in hint and not isinstance(value, bool):
                if isinstance(value, float) and not value.is_integer():
                    raise ValueError
                value = int(value)
            elif "str" in hint and not isinstance(value, str):
                raise ValueError
            elif "list" in hint and not isinstance(value, list):
                value = [value] if isinstance(value, (str, dict)) else list(value)
        except (TypeError, ValueError):
            kind = hint.replace("<class '", "").replace("'>", "").replace("typing.", "")
            raise ConfigError(f"{f.name}: expected {kind}, got {value!r}.") from None
        setattr(cfg, f.name, value)


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
        return value.lower() in ("true", "yes", "1")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(value)


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


def _validate(cfg: GRPOConfig) -> None:
    """Every rule that needs no model and no data; each failure names the key (reliability.md section 4.2)."""
    for f in dataclasses.fields(cfg):
        choices = f.metadata.get("choices")
        value = getattr(cfg, f.name)
        if choices and value not in choices:
            raise ConfigError(f"{f.name}: unknown value {value!r}; choose one of {', '.join(map(str, choices))}.")
    # G first, before any division by it (TRL 1.16 fails with ZeroDivisionError on num_generations=0).
    _check(cfg.num_generations >= 2, "num_generations",
           f"must be an integer >= 2 (got {cfg.num_generations}): GRPO normalizes rewards within each group.")
    _check(cfg.prompts_per_step is None or cfg.prompts_per_step >= 1, "prompts_per_step", "must be >= 1.")
    if cfg.generation_batch_size is not None:
        _check(cfg.prompts_per_step is None, "generation_batch_size",
               "set generation_batch_size or prompts_per_step, not both (prompts_per_step = it / num_generations).")
        _check(cfg.generation_batch_size >= cfg.num_generations and
               cfg.generation_batch_size % cfg.num_generations == 0, "generation_batch_size",
               f"{cfg.generation_batch_size} completions is not a multiple of num_generations="
               f"{cfg.num_generations}; each prompt needs a full group.")
        # Resolved into prompts_per_step, so the saved config has one source of truth.
        cfg.prompts_per_step, cfg.generation_batch_size = cfg.generation_batch_size // cfg.num_generations, None
    _check(cfg.per_device_train_batch_size >= 1, "per_device_train_batch_size", "must be >= 1.")
    _check(cfg.max_tokens_per_micro_batch is None or cfg.max_tokens_per_micro_batch >= 1,
           "max_tokens_per_micro_batch", "must be >= 1 tokens, or null (micro-batches of per_device_train_batch_size "
           "completions).")
    _check(cfg.gradient_accumulation_steps >= 1, "gradient_accumulation_steps", "must be >= 1.")
    _check(cfg.max_completion_length >= 1, "max_completion_length", "must be >= 1.")
    _check(cfg.max_prompt_length is None or cfg.max_prompt_length >= 1, "max_prompt_length", "must be >= 1 or null.")
    _check(cfg.temperature > 0, "temperature", f"must be > 0 (got {cfg.temperature}); sampling needs diversity.")
    _check(0 < cfg.top_p <= 1, "top_p", f"must be in (0, 1] (got {cfg.top_p}).")
    _check(cfg.top_k >= 0, "top_k", "must be >= 0 (0 turns it off).")
    _check(0 <= cfg.min_p < 1, "min_p", "must be in [0, 1).")
    _check(cfg.repetition_penalty > 0, "repetition_penalty", "must be > 0.")
    _check(math.isfinite(cfg.learning_rate) and cfg.learning_rate > 0, "learning_rate",
           f"must be a finite number > 0 (got {cfg.learning_rate}).")
    _check(cfg.beta >= 0 and math.isfinite(cfg.beta), "beta", "must be >= 0.")
    _check(cfg.epsilon > 0, "epsilon", "must be > 0.")
    _check(cfg.epsilon_high >= cfg.epsilon, "epsilon_high", f"must be >= epsilon ({cfg.epsilon}).")
    _check(cfg.num_iterations >= 1, "num_iterations", "must be >= 1.")
    _check(0 <= cfg.warmup_ratio < 1, "warmup_ratio", "must be in [0, 1).")
    _check(cfg.warmup_steps >= 0, "warmup_steps", "must be >= 0.")
    _check(cfg.max_grad_norm >= 0, "max_grad_norm", "must be >= 0 (0 turns clipping off).")
    _check(cfg.max_steps == -1 or cfg.max_steps >= 1, "max_steps", "must be >= 1, or -1 to use num_train_epochs.")
    _check(cfg.max_steps >= 1 or cfg.num_train_epochs > 0, "num_train_epochs", "must be > 0.")
    _check(cfg.reward_timeout is None or cfg.reward_timeout > 0, "reward_timeout", "must be > 0 seconds, or null.")
    _check(cfg.num_threads is None or cfg.num_threads >= 1, "num_threads", "must be >= 1, or null.")
    _check(cfg.max_generation_rounds >= 1, "max_generation_rounds", "must be >= 1.")
    _check(0 <= cfg.overlong_buffer_ratio < 1, "overlong_buffer_ratio", "must be in [0, 1).")
    _check(cfg.preset is None or cfg.preset in PRESETS, "preset",
           f"unknown value {cfg.preset!r}; choose one of {', '.join(PRESETS)}.")
    _check(cfg.max_nonfinite_steps >= 1, "max_nonfinite_steps", "must be >= 1.")
    _check(cfg.advantage_eps >= 0, "advantage_eps", "must be >= 0.")
    _check(cfg.eval_num_samples >= 1, "eval_num_samples", "must be >= 1.")
    _check(cfg.logging_steps >= 1, "logging_steps", "must be >= 1.")
    _check(cfg.save_steps >= 0 and cfg.eval_steps >= 0 and cfg.log_completions_steps >= 0, "save_steps",
           "save_steps, eval_steps and log_completions_steps must be >= 0.")
    _check(cfg.save_total_limit >= 1, "save_total_limit", "must be >= 1.")
    _check(cfg.use_chat_template in (True, False, "auto"), "use_chat_template", "must be true, false or auto.")
    _check(0 < cfg.vllm_gpu_memory_utilization <= 1, "vllm_gpu_memory_utilization", "must be in (0, 1].")
    _check(cfg.vllm_tensor_parallel_size >= 1, "vllm_tensor_parallel_size", "must be >= 1.")
    _check(cfg.vllm_importance_sampling_clip_max is None or cfg.vllm_importance_sampling_clip_max > 0,
           "vllm_importance_sampling_clip_max", "must be > 0, or null.")
    if cfg.reward_weights is not None:
        _check(all(isinstance(w, (int, float)) and math.isfinite(w) for w in cfg.reward_weights),
               "reward_weights", f"must be finite numbers (got {cfg.reward_weights}).")
        if cfg.reward_funcs:
            _check(len(cfg.reward_weights) == len(cfg.reward_funcs), "reward_weights",
                   f"has {len(cfg.reward_weights)} entries but reward_funcs has {len(cfg.reward_funcs)}; "
                   "give one weight per function.")
    unknown_sinks = set(cfg.report_to) - {"tensorboard", "wandb", "none"}
    _check(not unknown_sinks, "report_to", f"unknown sink {sorted(unknown_sinks)}; use tensorboard and/or wandb.")
    _check(cfg.process_weight >= 0 and cfg.outcome_weight >= 0, "process_weight",
           "process_weight and outcome_weight must be >= 0.")


def config_reference() -> str:
    """Markdown reference of every key, generated from the dataclass (docs/config.md is this text)."""
    hints = get_type_hints(GRPOConfig)
    lines = ["# Configuration reference", "",
             "Generated by `grpo train --help-config` from `grpo/config.py`; do not edit by hand.", "",
             "| key | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(GRPOConfig):
        name = f.name
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if name == "model_name_or_path":
            default = "<package>/assets/tiny-arith"
        kind = str(hints[name]).replace("<class '", "").replace("'>", "").replace("typing.", "")
        text = f.metadata["help"]
        if "choices" in f.metadata:
            text += " One of: " + ", ".join(f"`{c}`" for c in f.metadata["choices"]) + "."
        lines.append(f"| `{name}` | {kind} | `{default}` | {text} |")
    lines += ["", "Aliases: " + ", ".join(f"`{a}` = `{k}`" for a, k in ALIASES.items()) +
              "; `loss_type` (TRL) sets `loss_aggregation`: " +
              ", ".join(f"`{t}` = `{a}`" for t, a in LOSS_TYPE_TO_AGGREGATION.items()) + "."]
    return "\n".join(lines) + "\n"
