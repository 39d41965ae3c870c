"""Training data: load a dataset, find the prompt column, render prompts to token ids, and order them.

Prompts are either plain text or a list of chat messages. Plain text without the chat template is fed as
`system_prompt + "\n" + prompt + prefill` and tokenized as TRL does (the tokenizer's own special tokens, e.g. a
BOS); chat messages go through the tokenizer's chat template with the generation prompt, then the prefill. A text
prompt rendered through the chat template becomes a user message, preceded by the system prompt when one is set.

What reward functions receive follows TRL: the prompt as the dataset has it, and completions in the same form
(text, or one assistant message). With `system_prompt` and a chat template, a text prompt is first made into
[system, user] messages, as open-r1's script builds its prompts (`make_conversation`), so the rewards then get
messages and conversational completions. Every other column reaches the reward functions unchanged (none with
remove_unused_columns).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from grpo.config import ConfigError, GRPOConfig
from grpo.engines.images import has_pixels
from grpo.training.data.vision import has_images, vision_prompts

PROMPT_COLUMN_CANDIDATES = ("prompt", "problem", "question")
FILE_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def load_dataset_any(name: str, split: str, config_name: str | None = None, key: str = "dataset_name",
                     streaming: bool = False):
    """A local data file, a `save_to_disk` directory, or a hub name (only when a hub is reachable); with
    `streaming`, a `datasets.IterableDataset` that reads rows as they are asked for."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"{key}: reading {name!r} needs the `datasets` package (pip install datasets); without it, "
                          "train on a built-in task or pass train_dataset as a list of dicts.") from None

    datasets.disable_progress_bars()  # the run has its own display; these bars would interleave with it

    path = Path(name)
    if path.is_file():
        fmt = FILE_FORMATS.get(path.suffix.lower())
        if fmt is None:
            raise ConfigError(f"{key}: {name!r} has an unsupported extension; use "
                              f"{', '.join(FILE_FORMATS)} or a save_to_disk directory.")
        if path.stat().st_size == 0:
            raise ConfigError(f"{key}: {name!r} is empty; GRPO needs at least one prompt.")
        if fmt != "parquet":
            check_utf8(path, key)
        from datasets.utils import logging as datasets_logging

        before = datasets_logging.get_verbosity()
        datasets_logging.set_verbosity(datasets_logging.CRITICAL)  # (its parser logs the cause: said below instead)
        try:
            return datasets.load_dataset(fmt, data_files=str(path), split="train", streaming=streaming)
        except Exception as err:  # noqa: BLE001 - malformed files fail in many ways inside datasets
            cause = err.__cause__ or err.__context__ or err  # (datasets wraps the parser's error, which says where)
            raise ConfigError(f"{key}: could not read {name!r} as {fmt} ({type(cause).__name__}: "
                              f"{str(cause).strip().splitlines()[0] if str(cause).strip() else ''}).") from None
        finally:
            datasets_logging.set_verbosity(before)
    if path.is_dir():
        if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise ConfigError(f"{key}: {name!r} has splits {list(ds)}, not {split!r}; set the split key.")
                ds = ds[split]
            return ds.to_iterable_dataset() if streaming else ds
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in FILE_FORMATS)
        match = [p for p in files if p.stem == split] or files
        if not match:
            raise ConfigError(f"{key}: directory {name!r} holds no data file ({', '.join(FILE_FORMATS)}) "
                              "and is not a save_to_disk directory.")
        return load_dataset_any(str(match[0]), split, key=key, streaming=streaming)
    check_data_path(name, key)
    try:
        return datasets.load_dataset(name, config_name, split=split, streaming=streaming)
    except Exception as err:  # noqa: BLE001 - datasets raises many kinds; say what to do instead
        raise ConfigError(f"{key}: could not load {name!r} from the hub ({type(err).__name__}: {err}). "
                          "Point it at a local file or save_to_disk directory.") from None


def check_utf8(path: Path, key: str, chunk: int = 1 << 24) -> None:
    """A text data file must be UTF-8: a byte that is not is named (line and byte offset), where datasets would
    load it and fail only when the row is read, deep in pyarrow. Reads the file once (GB/s)."""
    import codecs

    decoder, line, offset = codecs.getincrementaldecoder("utf-8")(), 1, 0
    with open(path, "rb") as fh:
        while True:
            data, held = fh.read(chunk), decoder.getstate()[0]  # (held: a character cut by the last chunk)
            try:
                decoder.decode(data, final=not data)
            except UnicodeDecodeError as err:  # (err.start counts from the held bytes)
                line += (held + data)[:err.start].count(b"\n")
                at = offset - len(held) + err.start
                raise ConfigError(f"{key}: {str(path)!r} is not UTF-8: line {line} (byte {at}) holds "
                                  f"{err.object[err.start:err.end]!r}; save the file as UTF-8.") from None
            if not data:
                return
            line += data.count(b"\n")
            offset += len(data)


