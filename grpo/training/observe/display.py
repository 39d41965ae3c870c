"""What a person watching a training run sees: progress, ETA and the key metrics of the latest step.

Two modes, same content:

* live (a terminal): a `rich` Live region redrawn at each step, with a progress bar, s/step, ETA and a table of
  rewards, held-out accuracy, KL and completion length; alarms and notes print above it and stay in the scrollback;
* plain (CI, output piped to a file, or `rich` not installed): one compact line per step, e.g.
  ``step 12/200 | reward 0.43 (math_accuracy 0.38, think_format 0.92) | acc 0.38 | kl 0.0012 | len 31.2 |
  1.21 s/step | eta 3m52s``.

Metric names read here (the seed tutorial's names, missing keys are not shown): `reward/total`, `reward/<function>`,
`eval/accuracy`, `policy/kl_divergence`, `completion/mean_length`, `time/step` (seconds of the step).
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any

try:  # `rich` draws the live view; without it (some GPU images) every run shows plain lines
    from rich.console import Console, Group
    from rich.live import Live
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text
except ImportError:
    Console = None

# (label, metric key) of the single-value columns, in display order.
SCALAR_FIELDS = (
    ("acc", "eval/accuracy"),
    ("kl", "policy/kl_divergence"),
    ("len", "completion/mean_length"),
    ("tools", "tools/calls_per_completion"),  # multi-turn runs (grpo.agents)
)
# Step times averaged for the ETA: long enough to smooth evaluation steps and checkpoints, short enough to follow
# completions that grow longer as training goes on.
ETA_WINDOW = 20


def format_number(value: float) -> str:
    """3 significant digits (0.0012, 0.43, 31.2), whole numbers from 100 up (1234, not 1.23e+03)."""
    if not math.isfinite(value):
        return str(value)
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}"


def format_duration(seconds: float) -> str:
    """45s, 3m52s, 1h02m."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def is_reward_function_key(key: str) -> bool:
    """True for `reward/<function>`; False for `reward/total` and deeper keys such as `reward/<function>/std`,
    which are not one function's mean reward."""
    return key.startswith("reward/") and key.count("/") == 1 and key != "reward/total"


def reward_functions(metrics: dict[str, float]) -> list[tuple[str, float]]:
    """(function name, value) of each `reward/<function>` key, in the order given."""
    return [(key.split("/", 1)[1], value) for key, value in metrics.items() if is_reward_function_key(key)]


def plain_line(step: int, total_steps: int, metrics: dict[str, float], seconds_per_step: float | None,
               eta_seconds: float | None) -> str:
    """The one-line summary of a step printed in plain mode."""
    parts = [f"step {step}/{total_steps}"]
    functions = ", ".join(f"{name} {format_number(value)}" for name, value in reward_functions(metrics))
    if "reward/total" in metrics:
        parts.append(f"reward {format_number(metrics['reward/total'])}" + (f" ({functions})" if functions else ""))
    elif functions:
        parts.append(f"reward ({functions})")
    parts += [f"{label} {format_number(metrics[key])}" for label, key in SCALAR_FIELDS if key in metrics]
    if seconds_per_step is not None:
        parts.append(f"{format_number(seconds_per_step)} s/step")
    if eta_seconds is not None:
        parts.append(f"eta {format_duration(eta_seconds)}")
    return " | ".join(parts)


def metrics_table(metrics: dict[str, float], eval_step: int | None = None) -> Table | None:
    """A one-row table of the displayed metrics for live mode (None when none of them is present).

    `eval_step`: the step `eval/accuracy` comes from when it is not the current one (its column reads "acc@10").
    """
    columns = [("reward", metrics["reward/total"])] if "reward/total" in metrics else []
    columns += reward_functions(metrics)
    columns += [
        (label if key != "eval/accuracy" or eval_step is None else f"{label}@{eval_step}", metrics[key])
        for label, key in SCALAR_FIELDS
        if key in metrics
    ]
    if not columns:
        return None
    table = Table(box=None, padding=(0, 2, 0, 0), header_style="bold")
    for label, _ in columns:
        table.add_column(label, justify="right")
    table.add_row(*(format_number(value) for _, value in columns))
    return table


class StepTimer:
    """Seconds per step for the ETA: the mean of the last ETA_WINDOW step times.

    A step's time is its `time/step` metric when the trainer logs one, otherwise the wall-clock time since the
    previous update divided by the steps advanced (update may be called every k steps).
    """

    def __init__(self) -> None:
        self.times: deque[float] = deque(maxlen=ETA_WINDOW)
        self.last: tuple[int, float] | None = None

    def add(self, step: int, step_seconds: float | None) -> float | None:
        """Record `step`; return this step's seconds (None when unknown)."""
        now = time.monotonic()
        if step_seconds is None and self.last is not None and step > self.last[0]:
            step_seconds = (now - self.last[1]) / (step - self.last[0])
        self.last = (step, now)
        if step_seconds is not None and math.isfinite(step_seconds):
            self.times.append(step_seconds)
        return step_seconds

    def eta(self, steps_left: int) -> float | None:
        """Seconds until `steps_left` more steps are done, None before any step time is known."""
        return sum(self.times) / len(self.times) * steps_left if self.times else None


