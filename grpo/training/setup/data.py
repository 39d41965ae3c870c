"""The run's data before the loop: the tokenizer, the built-in task, the train and eval datasets."""

from __future__ import annotations

from grpo.config import ConfigError, GRPOConfig
from grpo.training.data.prompts import load_dataset_any
from grpo.training.data.stream import is_stream, shuffled_stream


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


def load_task(cfg: GRPOConfig):
    from grpo.tasks import get_task

    try:
        return get_task(cfg.task)
    except ValueError as err:
        raise ConfigError(f"task: {err}") from None


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