def check_data_path(name: str, key: str) -> None:
    """A name that is a local path (or a file name with a data extension) must exist; hub names are left to the hub."""
    path = Path(name).expanduser()
    if not path.exists() and (name.startswith((".", "/", "~")) or path.suffix.lower() in FILE_FORMATS):
        raise ConfigError(f"{key}: {name!r} does not exist; give a data file ({', '.join(FILE_FORMATS)}), a "
                          "save_to_disk directory, or a hub dataset name.")


def find_prompt_column(columns: list[str], configured: str | None) -> str:
    if configured is not None:
        if configured not in columns:
            raise ConfigError(f"prompt_column: {configured!r} is not a column of the dataset "
                              f"(columns: {', '.join(columns)}).")
        return configured
    for name in PROMPT_COLUMN_CANDIDATES:
        if name in columns:
            return name
    raise ConfigError(f"prompt_column: the dataset has none of {', '.join(PROMPT_COLUMN_CANDIDATES)} "
                      f"(columns: {', '.join(columns)}); set prompt_column.")


def bad_row(prompt: Any, row: dict[str, Any], answer_columns: tuple[str, ...] = ()) -> str | None:
    """Why a row cannot be trained on (a missing or non-text prompt, a missing or NaN answer), or None."""
    if prompt is None or prompt == "" or prompt == []:
        return "the prompt is missing"
    ok = isinstance(prompt, str) or (
        isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt))
    if not ok:
        return f"the prompt is not text or a list of {{role, content}} messages (got {str(prompt)[:80]!r})"
    for name in answer_columns:
        value = row.get(name)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return f"column {name!r} (read by the rewards) is {value!r}"
    return None


def bad_row_error(index: int, column: str, reason: str) -> ConfigError:
    return ConfigError(f"dataset row {index}: {reason} (prompt column {column!r}); fix or drop the row, or set "
                       "dataset_on_bad_row=skip to skip such rows and count them (data/skipped_rows).")


def good_rows(prompts: list[Any], columns: dict[str, list[Any]], column: str, answer_columns: tuple[str, ...],
              on_bad_row: str) -> list[int]:
    """The rows to train on; a bad row raises naming its index (on_bad_row=raise), else it is left out."""
    keep = []
    for i, p in enumerate(prompts):
        reason = bad_row(p, {c: columns[c][i] for c in answer_columns if c in columns}, answer_columns)
        if reason is None:
            keep.append(i)
        elif on_bad_row == "raise":
            raise bad_row_error(i, column, reason)
    return keep


@dataclass
class PromptSet:
    """The training prompts, rendered and tokenized once. `columns` holds every column for the rewards."""

    prompts: list[Any]  # what reward functions receive: as in the dataset (str or messages), or made messages
    prompt_ids: list[list[int]]  # rendered and tokenized, left-truncated if allowed
    columns: dict[str, list[Any]]
    render: Callable[..., list[int]] | None = None  # render(prompt, tool_schemas) -> ids, as these were rendered
    skipped: int = 0  # bad rows left out (dataset_on_bad_row=skip)
    images: list[list] | None = None  # each prompt's PIL images (vision-language data), else None
    image_processing: Any = None  # grpo.training.data.vision.ImageProcessing, with images

    def __len__(self) -> int:
        return len(self.prompts)

    def rows(self, index: list[int]) -> tuple[list[Any], list[list[int]], dict[str, list[Any]]]:
        return ([self.prompts[i] for i in index], [self.prompt_ids[i] for i in index],
                {k: [v[i] for i in index] for k, v in self.columns.items()})

    def pixels(self, index: list[int]) -> list | None:
        """The image features (grpo.engines.images.RowImages) of rows `index`, each distinct prompt processed
        once (a group's G rows share theirs); None without images."""
        if self.images is None:
            return None
        distinct = list(dict.fromkeys(index))
        rows = dict(zip(distinct, self.image_processing.row_features([self.images[i] for i in distinct])))
        if not all(map(has_pixels, rows.values())):  # (rows without images carry a blank one's features)
            rows = {i: r if has_pixels(r) else replace(r, stand_in=self._stand_in()) for i, r in rows.items()}
        return [rows[i] for i in index]

    def _stand_in(self) -> dict:
        """A blank 64 x 64 image's features (grpo.engines.images.vision_zero), made once."""
        if getattr(self, "_blank", None) is None:
            from PIL import Image

            self._blank = self.image_processing.row_features([[Image.new("RGB", (64, 64))]])[0].features
        return self._blank