class LiveDisplay:
    """Shows the run's progress in the terminal.

    Args:
        total_steps: the step count of the whole run (for step/total, the progress bar and the ETA).
        enabled: whether to use the live `rich` view. None (default): live when the console is a terminal,
            plain lines otherwise (CI, `> log.txt`). False: always plain lines. True: always live.
        console: the `rich.console.Console` to write to (default: a new one on stdout).

    Alarms are shown when they become active and not again while they stay active: an alarm raised at every step
    prints once; one that stops for a step and comes back prints again.
    """

    def __init__(self, total_steps: int, enabled: bool | None = None, console: Console | None = None) -> None:
        if total_steps < 1:
            raise ValueError(f"LiveDisplay: total_steps must be >= 1, got {total_steps}")
        self.total_steps = total_steps
        self.console = console if console is not None else Console() if Console is not None else PlainConsole()
        self.live_mode = (self.console.is_terminal if enabled is None else enabled) and Console is not None
        self.timer = StepTimer()
        self.started = time.monotonic()
        self.updates = 0  # update calls so far; alarms remember the count at which they were last raised
        self.alarm_seen: dict[str, int] = {}
        self.last_eval: tuple[int, float] | None = None  # (step, eval/accuracy), kept between evaluations
        self._live: Live | None = None

    def update(self, step: int, metrics: dict[str, float]) -> None:
        """Show step `step` (1-based: `total_steps` is the last) with its metrics."""
        self.updates += 1
        seconds = self.timer.add(step, metrics.get("time/step"))
        eta = self.timer.eta(self.total_steps - step)
        if "eval/accuracy" in metrics:
            self.last_eval = (step, metrics["eval/accuracy"])
        if not self.live_mode:
            self.console.print(plain_line(step, self.total_steps, metrics, seconds, eta),
                               markup=False, highlight=False, soft_wrap=True)
            return
        if self._live is None:
            self._live = Live(console=self.console, auto_refresh=False, transient=False)
            self._live.start()
        self._live.update(self._renderable(step, metrics, seconds, eta), refresh=True)

    def _renderable(self, step: int, metrics: dict[str, float], seconds: float | None, eta: float | None) -> Group:
        header = Table.grid(padding=(0, 2))
        timing = [f"step {step}/{self.total_steps}"]
        if seconds is not None:
            timing.append(f"{format_number(seconds)} s/step")
        if eta is not None:
            timing.append(f"eta {format_duration(eta)}")
        timing.append(f"elapsed {format_duration(time.monotonic() - self.started)}")
        header.add_row(ProgressBar(total=self.total_steps, completed=step, width=30), Text("  ".join(timing)))
        parts: list[Any] = [header]
        # Evaluation runs every few steps; the live view keeps its last result on screen in between.
        if self.last_eval is not None and "eval/accuracy" not in metrics:
            table = metrics_table({**metrics, "eval/accuracy": self.last_eval[1]}, eval_step=self.last_eval[0])
        else:
            table = metrics_table(metrics)
        if table is not None:
            parts.append(table)
        active = [name for name, seen in self.alarm_seen.items() if self.updates - seen <= 1]
        if active:
            parts.append(Text("active alarms: " + ", ".join(active), style="yellow"))
        return Group(*parts)

    def alarm(self, name: str, message: str) -> None:
        """Warn about `name` (e.g. "health/kl_high") unless it was already raised in this or the previous step."""
        seen = self.alarm_seen.get(name)
        self.alarm_seen[name] = self.updates
        # Called every step, an alarm is seen at consecutive update counts (gap 1, or 0 when raised twice in one
        # step), whether the trainer raises it before or after `update`. A larger gap means it had cleared.
        if seen is not None and self.updates - seen <= 1:
            return
        self._print(f"WARNING {name}: {message}", style="bold yellow")

    def note(self, message: str) -> None:
        """Print an informational line (checkpoint saved, evaluation done, ...)."""
        self._print(message, style="dim")

    def _print(self, message: str, style: str) -> None:
        # In live mode `console.print` writes above the live region, so the line stays in the scrollback.
        if Console is None:
            self.console.print(message)
            return
        self.console.print(Text(message, style=style), highlight=False, soft_wrap=True)

    def close(self) -> None:
        """Stop the live region, leaving its last state on screen. Safe to call twice."""
        if self._live is not None:
            self._live.stop()
            self._live = None


class PlainConsole:
    """Where `rich` is not installed: what the plain mode prints, to stdout."""

    is_terminal = False

    def print(self, text, **_) -> None:
        print(text, flush=True)


class NullDisplay:
    """A display that shows nothing: use it where output is off (non-main processes, --quiet)."""

    def update(self, step: int, metrics: dict[str, float]) -> None:
        """Do nothing."""

    def alarm(self, name: str, message: str) -> None:
        """Do nothing."""

    def note(self, message: str) -> None:
        """Do nothing."""

    def close(self) -> None:
        """Do nothing."""
