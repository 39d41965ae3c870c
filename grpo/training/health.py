"""Training-health alarms: the seed tutorial's "What to watch" (seed 004, Step 3 and Pitfall 5) checked every step.

Each alarm is a `health/<name>` metric (1 while it fires, else 0) and, on the display, one message that says what to
change. The thresholds are the tutorial's where it gives one:

| alarm | fires when | tutorial / why |
|---|---|---|
| no_signal | advantage std < 0.1 | "advantage/std < 0.1: rewards too similar, no signal" |
| high_kl | KL > 0.05 | "policy/kl_divergence should stay low (< 0.05)" |
| zero_variance_groups | > 50% of groups have all-equal rewards | every such group has advantage 0: no gradient |
| truncation | > 50% of completions hit max_completion_length | silent no-learning from truncation (features.md 4, #8) |
| entropy_collapse | entropy < 10% of its first measured value | the policy stopped exploring |
| reward_hacking | over the last `window` steps the format reward rose by > 0.2 while accuracy moved < 0.02 | "Perfect format, wrong answers" |
| nonfinite | a step's gradient norm was not finite (the step was skipped) | "NaN losses" |
"""

from __future__ import annotations

import math
from collections import deque

ADVICE = {
    "no_signal": "advantage std {value:.3f} < 0.1: rewards are too similar to teach anything. Make the task harder "
                 "or easier, raise num_generations, or use dynamic_sampling.",
    "high_kl": "KL {value:.3f} > 0.05: the policy is drifting from the reference. Lower learning_rate or raise beta.",
    "zero_variance_groups": "{value:.0%} of groups have identical rewards (no gradient). Raise num_generations or "
                            "temperature, or turn on dynamic_sampling.",
    "truncation": "{value:.0%} of completions hit max_completion_length; they rarely earn rewards. Raise "
                  "max_completion_length or set mask_truncated_completions.",
    "entropy_collapse": "entropy {value:.3f} fell below 10% of its start: the policy stopped exploring. Lower "
                        "learning_rate, raise temperature, or add a KL penalty (beta).",
    "reward_hacking": "format reward rose by {value:.2f} while accuracy stayed flat: the model is learning the format, "
                      "not the task. Lower the format reward's weight (e.g. 0.1 x accuracy).",
    "nonfinite": "non-finite gradient at this step; it was skipped. Lower learning_rate or check the rewards.",
}


class HealthMonitor:
    """Turn each step's metrics into `health/*` alarms. `accuracy` and `format` name the reward functions to watch."""

    def __init__(self, accuracy: str | None = None, format: str | None = None, window: int = 20):
        self.accuracy, self.format, self.window = accuracy, format, window
        self.first_entropy: float | None = None
        self.history: deque[tuple[float, float]] = deque(maxlen=window)
        self.nonfinite_seen = 0.0

    def check(self, metrics: dict[str, float]) -> tuple[dict[str, float], list[tuple[str, str]]]:
        """(health metrics, [(alarm name, message)] for the alarms that fire at this step)."""
        values = {
            "no_signal": self._below(metrics, "advantage/std", 0.1),
            "high_kl": self._above(metrics, "policy/kl_divergence", 0.05),
            "zero_variance_groups": self._above(metrics, "groups/zero_std_frac", 0.5),
            "truncation": self._above(metrics, "completion/truncated_frac", 0.5),
            "entropy_collapse": self._entropy(metrics),
            "reward_hacking": self._hacking(metrics),
            "nonfinite": self._nonfinite(metrics),
        }
        fired = [(name, ADVICE[name].format(value=v)) for name, v in values.items() if v is not None]
        return {f"health/{name}": float(v is not None) for name, v in values.items()}, fired

    @staticmethod
    def _below(metrics: dict, key: str, limit: float) -> float | None:
        value = metrics.get(key)
        return value if value is not None and math.isfinite(value) and value < limit else None

    @staticmethod
    def _above(metrics: dict, key: str, limit: float) -> float | None:
        value = metrics.get(key)
        return value if value is not None and math.isfinite(value) and value > limit else None

    def _entropy(self, metrics: dict) -> float | None:
        value = metrics.get("policy/entropy")
        if value is None or not math.isfinite(value):
            return None
        if self.first_entropy is None:
            self.first_entropy = value
        return value if value < 0.1 * self.first_entropy else None

    def _hacking(self, metrics: dict) -> float | None:
        if not self.accuracy or not self.format or self.accuracy == self.format:
            return None
        acc, fmt = metrics.get(f"reward/{self.accuracy}"), metrics.get(f"reward/{self.format}")
        if acc is None or fmt is None:
            return None
        self.history.append((acc, fmt))
        if len(self.history) < self.window:
            return None
        half = self.window // 2
        old, new = list(self.history)[:half], list(self.history)[half:]
        mean = lambda xs, i: sum(x[i] for x in xs) / len(xs)  # noqa: E731
        format_gain, accuracy_gain = mean(new, 1) - mean(old, 1), mean(new, 0) - mean(old, 0)
        return format_gain if format_gain > 0.2 and abs(accuracy_gain) < 0.02 else None

    def _nonfinite(self, metrics: dict) -> float | None:
        total = metrics.get("health/nonfinite_steps", 0.0)
        fired = total > self.nonfinite_seen
        self.nonfinite_seen = total
        return total if fired else None


def nonfinite_messages(step: int, grad_norm: float, saved, in_a_row: int, limit: int,
                       deepspeed: bool) -> tuple[str, str | None]:
    """(the warning for a step whose gradient norm was not finite, the reason to stop the run or None)."""
    taken = ("DeepSpeed's engine had stepped already (it skips float16 overflows itself)" if deepspeed
             else "optimizer step skipped")
    warning = f"warning: step {step}: non-finite gradient norm ({grad_norm}); {taken}, inputs saved to {saved}."
    stop = None
    if in_a_row >= limit:
        stop = (f"step {step}: {in_a_row} non-finite gradient norms in a row (max_nonfinite_steps={limit}); stopped "
                f"with the last checkpoint intact. Inspect {saved}, lower learning_rate, or check the rewards.")
    return warning, stop


def report_nonfinite(trainer, batch, grad_norm: float, stopped: type) -> None:
    """A skipped non-finite step: its inputs saved, a warning printed, the run stopped (raising `stopped`) after
    max_nonfinite_steps in a row."""
    from grpo.training import checkpoint as ckpt

    saved = ckpt.save_nonfinite_inputs(trainer.cfg.output_dir, trainer.step + 1, trainer.rank, batch)
    warning, stop = nonfinite_messages(trainer.step + 1, grad_norm, saved, trainer.nonfinite_in_a_row,
                                       trainer.cfg.max_nonfinite_steps, trainer.accel.distributed_type == "DEEPSPEED")
    print(warning)
    if stop:
        raise stopped(stop)
