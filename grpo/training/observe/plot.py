"""A PNG summary of a run: rewards, accuracy, KL and completion length against step, from `metrics.jsonl`.

Panels (each drawn only when its keys were logged):

1. rewards: `reward/total` and each `reward/<function>`, the raw per-step values as a light line under a moving
   average (per-step GRPO rewards are noisy: with G=8 completions per prompt a mean moves in steps of 1/8);
2. accuracy: held-out `eval/accuracy` at the steps where it was measured, and the training accuracy
   (`reward/<function>` with "accuracy" in its name, moving average) for comparison;
3. `policy/kl_divergence`, with `completion/mean_length` on a second y axis.

The figure is drawn with `matplotlib.figure.Figure`, not pyplot: no GUI backend, no global figure registry to leak,
safe in a training process and on a machine without a display.
"""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from grpo.training.observe.display import is_reward_function_key
from grpo.training.observe.tracking import METRICS_FILE, read_metrics

PLOT_FILE = "plot.png"


def series(rows: list[dict[str, float]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key` over the rows that have it, non-finite values left out (they would break the
    line and the axis limits; the JSONL file keeps them)."""
    points = [(row["step"], float(row[key])) for row in rows if isinstance(row.get(key), (int, float))]
    points = [(step, value) for step, value in points if math.isfinite(value)]
    return [step for step, _ in points], [value for _, value in points]


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values; the first window-1 points average what is there so far."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def smoothing_window(n_points: int) -> int:
    """About a tenth of the run, between 1 (no smoothing) and 50 steps."""
    return max(1, min(50, round(n_points / 10)))


def reward_keys(rows: list[dict[str, float]]) -> list[str]:
    """`reward/total` then every `reward/<function>` key with a finite value, in first-logged order."""
    keys = dict.fromkeys(key for row in rows for key in row)
    candidates = (["reward/total"] if "reward/total" in keys else []) + [k for k in keys if is_reward_function_key(k)]
    return [key for key in candidates if series(rows, key)[0]]


def plot_smoothed(ax: Axes, steps: list[int], values: list[float], label: str, color: str) -> None:
    """A light raw line and its moving average in the same color (the raw line alone when too short to smooth)."""
    window = smoothing_window(len(values))
    if window == 1:
        ax.plot(steps, values, color=color, linewidth=1.8, label=label)
        return
    ax.plot(steps, values, color=color, linewidth=0.8, alpha=0.3)
    ax.plot(steps, moving_average(values, window), color=color, linewidth=1.8, label=f"{label} (avg {window})")


def draw_rewards(ax: Axes, rows: list[dict[str, float]], keys: list[str]) -> None:
    """Panel 1: every reward key against step."""
    for i, key in enumerate(keys):
        plot_smoothed(ax, *series(rows, key), label=key, color=f"C{i}")
    ax.set_ylabel("reward")
    ax.set_title("rewards", loc="left", fontsize=10)


def draw_accuracy(ax: Axes, rows: list[dict[str, float]], train_keys: list[str], colors: dict[str, str]) -> None:
    """Panel 2: held-out accuracy (markers at evaluated steps) and training accuracy rewards, each in the color
    it has in panel 1."""
    steps, values = series(rows, "eval/accuracy")
    if steps:
        ax.plot(steps, values, "o-", color="black", markersize=4, linewidth=1.2, label="held-out (eval/accuracy)")
    for key in train_keys:
        plot_smoothed(ax, *series(rows, key), label=f"train ({key})", color=colors[key])
    all_values = values + [v for key in train_keys for v in series(rows, key)[1]]
    if all_values and 0.0 <= min(all_values) and max(all_values) <= 1.0:
        ax.set_ylim(-0.03, 1.03)
    ax.set_ylabel("accuracy")
    ax.set_title("accuracy", loc="left", fontsize=10)


def draw_kl_and_length(ax: Axes, rows: list[dict[str, float]]) -> None:
    """Panel 3: KL to the reference on the left axis, mean completion length on the right one."""
    lines = []
    kl_steps, kl = series(rows, "policy/kl_divergence")
    if kl_steps:
        lines += ax.plot(kl_steps, kl, color="C3", linewidth=1.2, label="policy/kl_divergence")
        ax.set_ylabel("KL", color="C3")
    len_steps, length = series(rows, "completion/mean_length")
    if len_steps:
        length_ax = ax.twinx() if kl_steps else ax
        lines += length_ax.plot(len_steps, length, color="C4", linewidth=1.2, label="completion/mean_length")
        length_ax.set_ylabel("tokens", color="C4")
    ax.legend(lines, [line.get_label() for line in lines], loc="upper left", fontsize=8)
    ax.set_title("KL and completion length", loc="left", fontsize=10)


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw the run's metrics to `out` (default `run_dir/plot.png`) and return that path.

    Raises FileNotFoundError when `run_dir` has no metrics.jsonl, ValueError when it holds none of the plotted keys.
    """
    run_dir = Path(run_dir)
    if not (run_dir / METRICS_FILE).is_file():
        raise FileNotFoundError(f"plot_run: {run_dir / METRICS_FILE} does not exist; pass a run directory")
    rows = read_metrics(run_dir)
    rewards = reward_keys(rows)
    train_accuracy = [key for key in rewards if "accuracy" in key.split("/", 1)[1]]
    panels = []
    if rewards:
        panels.append(lambda ax: draw_rewards(ax, rows, rewards))
    if train_accuracy or series(rows, "eval/accuracy")[0]:
        colors = {key: f"C{i}" for i, key in enumerate(rewards)}  # the colors draw_rewards gives them
        panels.append(lambda ax: draw_accuracy(ax, rows, train_accuracy, colors))
    if series(rows, "policy/kl_divergence")[0] or series(rows, "completion/mean_length")[0]:
        panels.append(lambda ax: draw_kl_and_length(ax, rows))
    if not panels:
        raise ValueError(
            f"plot_run: {run_dir / METRICS_FILE} has no finite values of reward/*, eval/accuracy, "
            "policy/kl_divergence or completion/mean_length; nothing to plot"
        )
    fig = Figure(figsize=(9, 1.0 + 2.6 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, draw in zip(axes, panels):
        draw(ax)
        ax.grid(alpha=0.3)
        if ax.get_legend() is None:
            ax.legend(loc="best", fontsize=8)
    axes[-1].set_xlabel("step")
    fig.suptitle(run_dir.resolve().name)
    out = Path(out) if out is not None else run_dir / PLOT_FILE
    fig.savefig(out, dpi=110)
    return out
