"""Checks of what a run is given, before any model is loaded: the trainer's arguments, paths, trackers, sizes, the
vocabulary, the sequence-parallel layout. A bad input fails in milliseconds with the key's name.
"""

from __future__ import annotations

from pathlib import Path

from grpo.config import ConfigError, GRPOConfig


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


def check_sequence_parallel(cfg: GRPOConfig, world: int) -> None:
    """Refuse a sequence_parallel_size the processes cannot take (the model's heads: the backend's `packing`)."""
    check_groups("sequence_parallel_size", cfg.sequence_parallel_size, world)


def check_groups(key: str, size: int, world: int) -> None:
    """Refuse a group size (`key`) that does not divide the `world` processes."""
    if world % size:
        raise ConfigError(f"{key}={size}: {world} processes do not split into groups of {size}; "
                          "launch a multiple of it.")