def uses_template(tokenizer, cfg: GRPOConfig) -> bool:
    use_template = cfg.use_chat_template
    if use_template is None:  # auto
        use_template = getattr(tokenizer, "chat_template", None) is not None
    return bool(use_template)


def as_messages(prompt: Any, tokenizer, cfg: GRPOConfig) -> Any:
    """The prompt the rewards receive: a text prompt becomes [system, user] messages when a system prompt is set and
    the chat template renders it (open-r1's make_conversation); anything else stays as the dataset has it."""
    if isinstance(prompt, str) and cfg.system_prompt and uses_template(tokenizer, cfg):
        return [{"role": "system", "content": cfg.system_prompt}, {"role": "user", "content": prompt}]
    return prompt


def render_prompt(prompt: Any, tokenizer, cfg: GRPOConfig, prefill: str, tools: list[dict] | None = None) -> str:
    """The prompt's text: through the chat template (with the tools' schemas, when the row has tools) or plain."""
    template = uses_template(tokenizer, cfg)
    if tools and not template:
        raise ConfigError("use_chat_template: tools are rendered into the prompt by the chat template; set "
                          "use_chat_template to true or auto.")
    if isinstance(prompt, str) and not template:
        return (cfg.system_prompt + "\n" if cfg.system_prompt else "") + prompt + prefill
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError("use_chat_template: the dataset has chat messages (or use_chat_template is true) but the "
                          "tokenizer has no chat template; give plain-text prompts or a chat model.")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if cfg.system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": cfg.system_prompt}] + messages
    text = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True,
                                         **(cfg.chat_template_kwargs or {}))
    return text + prefill


def build_prompt_set(dataset, tokenizer, cfg: GRPOConfig, prefill: str, name: str = "dataset",
                     answer_columns: tuple[str, ...] = (), agents=None, images=None) -> PromptSet:
    """The dataset's prompts rendered and tokenized; with `agents` (grpo.agents.AgentSpec), each with its row's
    tools, once the chat template is known to render tool calls. Data with images (an `image` / `images` column or
    image parts) needs `images`, the model's grpo.training.data.vision.ImageProcessing."""
    if len(dataset) == 0:
        raise ConfigError(f"{name}: the dataset is empty; GRPO needs at least one prompt.")
    column = find_prompt_column(list(dataset.column_names), cfg.prompt_column)
    table = dataset[:]  # every column as a list at once (iterating a column reads row by row: ~1 s for 20k rows)
    prompts = table[column]
    checked = tuple(c for c in answer_columns if c in dataset.column_names)
    keep = good_rows(prompts, {c: table[c] for c in checked}, column, checked, cfg.dataset_on_bad_row)
    if not keep:
        raise ConfigError(f"{name}: every one of the {len(prompts)} rows is bad (dataset_on_bad_row=skip skipped "
                          "them all); check the prompt column and the columns the rewards read.")
    skipped = len(prompts) - len(keep)
    if skipped:
        warnings.warn(f"{name}: skipped {skipped} bad rows of {len(prompts)} (dataset_on_bad_row=skip).")
        table = {c: [values[i] for i in keep] for c, values in table.items()}
        prompts = table[column]
    columns = {c: table[c] for c in dataset.column_names if c != column}
    if has_images(list(columns), prompts):
        return _vision_prompt_set(prompts, columns, tokenizer, cfg, prefill, name, skipped, images, agents)
    tools = agents.prompt_tools(tokenizer)(columns, len(prompts)) if agents else None
    ids = tokenize_prompts(prompts, tokenizer, cfg, prefill, tools=tools)
    kept = columns if not cfg.remove_unused_columns else agents.needed_columns(columns) if agents else {}
    messages = [as_messages(p, tokenizer, cfg) for p in prompts]
    return PromptSet(messages, ids, kept, prompt_renderer(tokenizer, cfg, prefill), skipped=skipped)


def _vision_prompt_set(prompts, columns, tokenizer, cfg, prefill, name, skipped, images, agents) -> PromptSet:
    if images is None:
        raise ConfigError(f"{name}: the data has images, but the model is not a vision-language model with an image "
                          "processor; train a vision-language model (docs/vision.md) or drop the image column.")
    if agents is not None:
        raise ConfigError(f"{name}: image prompts with tools or environments are not supported yet (docs/vision.md).")
    ids, row_images = vision_prompts(prompts, columns, images, lambda m: render_prompt(m, tokenizer, cfg, prefill),
                                     cfg.max_prompt_length)
    kept = columns if not cfg.remove_unused_columns else {}
    return PromptSet([as_messages(p, tokenizer, cfg) for p in prompts], ids, kept, None, skipped=skipped,
                     images=row_images, image_processing=images)


