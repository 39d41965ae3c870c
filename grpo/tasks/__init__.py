"""Built-in tasks: procedurally generated problems with train and held-out splits, and the rewards that score them.

Each task is reproducible from a seed, needs no download, and declares its reward functions by their names in
`grpo.rewards`. A row's `prompt` is plain text ending in a newline; the trainer appends the task's `prefill`
("<think>") with no separator, and the model continues with "...reasoning...</think>\\n<answer>X</answer>".

    from grpo.tasks import get_task
    task = get_task("arithmetic")
    test = task.dataset("test", n=500, seed=0, difficulty=2)  # datasets.Dataset (grpo.rows.Rows without datasets)
    test[0]["prompt"], test[0]["answer"]                       # ("Calculate 5 + 4\\n", "9")
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path
from typing import Callable

from grpo.rows import make_table
from grpo.tasks import arithmetic, calculator, countdown, shapes
from grpo.tasks._common import SPLITS, check_split

__all__ = ["SPLITS", "TASKS", "Task", "export", "get_task"]


@dataclasses.dataclass(frozen=True)
class Task:
    """A built-in task: how to generate its rows and how to reward completions."""

    name: str
    description: str
    reward_funcs: list[str]  # names of built-in rewards in `grpo.rewards`
    reward_weights: list[float]  # one weight per reward function
    prefill: str  # text the trainer appends to each prompt; the completion continues it
    step_reward: str | None  # a step-level (process) reward of `grpo.rewards`, or None
    make_rows: Callable[..., list[dict]]  # (split, n, seed, **knobs) -> rows
    default_sizes: dict[str, int]  # rows per split when `dataset` is called with n=None
    tools: tuple[str, ...] = ()  # built-in tools (`grpo.agents.tools`) the model may call

    @property
    def knobs(self) -> dict[str, object]:
        """The knobs `dataset` accepts, with their defaults."""
        params = inspect.signature(self.make_rows).parameters.values()
        return {p.name: p.default for p in params if p.name not in ("split", "n", "seed")}

    def dataset(self, split: str, n: int | None = None, seed: int = 0, **knobs):
        """`n` rows (default `default_sizes[split]`) of `split` ("train" or "test"), the same for the same arguments:
        a `datasets.Dataset`, or a `grpo.rows.Rows` where `datasets` is not installed."""
        check_split(split)
        unknown = sorted(set(knobs) - set(self.knobs))
        if unknown:
            raise ValueError(f"task {self.name!r} has no knob(s) {unknown}; its knobs are {self.knobs}")
        count = self.default_sizes[split] if n is None else n
        return make_table(self.make_rows(split, count, seed, **knobs))


# TinyZero scores countdown 1.0 for a correct equation and 0.1 for the right format alone
# (verl/utils/reward_score/countdown.py, `format_score=0.1`); both tasks keep that ratio.
TASKS: dict[str, Task] = {
    "arithmetic": Task(
        name="arithmetic",
        description=(
            "Evaluate an integer expression with + - * and precedence ('Calculate 2 + 2 * 6'), one operation "
            "per reasoning line; knob `difficulty` 1-4 (default 2: 2-3 operands in 1..9)."
        ),
        reward_funcs=["math_accuracy", "think_format"],
        reward_weights=[1.0, 0.1],
        prefill="<think>",
        step_reward="arithmetic_steps",
        make_rows=arithmetic.rows,
        default_sizes={"train": 10_000, "test": 500},
    ),
    "countdown": Task(
        name="countdown",
        description=(
            "TinyZero's Countdown: reach `target` from 3-4 `nums` with + - * /, each number used exactly once; "
            "every generated problem is solvable."
        ),
        reward_funcs=["countdown", "think_format"],
        reward_weights=[1.0, 0.1],
        prefill="<think>",
        step_reward=None,
        make_rows=countdown.rows,
        default_sizes={"train": 10_000, "test": 500},
    ),
    "calculator": Task(
        name="calculator",
        description=(
            "One + - * operation on operands of 1-3 digits ('What is 482 * 37?'), with a `calculator` tool; "
            "the model must call it and copy its answer into <answer>. Needs a chat template with tool calls "
            "(grpo/assets/tiny-tools)."
        ),
        reward_funcs=["math_accuracy"],
        reward_weights=[1.0],
        prefill="",
        step_reward=None,
        make_rows=calculator.rows,
        default_sizes={"train": 10_000, "test": 500},
        tools=("calculator",),
    ),
    "shapes": Task(
        name="shapes",
        description=(
            "Count the shapes of one colour and kind in a generated 64x64 picture ('How many red squares?'), the "
            "picture in the `image` column: a vision-language task for grpo/assets/tiny-vision (docs/vision.md); "
            "knobs `max_count` (default 4) and `distractors` (default 3)."
        ),
        reward_funcs=["math_accuracy"],
        reward_weights=[1.0],
        prefill="",
        step_reward=None,
        make_rows=shapes.rows,
        default_sizes={"train": 10_000, "test": 500},
    ),
}


def get_task(name: str) -> Task:
    """The built-in task called `name`."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; built-in tasks are {sorted(TASKS)}")
    return TASKS[name]


def export(task_name: str, out_dir: str | Path, n_train: int, n_test: int, seed: int = 0, **knobs) -> dict[str, Path]:
    """Write `out_dir/train.jsonl` and `out_dir/test.jsonl` (one JSON object per row); returns split -> path."""
    task = get_task(task_name)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, n in zip(SPLITS, (n_train, n_test)):
        paths[split] = out / f"{split}.jsonl"
        with paths[split].open("w", encoding="utf-8") as f:
            for row in task.dataset(split, n=n, seed=seed, **knobs):
                if "image" in row:
                    raise ValueError(f"export: task {task_name!r} has images, which JSONL cannot hold; use "
                                     "task.dataset(...).save_to_disk(path) instead")
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return paths
