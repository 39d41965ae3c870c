"""Building a run from its config, before the loop starts: task, rewards, datasets, batch layout, schedule.

Every check here runs before any model is loaded, so a bad config fails in milliseconds with the key's name.
"""

from __future__ import annotations

import math
import random
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from grpo.config import ConfigError, GRPOConfig
from grpo.training.data.prompts import load_dataset_any
from grpo.training.data.stream import is_stream, shuffled_stream


def config_of(args, unsupported: dict) -> GRPOConfig:
    """GRPOTrainer's args as our config (a trl.GRPOConfig keeps TRL's values); TRL arguments grpo has not built
    are refused by name."""
    from grpo.config import from_trl

    for name in unsupported:
        raise TypeError(f"GRPOTrainer: {name!r} is not an argument of grpo's (nor of TRL 1.16's) GRPOTrainer")
    return args if isinstance(args, GRPOConfig) else from_trl(args) if args is not None else GRPOConfig()


def check_inputs(cfg: GRPOConfig, model_from_path: bool, train_dataset) -> None:
    """The paths a user gives, in the order they would fix them: the model (when it is loaded from
    model_name_or_path, not passed as a model), then the dataset (rewards come next, in make_reward_runner). One line
    each, naming the key."""
    from grpo.training.run import lock
    from grpo.training.data.prompts import check_data_path

    lock.check(Path(cfg.output_dir))  # (a file, read-only, or a live run's: said before anything loads)
    if cfg.logging_dir:
        lock.writable(Path(cfg.logging_dir), "logging_dir")
    check_trackers(cfg.report_to)
    if model_from_path:
        check_model_path(cfg.model_name_or_path)
    if train_dataset is None and cfg.dataset_name is not None:
        check_data_path(cfg.dataset_name, "dataset_name")
    if cfg.eval_dataset_name is not None:
        check_data_path(cfg.eval_dataset_name, "eval_dataset_name")


TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}  # report_to name: its package


def check_trackers(report_to) -> None:
    """Each metric sink of report_to importable (its package installed), before the run's lock and files."""
    for name in [report_to] if isinstance(report_to, str) else report_to or []:
        if name in TRACKERS and not _installed(TRACKERS[name]):
            raise ConfigError(f"report_to: {name!r} needs the {TRACKERS[name]} package, which is not installed; "
                              f"pip install {TRACKERS[name]}, or drop {name!r} from report_to.")