def tokenize_prompts(prompts: list[Any], tokenizer, cfg: GRPOConfig, prefill: str, first_row: int = 0,
                     tools: list | None = None) -> list[list[int]]:
    """Render (with each row's tool schemas, if any) and tokenize prompts (left-truncated, or refused, past
    max_prompt_length)."""
    tools = tools or [None] * len(prompts)
    texts = [render_prompt(p, tokenizer, cfg, prefill, t) for p, t in zip(prompts, tools)]
    # Text the template did not render is tokenized with the tokenizer's special tokens, as TRL does; a chat
    # template writes its own.
    template = uses_template(tokenizer, cfg)
    plain = [isinstance(p, str) and not template for p in prompts]
    if all(plain) or not any(plain):
        ids = tokenizer(texts, add_special_tokens=all(plain))["input_ids"]
    else:
        ids = [tokenizer(t, add_special_tokens=bare)["input_ids"] for t, bare in zip(texts, plain)]
    return _limit_prompt_length(ids, cfg, first_row, tokenizer)


def prompt_renderer(tokenizer, cfg: GRPOConfig, prefill: str):
    """render(prompt, tool_schemas) -> token ids: the prompt rendered (render_prompt) and tokenized as
    build_prompt_set tokenizes it. A prompt longer than max_prompt_length is an error naming it, or is cut from the
    left (prompt_truncation)."""
    def render(prompt: Any, tools: list[dict] | None = None) -> list[int]:
        bare = isinstance(prompt, str) and not uses_template(tokenizer, cfg)
        text = render_prompt(prompt, tokenizer, cfg, prefill, tools)
        ids = [tokenizer(text, add_special_tokens=bare)["input_ids"]]
        return _limit_prompt_length(ids, cfg, 0, tokenizer)[0]

    return render


def _limit_prompt_length(ids: list[list[int]], cfg: GRPOConfig, first_row: int = 0,
                         tokenizer=None) -> list[list[int]]:
    limit = cfg.max_prompt_length
    if limit is None:
        return ids
    long = [i for i, x in enumerate(ids) if len(x) > limit]
    if not long:
        return ids
    if cfg.prompt_truncation == "error":
        raise ConfigError(f"max_prompt_length: {len(long)} of {len(ids)} prompts are longer than {limit} tokens "
                          f"(first: row {first_row + long[0]}, {len(ids[long[0]])} tokens); "
                          f"{_length_advice(cfg, max(len(ids[i]) for i in long), tokenizer)}.")
    warnings.warn(f"{len(long)} of {len(ids)} prompts longer than max_prompt_length={limit} were left-truncated.")
    return [x[-limit:] for x in ids]


def _length_advice(cfg: GRPOConfig, longest: int, tokenizer) -> str:
    """What to set for prompts up to `longest` tokens, within the model's context (read from where the tokenizer
    was loaded: check_sizes refuses a prompt and completion past it), so that following it runs."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(tokenizer.name_or_path)
        context = int(getattr(config, "max_position_embeddings", None) or config.text_config.max_position_embeddings)
    except (AttributeError, OSError, ValueError, TypeError):
        context = None
    room = context and context - cfg.max_completion_length  # (the longest prompt it takes with a full completion)
    if not room or room < 1:
        return "raise max_prompt_length or set prompt_truncation=left"
    left = "prompt_truncation=left" + (f" max_prompt_length={room}" if cfg.max_prompt_length > room else "")
    within = (f" (the model's context of {context} tokens less max_completion_length={cfg.max_completion_length})"
              if cfg.max_prompt_length > room else "")
    if longest <= room:
        return f"set max_prompt_length={longest}, or {left} to cut them from the left{within}"
    return f"set {left} to cut them from the left{within}, or shorten them"


class PromptSampler:
    """Shuffled prompt order (or the dataset's, with shuffle=False), one epoch after another. Its whole state is
    (epoch, position), so resume is exact."""

    def __init__(self, n: int, seed: int, shuffle: bool = True):
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def next(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            if self.position == self.n:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._make_order()
            take = min(k - len(out), self.n - self.position)
            out += self._order[self.position:self.position + take]
            self.position += take
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._make_order()
