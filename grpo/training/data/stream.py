"""Prompts streamed from a `datasets.IterableDataset`: read as the run needs them, never all at once.

`StreamingPrompts` is the run's prompt sampler and prompt set in one: `next(k)` reads the next k good rows of the
stream, renders and tokenizes them, and returns their ids; `rows(ids)` hands the rollout those rows. Only the rows of
the last few calls are held, so memory does not grow with the stream's length.

Order and resume: the stream is read in its own order, one epoch after another (`set_epoch(epoch)` before each, so a
`shuffle(seed=..., buffer_size=...)` upstream draws a new order per epoch, as transformers' Trainer does). The
state is (epoch, rows read in this epoch, rows served, rows skipped): a resumed run re-opens the epoch and reads past
the rows already read, so it sees exactly the rows an uninterrupted run would (reading past them costs time, not
memory). Every process reads the same stream and takes the same rows, as the map-style sampler gives every process
the same prompts.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Any

from grpo.config import ConfigError, GRPOConfig
from grpo.training.data.prompts import (PromptSet, as_messages, bad_row, bad_row_error, find_prompt_column,
                                tokenize_prompts)

ROW_INDEX = "__grpo_row__"  # the row's index in the file, added before a shuffle so errors name the row the user sees
KEPT_CALLS = 8  # rows of the last calls to next() kept for rows() (dynamic sampling calls next() several times)


def is_stream(dataset) -> bool:
    try:
        import datasets
    except ImportError:  # (only `datasets` makes streams)
        return False
    return isinstance(dataset, datasets.IterableDataset)


def stream_columns(dataset) -> list[str]:
    """The dataset's column names (a stream that does not know its features: those of its first row)."""
    names = dataset.column_names
    if names is None:
        try:
            names = list(next(iter(dataset)))
        except StopIteration:
            names = []
    return [c for c in names if c != ROW_INDEX]


def shuffled_stream(dataset, cfg: GRPOConfig):
    """A stream the config loaded (dataset_streaming): each row numbered, then shuffled in a buffer of
    shuffle_buffer_size rows with data_seed (else seed), as `IterableDataset.shuffle` does (shuffle_dataset=false:
    the file's order)."""
    dataset = dataset.map(lambda row, i: {ROW_INDEX: i}, with_indices=True)
    if not cfg.shuffle_dataset:
        return dataset
    seed = cfg.seed if cfg.data_seed is None else cfg.data_seed
    return dataset.shuffle(seed=seed, buffer_size=cfg.shuffle_buffer_size)