def _installed(package: str) -> bool:
    """Whether `package` imports: already imported (a module put in sys.modules has no spec to find), or found."""
    import importlib.util
    import sys

    if package in sys.modules:
        return True
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def check_model_path(name: str) -> None:
    """A model directory with config.json, or a hub name whose config can be fetched (or is cached)."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file() and not (path / "adapter_config.json").is_file():
            raise ConfigError(f"model_name_or_path: {name!r} is a directory without config.json; point it at a "
                              "model saved with save_pretrained (or a checkpoint's directory).")
        return
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name:
        raise ConfigError(f"model_name_or_path: {name!r} " + ("is a file, not a model directory" if path.exists()
                          else "does not exist") + "; point it at a model directory or a hub name (org/model).")
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"model_name_or_path: {name!r} is not a local directory and could not be fetched from "
                          f"the hub ({first}); download it (huggingface-cli download {name}) and give its "
                          "directory.") from None


def tokenizer_for(cfg: GRPOConfig, processing_class, path: str):
    """The given tokenizer (with the config's chat template and a pad token, as TRL sets one), else the model's."""
    from grpo.training.setup.model import load_tokenizer

    if hasattr(processing_class, "image_processor") and hasattr(processing_class, "tokenizer"):
        processing_class = processing_class.tokenizer  # a processor: its tokenizer (grpo.training.data.vision its images)
    if processing_class is None:
        return load_tokenizer(path, cfg)
    if cfg.chat_template is not None:
        processing_class.chat_template = cfg.chat_template
    if processing_class.pad_token is None:
        processing_class.pad_token = processing_class.eos_token
    return processing_class


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


def make_datasets(cfg: GRPOConfig, task, train_dataset, eval_dataset):
    from grpo.rows import as_table

    if train_dataset is None:
        if cfg.dataset_name is None and task is None:
            raise ConfigError("dataset_name: set dataset_name (a data file or directory) or task (arithmetic, "
                              "countdown), or pass train_dataset.")
        if cfg.dataset_name is not None:
            train_dataset = load_dataset_any(cfg.dataset_name, cfg.dataset_split, cfg.dataset_config,
                                             streaming=cfg.dataset_streaming)
            if cfg.dataset_streaming:
                train_dataset = shuffled_stream(train_dataset, cfg)
        else:
            train_dataset = task.dataset("train", n=cfg.task_train_size, seed=cfg.seed, **_level(cfg))
    if eval_dataset is None:
        if cfg.eval_dataset_name is not None:
            eval_dataset = load_dataset_any(cfg.eval_dataset_name, cfg.eval_split, key="eval_dataset_name")
        elif task is not None and cfg.task_eval_size > 0:
            eval_dataset = task.dataset("test", n=cfg.task_eval_size, seed=cfg.seed, **_level(cfg))
    if is_stream(eval_dataset):  # (eval sets are small: read whole, as every eval reads every prompt)
        import datasets

        eval_dataset = datasets.Dataset.from_list(list(eval_dataset))
    return as_table(train_dataset), as_table(eval_dataset)  # (a list of dicts or a dict of columns: grpo.rows)


def _level(cfg: GRPOConfig) -> dict:
    return {} if cfg.task_difficulty is None else {"difficulty": cfg.task_difficulty}


def check_sizes(cfg: GRPOConfig, n_prompts: int | None, B: int, prompt_ids: list[list[int]],
                model_config=None, tokenizer=None) -> None:
    """Enough prompts for one step, prompt + completion within the model's context (reliability.md 4.2), and no
    token past the model's vocabulary. A stream (n_prompts None) is checked on its first row."""
    if n_prompts is not None and n_prompts < B:
        raise ConfigError(f"dataset_name: the dataset has {n_prompts} prompts but one step needs {B} "
                          f"(prompts_per_step); add prompts or lower prompts_per_step.")
    if model_config is None:
        from transformers import AutoConfig

        try:
            model_config = AutoConfig.from_pretrained(cfg.model_name_or_path)
        except OSError as err:
            raise ConfigError(f"model_name_or_path: cannot read the config of {cfg.model_name_or_path!r}: "
                              f"{err}") from None
    check_vocabulary(tokenizer, model_config, cfg.model_name_or_path, prompt_ids)
    context = getattr(model_config, "max_position_embeddings", None)
    longest = max(len(p) for p in prompt_ids) + cfg.max_completion_length
    if context is not None and longest > context:
        raise ConfigError(f"max_completion_length: the longest prompt ({longest - cfg.max_completion_length} "
                          f"tokens) plus max_completion_length ({cfg.max_completion_length}) is {longest}, beyond "
                          f"the model's context of {context} tokens; lower max_completion_length or "
                          "max_prompt_length.")


def check_vocabulary(tokenizer, model_config, name: str, prompt_ids: list[list[int]]) -> None:
    """A tokenizer with more tokens than the model has embeddings, whose extra ids the run would feed the model (in
    a prompt, or the pad token where rows differ in length): they index past the embedding table (an IndexError deep
    in a forward pass; on a GPU a device-side assert). An EOS past the table is never sampled, so no completion ends
    early (said in a line; the benchmark uses this to fix completion lengths); then, with prompts of one length,
    nothing is ever padded. Extra tokens no prompt holds are left alone: the model never samples them."""
    vocab = getattr(model_config, "vocab_size", None) or getattr(getattr(model_config, "text_config", None),
                                                                 "vocab_size", None)
    if tokenizer is None or vocab is None or len(tokenizer) <= vocab:
        return
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    eos_past = eos is not None and eos >= vocab
    padded = len({len(p) for p in prompt_ids}) > 1 or not eos_past  # (rows of different lengths meet pad)
    used = {"a prompt": max((max(p) for p in prompt_ids if p), default=-1),
            "the pad token": pad if padded else None}
    past = [(what, i) for what, i in used.items() if i is not None and i >= vocab]
    if past:
        what, i = past[0]
        raise ConfigError(f"model_name_or_path: the tokenizer of {name!r} has {len(tokenizer)} tokens but the model "
                          f"has {vocab} embeddings (config.json vocab_size), and {what} uses id {i} "
                          f"({tokenizer.convert_ids_to_tokens(i)!r}); use the model's own tokenizer, or resize the "
                          "model's embeddings (model.resize_token_embeddings(len(tokenizer))) and save it.")
    if eos_past:
        print(f"warning: the EOS token's id {eos} is past the model's {vocab} embeddings: the model cannot sample it, "
              "so every completion runs to max_completion_length.")


def make_schedule(cfg: GRPOConfig, total: int) -> Callable[[int], float]:
    """The learning-rate factor of optimizer step `step` of `total`, after linear warmup (warmup_steps, a fraction
    of the steps below 1, else warmup_ratio), as transformers' schedules of the same names."""
    steps = cfg.warmup_steps
    warmup = math.ceil(steps * total) if 0 < steps < 1 else int(steps) or int(cfg.warmup_ratio * total)
    kwargs = cfg.lr_scheduler_kwargs or {}
    cycles = kwargs.get("num_cycles", 0.5)
    floor = kwargs["min_lr"] / cfg.learning_rate if "min_lr" in kwargs else kwargs.get("min_lr_rate", 0.0)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if cfg.lr_scheduler_type in ("constant", "constant_with_warmup"):
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        if cfg.lr_scheduler_type == "linear":
            return max(0.0, 1.0 - progress)
        cosine = 0.5 * (1.0 + math.cos(math.pi * 2.0 * cycles * min(1.0, progress)))
        if cfg.lr_scheduler_type == "cosine_with_min_lr":
            return floor + (1.0 - floor) * cosine
        return max(0.0, cosine)

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


def rounded_away(params, lr: float, sample: int = 2**16) -> float:
    """The share of the low-precision (bfloat16, float16) elements of `params` that a step of size `lr` leaves
    unchanged: w + lr rounds back to w in the parameter's dtype (it does when lr is under half a unit in the last
    place of w: bf16 at |w| = 0.02 takes steps of 6e-5 or more). Estimated from each tensor's first `sample`
    elements; 0 when no parameter is low precision."""
    same = total = 0
    for p in params:
        if p.dtype in (torch.bfloat16, torch.float16) and p.device.type != "meta":  # (meta: loaded on another rank)
            w = p.detach().reshape(-1)[:sample]
            same += int(((w.float() + lr).to(p.dtype) == w).sum())
            total += w.numel()
    return same / total if total else 0.0


def warn_low_precision_training(model, optimizer, cfg: GRPOConfig, distributed_type: str, mixed_precision: str):
    """Warn when a torch optimizer steps bfloat16/float16 trainable weights with no float32 master copy (TRL trains
    the same way when told `dtype: bfloat16`, so this is a warning, not a refusal): small steps round away. DeepSpeed
    keeps float32 master weights in its optimizer, and FSDP2 with mixed precision upcasts trainable weights."""
    low = [p for p in model.parameters() if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16)]
    master_copy = distributed_type == "DEEPSPEED" or (distributed_type == "FSDP" and mixed_precision != "no")
    if not low or master_copy or not type(optimizer).__module__.startswith("torch.optim"):
        return
    lost, dtype = rounded_away(low, cfg.learning_rate), str(low[0].dtype).removeprefix("torch.")
    warnings.warn(f"torch_dtype: {dtype} trainable weights are stepped by {type(optimizer).__name__} with no "
                  f"float32 master copy; at learning_rate {cfg.learning_rate:g} a step of that size leaves "
                  f"{lost:.1%} of them unchanged (rounded away). Set torch_dtype: float32 and bf16: true (bf16 "
                  "compute over float32 weights, as TRL and verl train), or train under DeepSpeed ZeRO or FSDP2 with "
                  "mixed precision, which keep float32 master weights.", stacklevel=3)


