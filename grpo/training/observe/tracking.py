"""Metric sinks for a training run: a JSONL file always, TensorBoard and W&B on request.

Layout of a run directory written here::

    output_dir/
      metrics.jsonl              one JSON object per `RunLogger.log` call, "step" first
      samples/step_000010.jsonl  one JSON object per sample completion (`RunLogger.log_samples`)
      samples/images/<hash>.png  each sample's image (vision-language prompts), written once; the rows name it
      runs/<date>_<host>/        TensorBoard's event files (transformers' default place), when "tensorboard" is in
                                 report_to and logging_dir does not say where
      wandb_run_id               the W&B run id, so a resumed run continues the same W&B run

Encoding choices in the JSONL files:

* Metric floats are rounded to 6 significant digits (enough for a KL of 0.00123456 and a length of 123.456);
  TensorBoard and W&B get the full value. Ints stay ints, bools become 0/1.
* Non-finite floats are written as the strings "NaN", "Infinity" and "-Infinity", never dropped or replaced:
  a NaN loss must stay visible in the log (reliability.md §3.2: TRL's `logging_nan_inf_filter` writes 0.0
  for a NaN loss and hides the failure). Strings keep the file strict JSON (jq, JavaScript and pandas read it),
  and unlike null they keep NaN and ±inf apart. `read_metrics` turns them back into floats.

`NullLogger` has the same methods and does nothing, so the training loop never branches on "is logging on"
(the `DummyWandb` pattern of karpathy/nanochat `nanochat/common.py`).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from grpo.training.observe.metric_names import dashboard_key, tensorboard_dir

REPORT_TO_CHOICES = ("tensorboard", "wandb", "trackio")
METRICS_FILE = "metrics.jsonl"
SAMPLES_DIR = "samples"
IMAGES_DIR = "images"  # under SAMPLES_DIR
THUMBNAIL = 256  # pixels: a sample's image is shrunk to fit this square (a smaller one is kept as it is)
WANDB_ID_FILE = "wandb_run_id"

_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_SAMPLE_FILE = re.compile(r"step_(\d+)\.jsonl")


def encode_float(value: float, digits: int | None = None) -> float | str:
    """A float as JSON can hold it: non-finite values become "NaN"/"Infinity"/"-Infinity".

    `digits` rounds to that many significant digits (None keeps the full value).
    """
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return float(f"{value:.{digits}g}") if digits else value


def to_number(key: str, value: Any, where: str) -> int | float:
    """A metric value as a plain Python number: bool -> 0/1, int stays int, anything with __float__
    (float, numpy scalar, 0-d torch tensor) -> float.

    Raises TypeError naming `where` and `key` for a value that is not a number (a string, a list, a
    tensor with more than one element).
    """
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    try:
        return float(value)
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"{where}: metric {key!r} is {type(value).__name__} {value!r:.80}, expected a number; "
            "log scalars only (call .item() on a tensor, put text in log_samples)"
        ) from err


def encode_metrics(step: int, metrics: dict[str, Any], digits: int = 6) -> dict[str, Any]:
    """The JSON object for one `log` call: {"step": step, **metrics}, floats rounded, non-finite as strings.

    `metrics` values must already be numbers (see `to_number`).
    """
    row: dict[str, Any] = {"step": int(step)}
    for key, value in metrics.items():
        row[key] = encode_float(value, digits) if isinstance(value, float) else value
    return row


def encode_sample(value: Any) -> Any:
    """A sample row value made strictly JSON-serializable: floats keep full precision, non-finite floats
    become strings, tuples become lists, numpy/torch values become Python values through `.tolist()`."""
    if isinstance(value, float):
        return encode_float(value)
    if isinstance(value, dict):
        return {str(k): encode_sample(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode_sample(v) for v in value]
    if hasattr(value, "tolist"):
        return encode_sample(value.tolist())
    return value


def decode_row(row: dict[str, Any]) -> dict[str, Any]:
    """Inverse of `encode_metrics` for one row: the non-finite strings become floats again."""
    return {k: _NON_FINITE.get(v, v) if isinstance(v, str) else v for k, v in row.items()}


def parse_metrics_lines(lines: list[str], path: Path) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl file, in file order, values as written (non-finite still strings).

    A last line that does not parse is dropped: a crash while writing leaves a torn line, and that step is
    lost either way. A bad line elsewhere is corruption and raises ValueError with its line number.
    """
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not a JSON line ({err}); fix or delete that line") from err
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ValueError(f"{path}:{number}: expected a JSON object with an integer 'step', got {line!r:.120}")
        rows.append(row)
    return rows


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """All rows of a metrics.jsonl file (or of `path/metrics.jsonl` for a run directory) as dicts of
    numbers, "NaN"/"Infinity"/"-Infinity" turned back into floats. Several rows may share a step
    (training metrics and evaluation metrics logged separately)."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"read_metrics: {path} does not exist; pass a run directory or its metrics.jsonl")
    lines = path.read_text(encoding="utf-8").splitlines()
    return [decode_row(row) for row in parse_metrics_lines(lines, path)]


def truncate_metrics(path: Path, last_step: int) -> None:
    """Keep only the rows of `path` with step <= last_step, rewriting the file atomically.

    Why: a run that crashed after its last checkpoint logged steps the resumed run will log again.
    The new content goes to a temporary file that then replaces the old one (os.replace is atomic on
    POSIX and Windows), so a crash here leaves either the old or the new file, never half of one.
    """
    if not path.exists():
        return
    rows = parse_metrics_lines(path.read_text(encoding="utf-8").splitlines(), path)
    kept = "".join(json.dumps(row, allow_nan=False) + "\n" for row in rows if row["step"] <= last_step)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(kept, encoding="utf-8")
    os.replace(tmp, path)


def remove_samples_after(samples_dir: Path, last_step: int) -> None:
    """Delete samples/step_*.jsonl files of steps after `last_step` (written by a run that is being redone)."""
    if not samples_dir.is_dir():
        return
    for path in samples_dir.iterdir():
        match = _SAMPLE_FILE.fullmatch(path.name)
        if match and int(match.group(1)) > last_step:
            path.unlink()


def check_report_to(report_to: Iterable[str]) -> list[str]:
    """The report_to names as a list; ValueError for a name that is not a known sink."""
    if isinstance(report_to, str):
        report_to = [report_to]
    names = list(report_to)
    unknown = [name for name in names if name not in REPORT_TO_CHOICES]
    if unknown:
        raise ValueError(
            f"report_to: unknown {unknown}; allowed are {list(REPORT_TO_CHOICES)} "
            "(metrics.jsonl is always written, it needs no name)"
        )
    return names


def save_thumbnail(image: Any, samples_dir: Path) -> str:
    """Write a PIL image as a PNG thumbnail under samples_dir/images/, named by its content's hash so each image is
    written once (a group's rows and later steps share it); returns its path relative to the run directory."""
    thumb = image.convert("RGB")
    thumb.thumbnail((THUMBNAIL, THUMBNAIL))
    data = io.BytesIO()
    thumb.save(data, format="PNG")
    name = hashlib.sha256(data.getvalue()).hexdigest()[:16] + ".png"
    path = samples_dir / IMAGES_DIR / name
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(name + ".tmp")
        tmp.write_bytes(data.getvalue())
        os.replace(tmp, path)
    return f"{SAMPLES_DIR}/{IMAGES_DIR}/{name}"


def _is_image(value: Any) -> bool:
    return type(value).__module__.startswith("PIL.") and hasattr(value, "convert")  # (PIL stays unimported here)


def with_image_paths(row: dict[str, Any], samples_dir: Path) -> dict[str, Any]:
    """The row with its PIL images (any value that is one, or a list of them) replaced by their thumbnails' paths."""
    out = {}
    for key, value in row.items():
        if _is_image(value):
            value = save_thumbnail(value, samples_dir)
        elif isinstance(value, list) and value and all(_is_image(v) for v in value):
            value = [save_thumbnail(v, samples_dir) for v in value]
        out[key] = value
    return out


def samples_markdown(rows: list[dict[str, Any]]) -> str:
    """Sample rows as a markdown text for TensorBoard's text tab: one indented JSON block per row
    (TensorBoard renders markdown, and a 4-space indent keeps newlines inside completions)."""
    blocks = []
    for i, row in enumerate(rows):
        body = json.dumps(row, indent=2, ensure_ascii=False)
        blocks.append(f"**sample {i}**\n\n" + "\n".join("    " + line for line in body.splitlines()))
    return "\n\n".join(blocks)


class NullLogger:
    """A logger that records nothing: use it where logging is off (non-main processes, dry runs)."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Do nothing."""

    def log_samples(self, step: int, rows: list[dict], print_rows: int | None = None) -> None:
        """Do nothing."""

    def close(self) -> None:
        """Do nothing."""


class RunLogger:
    """Writes every step's metrics to `output_dir/metrics.jsonl`, and to TensorBoard / W&B when asked.

    Args:
        output_dir: the run directory (created if missing).
        report_to: extra sinks, any of "tensorboard", "wandb".
        config: the resolved run config; W&B stores it and TensorBoard shows it as text.
        run_name: the W&B run name (default: W&B's own).
        resume_step: None for a new run: metrics.jsonl starts empty and old samples files are removed.
            An int N to resume after the checkpoint of step N: rows and samples of steps > N are dropped
            (a crash may have logged steps after the last checkpoint), TensorBoard hides its events of
            steps > N (SummaryWriter's purge_step), and W&B continues the run whose id is in `wandb_run_id`
            (W&B cannot rewind a run: it ignores re-logged steps up to the last one it received).

    Steps must not decrease from one `log` call to the next; equal steps are fine (training then evaluation
    metrics of the same step).
    """

    def __init__(
        self,
        output_dir: str | Path,
        report_to: Iterable[str] = (),
        config: dict | None = None,
        run_name: str | None = None,
        resume_step: int | None = None,
        options: Any = None,
        sink_names: Callable[[dict], dict] | None = None,
    ) -> None:
        names = check_report_to(report_to)
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.output_dir / METRICS_FILE
        last_step = -1 if resume_step is None else resume_step
        truncate_metrics(self.metrics_path, last_step)
        self.metrics_path.touch()
        remove_samples_after(self.output_dir / SAMPLES_DIR, last_step)
        self._last_step = last_step
        self.options = options  # the run's config: logging_dir, project, wandb_entity, wandb_run_group
        # TensorBoard, W&B and trackio get the keys transformers' Trainer gives them (train/<k>, eval/<k>):
        self._sink_names = sink_names or (lambda logs: {dashboard_key(k): v for k, v in logs.items()})
        self._tensorboard = self._open_tensorboard(config, last_step + 1) if "tensorboard" in names else None
        self._wandb = self._open_wandb(config, run_name, resume_step is not None) if "wandb" in names else None
        self._trackio = self._open_trackio(config, run_name, resume_step is not None) if "trackio" in names else None

    def _open_tensorboard(self, config: dict | None, purge_step: int) -> Any:
        # Imported here so that `import grpo.training.observe.tracking` stays light when TensorBoard is not asked for.
        from torch.utils.tensorboard import SummaryWriter

        logging_dir = getattr(self.options, "logging_dir", None) or os.environ.get("TENSORBOARD_LOGGING_DIR")
        writer = SummaryWriter(logging_dir or str(tensorboard_dir(self.output_dir, purge_step > 1)),
                               purge_step=purge_step)
        if config is not None:
            writer.add_text("config", "    " + json.dumps(config, indent=2, default=str).replace("\n", "\n    "))
        return writer

    def _open_wandb(self, config: dict | None, run_name: str | None, resume: bool) -> Any:
        try:
            import wandb
        except ImportError as err:
            raise ImportError(
                "report_to contains 'wandb' but the wandb package is not installed; "
                "run `pip install wandb` (or `pip install grpo[wandb]`), or drop 'wandb' from report_to"
            ) from err
        id_path = self.output_dir / WANDB_ID_FILE
        run_id = id_path.read_text(encoding="utf-8").strip() if resume and id_path.exists() else None
        run = wandb.init(
            project=getattr(self.options, "wandb_project", None) or os.environ.get("WANDB_PROJECT", "grpo"),
            entity=getattr(self.options, "wandb_entity", None),
            group=getattr(self.options, "wandb_run_group", None),
            name=run_name,
            config=config,
            dir=str(self.output_dir),
            id=run_id,
            resume="allow" if run_id else None,
        )
        id_path.write_text(run.id, encoding="utf-8")
        return run

    def _open_trackio(self, config: dict | None, run_name: str | None, resume: bool) -> Any:
        try:
            import trackio
        except ImportError as err:
            raise ImportError("report_to contains 'trackio' but the trackio package is not installed; run "
                              "`pip install trackio`, or drop 'trackio' from report_to") from err
        project = getattr(self.options, "project", None) or "huggingface"
        return trackio.init(project=project, name=run_name, config=config, resume="allow" if resume else "never")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Append one row {"step": step, **metrics} to metrics.jsonl and send the metrics to the other sinks."""
        if step < self._last_step:
            raise ValueError(
                f"RunLogger.log: step {step} is before the last logged step {self._last_step}; steps must not decrease "
                "(on resume, pass resume_step so that later rows are dropped first)"
            )
        if "step" in metrics:
            raise ValueError(f"RunLogger.log: metrics at step {step} contain the reserved key 'step'; rename it")
        numbers = {key: to_number(key, value, f"RunLogger.log(step={step})") for key, value in metrics.items()}
        with self.metrics_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(encode_metrics(step, numbers), allow_nan=False) + "\n")
        self._last_step = step
        shown = self._sink_names(numbers)
        if self._tensorboard is not None:
            for key, value in shown.items():
                self._tensorboard.add_scalar(key, value, step)
            # Flush every step: the default flush_secs=120 loses two minutes of curves on a crash.
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log(shown, step=step)
        if self._trackio is not None:
            self._trackio.log(shown, step=step)

    def log_samples(self, step: int, rows: list[dict], print_rows: int | None = None) -> None:
        """Write sample completions of `step` to samples/step_{step:06d}.jsonl, one JSON object per row
        (e.g. prompt, completion, reward per function, advantage); also to TensorBoard text and a W&B table.
        PIL images in a row (a vision-language prompt's `images`) are written once each as PNG thumbnails under
        samples/images/ and the row holds their paths, relative to the run directory.
        `print_rows`: also print that many of them (TRL's num_completions_to_print)."""
        samples_dir = self.output_dir / SAMPLES_DIR
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise TypeError(f"RunLogger.log_samples(step={step}): row {i} is {type(row).__name__}, expected a dict")
        rows = [with_image_paths(row, samples_dir) for row in rows]
        for row in rows[:print_rows or 0]:
            paths = row.get("images") if isinstance(row.get("images"), list) else []
            images = "".join(f"\n  image: {p}" for p in paths if isinstance(p, str))
            print(f"step {step}  reward {row.get('reward')}  advantage {row.get('advantage')}{images}\n"
                  f"  prompt: {str(row.get('prompt'))[-200:]!r}\n  completion: {str(row.get('completion'))[:400]!r}")
        encoded, lines = [], []
        for i, row in enumerate(rows):
            encoded.append(encode_sample(row))
            try:
                lines.append(json.dumps(encoded[-1], allow_nan=False, ensure_ascii=False) + "\n")
            except TypeError as err:
                raise TypeError(f"RunLogger.log_samples(step={step}): row {i} is not JSON-serializable ({err}); "
                                "pass strings, numbers, lists and dicts (or PIL images)") from err
        samples_dir.mkdir(exist_ok=True)
        (samples_dir / f"step_{step:06d}.jsonl").write_text("".join(lines), encoding="utf-8")
        if self._tensorboard is not None:
            self._tensorboard.add_text("samples", samples_markdown(encoded), step)
            self._tensorboard.flush()
        if self._wandb is not None and encoded:
            import wandb

            columns = list(dict.fromkeys(key for row in encoded for key in row))
            data = [[json.dumps(row[c]) if isinstance(row.get(c), (dict, list)) else row.get(c) for c in columns]
                    for row in encoded]
            self._wandb.log({"samples": wandb.Table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        """Flush and close the TensorBoard writer and finish the W&B run. Safe to call twice."""
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._trackio is not None:
            self._trackio.finish()
            self._trackio = None


def extreme(key: str) -> bool:
    """Whether a step metric is a least or greatest value (*_min, *_max) rather than a mean."""
    return key.endswith(("_min", "_max"))


def accumulate(key: str, total, value, weight):
    """A step's metric over its micro-batches: the least or greatest for *_min / *_max, else a token-weighted sum
    (divided by the step's total weight when the step ends)."""
    if total is None:
        return value if extreme(key) else value * weight
    if extreme(key):
        return torch.minimum(total, value) if key.endswith("_min") else torch.maximum(total, value)
    return total + value * weight


class MetricSums:
    """A step's metrics over its micro-batches (`accumulate`), kept on the device until `means()`."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}
        self.weights: dict[str, float] = {}

    def add(self, key: str, value: torch.Tensor, weight: float) -> None:
        self.sums[key] = accumulate(key, self.sums.get(key), value.detach().double(), weight)
        self.weights[key] = self.weights.get(key, 0.0) + weight

    def means(self, skip: str | None = None, gather_objects=None) -> dict[str, float]:
        """Each metric's weighted mean (least or greatest for *_min / *_max) over the micro-batches, and over every
        process's when `gather_objects` (grpo.training.setup.processes.Processes') is given: one host transfer and, with
        several processes, one object gather per step."""
        names = [k for k in self.sums if skip is None or not k.startswith(skip)]
        values = torch.stack([self.sums[k] for k in names]).tolist() if names else []
        parts = [{k: (v, self.weights[k]) for k, v in zip(names, values)}]
        if gather_objects is not None:
            parts = gather_objects(parts)
        out = {}
        for key in dict.fromkeys(k for part in parts for k in part):  # (in order; a key some process lacks too)
            seen = [part[key] for part in parts if key in part]
            if extreme(key):
                out[key] = (min if key.endswith("_min") else max)(v for v, _ in seen)
            else:
                out[key] = sum(v for v, _ in seen) / max(sum(w for _, w in seen), 1e-9)
        return out