class StreamingPrompts:
    """A stream's prompts on demand (see the module docstring). `answer_columns`: columns the rewards read, checked
    in every row (a missing or NaN value makes the row bad)."""

    def __init__(self, dataset, tokenizer, cfg: GRPOConfig, prefill: str, answer_columns: tuple[str, ...] = (),
                 name: str = "dataset_name"):
        self.dataset, self.tokenizer, self.cfg, self.prefill, self.name = dataset, tokenizer, cfg, prefill, name
        first = self._first_row()
        names = stream_columns(dataset) if dataset.column_names is not None else [c for c in first if c != ROW_INDEX]
        self.column = find_prompt_column(names, cfg.prompt_column)
        self.column_names = names
        self.answer_columns = tuple(c for c in answer_columns if c in names)
        self.epoch = self.position = self.served = self.skipped = 0
        self.rows_per_pass = 0  # known once a pass has ended
        self._rows: OrderedDict[int, tuple[Any, list[int], dict[str, Any]]] = OrderedDict()
        self._calls: list[list[int]] = []
        self._iter = None
        # The first rows, rendered, for the checks made before the model loads (context length).
        self.prompt_ids = self._render([first], [self._index(first, 0)])[1] if not bad_row(
            first.get(self.column), first, self.answer_columns) else [[]]

    def _first_row(self) -> dict[str, Any]:
        try:
            return next(iter(self.dataset))
        except StopIteration:
            raise ConfigError(f"{self.name}: the stream is empty; GRPO needs at least one prompt.") from None
        except Exception as err:  # noqa: BLE001 - a stream fails in many ways inside datasets
            raise ConfigError(f"{self.name}: could not read the stream's first row ({type(err).__name__}: "
                              f"{err}).") from None

    @staticmethod
    def _index(row: dict[str, Any], position: int) -> int:
        return row.get(ROW_INDEX, position)

    def _render(self, rows: list[dict], indices: list[int]) -> tuple[list[Any], list[list[int]]]:
        prompts = [row[self.column] for row in rows]
        try:
            ids = tokenize_prompts(prompts, self.tokenizer, self.cfg, self.prefill)
        except ConfigError as err:  # name the stream's row, not the position in this batch
            raise ConfigError(f"{err} (stream rows {indices[0]}..{indices[-1]})") from None
        return [as_messages(p, self.tokenizer, self.cfg) for p in prompts], ids

    # ---- the sampler ---------------------------------------------------------------------------------------------
    def _open(self) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(self.epoch)
        self._iter = itertools.islice(iter(self.dataset), self.position, None)

    def _read(self) -> dict[str, Any] | None:
        """The stream's next row (None at the end of an epoch)."""
        if self._iter is None:
            self._open()
        try:
            row = next(self._iter)
        except StopIteration:
            return None
        except Exception as err:  # noqa: BLE001
            raise ConfigError(f"{self.name}: could not read row {self.position} of the stream "
                              f"({type(err).__name__}: {err}).") from None
        self.position += 1
        return row

    def _next_good_row(self) -> tuple[dict[str, Any], int]:
        """(the next row to train on, its index), skipping (or refusing) bad rows and opening the next epoch at the
        end of one."""
        ends = 0
        while True:
            row = self._read()
            if row is None:
                ends += 1
                if self.position == 0 or ends > 1:
                    raise ConfigError(f"{self.name}: a whole pass over the stream gave no usable row.")
                self.rows_per_pass = self.position
                self.epoch, self.position, self._iter = self.epoch + 1, 0, None
                continue
            index = self._index(row, self.position - 1)
            reason = bad_row(row.get(self.column), row, self.answer_columns)
            if reason is None:
                return row, index
            if self.cfg.dataset_on_bad_row == "raise":
                raise bad_row_error(index, self.column, reason)
            self.skipped += 1

    def next(self, k: int) -> list[int]:
        rows, indices = zip(*[self._next_good_row() for _ in range(k)])
        prompts, ids = self._render(list(rows), list(indices))
        keys = list(range(self.served, self.served + k))
        self.served += k
        for key, row, prompt, prompt_ids in zip(keys, rows, prompts, ids):
            columns = {} if self.cfg.remove_unused_columns else {
                c: v for c, v in row.items() if c not in (self.column, ROW_INDEX)}
            self._rows[key] = (prompt, prompt_ids, columns)
        self._calls.append(keys)
        while len(self._calls) > KEPT_CALLS:
            for key in self._calls.pop(0):
                self._rows.pop(key, None)
        return keys

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "served": self.served, "skipped": self.skipped,
                "rows_per_pass": self.rows_per_pass}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if "served" not in state:
            raise ConfigError("resume_from_checkpoint: the checkpoint was written by a run over a dataset with a "
                              "length; resume it with that dataset (not streamed).")
        self.epoch, self.position, self.served, self.skipped = (state["epoch"], state["position"], state["served"],
                                                                 state["skipped"])
        self.rows_per_pass = state.get("rows_per_pass", 0)
        self._iter, self._rows, self._calls = None, OrderedDict(), []

    # ---- the prompt set ------------------------------------------------------------------------------------------
    def rows(self, index: list[int]) -> tuple[list[Any], list[list[int]], dict[str, list[Any]]]:
        picked = [self._rows[i] for i in index]
        names = picked[0][2].keys() if picked else ()
        return ([p for p, _, _ in picked], [ids for _, ids, _ in picked],
                {c: [cols.get(c) for _, _, cols in picked] for c in names})


def make_prompts(dataset, tokenizer, cfg: GRPOConfig, prefill: str, rewards, name: str = "dataset_name",
                 agents=None, images=None):
    """(the prompt set, its sampler) of the training data: one `StreamingPrompts` for a stream (both roles), else a
    `PromptSet` tokenized whole and a shuffled `PromptSampler` over it."""
    from grpo.rewards import column_requirements
    from grpo.training.data.prompts import PromptSampler, build_prompt_set

    answers = tuple(dict.fromkeys(c for f in rewards.funcs for accepted in column_requirements(f) for c in accepted))
    if is_stream(dataset):
        if images is not None:
            raise ConfigError("dataset_streaming: a streamed dataset with images is not supported yet; load it whole "
                              "(dataset_streaming: false).")
        if cfg.max_steps <= 0:
            raise ConfigError("max_steps: a streamed dataset has no length, so num_train_epochs cannot say when to "
                              "stop; set max_steps (TRL's rule for an IterableDataset).")
        if agents is not None:
            raise ConfigError("dataset_streaming: a streamed dataset with tools, environment_factory or rollout_func "
                              "is not supported yet; load the dataset whole (dataset_streaming: false).")
        prompts = StreamingPrompts(dataset, tokenizer, cfg, prefill, answers, name)
        return prompts, prompts
    prompts = build_prompt_set(dataset, tokenizer, cfg, prefill, name, answers, agents, images)
    sampler = PromptSampler(len(prompts), cfg.seed if cfg.data_seed is None else cfg.data_seed, cfg.shuffle_dataset)
    return prompts, sampler


def epochs_done(prompts: PromptSet | StreamingPrompts, steps: int, steps_per_epoch: int) -> float:
    """`train/epoch` after `steps` optimizer steps: over a dataset with a length, steps / steps per epoch; over a
    stream, the passes made so far (whole ones, plus the current one's fraction once a pass has given the stream's
    length; a stream's first pass reads 0 until it ends)."""
    if not isinstance(prompts, StreamingPrompts):
        return steps / steps_per_epoch
    return prompts.epoch + (prompts.position / prompts.rows_per_pass if prompts.rows_per_pass else 0.0)


def prompt_count(prompts: PromptSet | StreamingPrompts) -> int | None:
    """The number of training prompts; None for a stream."""
    return None if isinstance(prompts, StreamingPrompts) else len(prompts)