def make_accelerator(cfg: GRPOConfig):
    """accelerate's Accelerator for the config: mixed precision (bf16, fp16) and the CPU when asked or without a GPU."""
    from accelerate import Accelerator

    cuda = torch.cuda.is_available() and not cfg.use_cpu
    if cfg.fp16 and not cuda:
        raise ConfigError("fp16: float16 mixed precision needs a CUDA GPU (its loss scaler); use bf16 on the CPU.")
    precision = "bf16" if cfg.bf16 else "fp16" if cfg.fp16 else "no"
    from accelerate.state import AcceleratorState

    state = AcceleratorState._shared_state
    if state and (AcceleratorState().mixed_precision != precision or (AcceleratorState().device.type == "cpu") != (
            not cuda)):
        # An earlier trainer of this process (a notebook, a test) set another precision: accelerate keeps one per
        # process, so its state is reset (the process group, if any, is kept).
        AcceleratorState._reset_state(reset_partial_state=False)
    return Accelerator(cpu=not cuda, mixed_precision=precision)


def check_sequence_parallel(cfg: GRPOConfig, world: int) -> None:
    """Refuse a sequence_parallel_size the processes cannot take (the model's heads: the backend's `packing`)."""
    size = cfg.sequence_parallel_size
    if size == 1:
        return
    if world % size:
        raise ConfigError(f"sequence_parallel_size={size}: {world} processes do not split into groups of {size}; "
                          "launch a multiple of it.")


def configure_process(cfg: GRPOConfig) -> None:
    """Process-wide settings the config asks for: threads, log levels, determinism, TF32."""
    import logging

    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    if cfg.log_level != "passive":
        from transformers.utils import logging as hf_logging

        level = getattr(logging, cfg.log_level.upper())
        logging.getLogger("grpo").setLevel(level)
        hf_logging.set_verbosity(level)
    if cfg.full_determinism:
        import os

        # As transformers' enable_full_determinism (TRL's), without CUDA_LAUNCH_BLOCKING (not needed once cuBLAS
        # has its workspace setting). Under the strict flag torch picks deterministic kernels where it has them:
        # index_add_ and scatter_add_ (the tiled head's backward) and sdpa's flash and mem-efficient backward on
        # CUDA (cuDNN attention is excluded); an op with none raises. The flash-attn package reads its own setting.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        os.environ.setdefault("FLASH_ATTENTION_DETERMINISTIC", "1")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    if cfg.tf32 is not None and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
        torch.backends.cudnn.allow_tf32 = cfg.tf32


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
