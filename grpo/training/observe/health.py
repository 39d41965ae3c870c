"""Training-health alarms: the seed tutorial's "What to watch" (seed 004, Step 3 and Pitfall 5) checked every step.

Each alarm is a `health/<name>` metric (1 while it fires, else 0) and, on the display, one message that says what to
change. The rate alarms judge the mean of the last `window` (10) steps, not one step: one step's value is an average
over B prompts (8 in the default job), too few to tell a trend from noise (below). The thresholds:

| alarm | fires when (10-step mean) | why |
|---|---|---|
| no_signal | advantage std < 0.1 | tutorial: "advantage/std < 0.1: rewards too similar, no signal" |
| high_kl | KL per token > 0.05 | tutorial: "policy/kl_divergence should stay low (< 0.05)" |
| zero_variance_groups | > 75% of groups have all-equal rewards | fewer than 1 group in 4 carries a gradient |
| truncation | > 50% of completions hit max_completion_length | silent no-learning from truncation (features.md 4, #8) |
| entropy_collapse | entropy (one step) < 10% of its first measured value | the policy stopped exploring |
| reward_hacking | over the last `window` steps the format reward rose by > 0.2 while accuracy moved < 0.02 | "Perfect format, wrong answers" |
| nonfinite | a step's gradient norm was not finite (the step was skipped) | "NaN losses" |
| reward_errors | a reward function failed on > 10% of its rows (raised, overran, non-finite) | its rows teach nothing |
| tool_faults | tools raised or timed out on > 10% of their calls | a broken or hanging tool teaches nothing, slowly |

Why a mean over 10 steps, and why 75% of groups (the default job: `grpo train`, 300 steps, B=8 prompts x G=8, binary
accuracy reward; its trace is tests/fixtures/default_job_metrics.jsonl, and it raises no alarm):
- Zero-variance groups. A prompt answered right with probability p gives an all-equal group of G with probability
  p^G + (1-p)^G; prompts differ in p, so a run that has mastered the easy prompts has many such groups while it
  still learns from the rest (the default job: 38% on average after step 100, at accuracy 0.68). One step counts
  B=8 groups, a binomial draw with standard deviation sqrt(f(1-f)/B) = 0.17 at f=0.38 (measured: 0.170), so a
  per-step limit of 50% fired on 33 of its 300 steps. The mean of 10 steps (80 groups) has standard deviation
  0.054: 75% is 6.8 of them above that run's rate, and still means what the advice is for: fewer than a quarter
  of the generated groups teach anything (raise num_generations or temperature, or use dynamic_sampling).
- KL. The k3 estimate of one step (~1,400 tokens of 64 completions, correlated within a completion) is noisy: the
  default job's per-step KL after step 50 has mean 0.028 and standard deviation 0.016, so the tutorial's 0.05
  fired on 22 single steps. Its 10-step mean (standard deviation ~0.005) never passed 0.039; 0.05 on the mean is a
  drift the penalty does not hold, not one noisy batch.
"""

from __future__ import annotations

import math
from collections import deque

ADVICE = {
    "no_signal": "advantage std {value:.3f} < 0.1 over the last steps: rewards are too similar to teach anything. "
                 "Make the task harder or easier, raise num_generations, or use dynamic_sampling.",
    "high_kl": "KL {value:.3f} > 0.05 over the last steps: the policy is drifting from the reference. Lower "
               "learning_rate or raise beta.",
    "zero_variance_groups": "{value:.0%} of groups over the last steps have identical rewards (no gradient). Raise "
                            "num_generations or temperature, or turn on dynamic_sampling.",
    "truncation": "{value:.0%} of completions over the last steps hit max_completion_length; they rarely earn "
                  "rewards. Raise max_completion_length or set mask_truncated_completions.",
    "entropy_collapse": "entropy {value:.3f} fell below 10% of its start: the policy stopped exploring. Lower "
                        "learning_rate, raise temperature, or add a KL penalty (beta).",
    "reward_hacking": "format reward rose by {value:.2f} while accuracy stayed flat: the model is learning the format, "
                      "not the task. Lower the format reward's weight (e.g. 0.1 x accuracy).",
    "nonfinite": "non-finite gradient at this step; it was skipped. Lower learning_rate or check the rewards.",
    "reward_errors": "reward function '{name}' failed on {value:.0%} of its rows over the last steps (reward/errors/"
                     "{name}; its first failure was printed above); those rows teach nothing. Fix the function.",
    "tool_faults": "tools raised or timed out on {value:.0%} of their calls over the last steps (tools/errors/raised, "
                   "tools/errors/timeout; a timeout costs tool_timeout s). Fix the tool, or lower tool_timeout.",
}
FAILURE_LIMIT = 0.1  # reward_errors, tool_faults: the fraction of rows or calls that fail, over the last steps
# alarm -> (metric, limit, fires above the limit): judged on the mean of the last `window` steps
RATE_ALARMS = {"no_signal": ("advantage/std", 0.1, False), "high_kl": ("policy/kl_divergence", 0.05, True),
               "zero_variance_groups": ("groups/zero_std_frac", 0.75, True),
               "truncation": ("completion/truncated_frac", 0.5, True),
               "tool_faults": ("tools/fault_frac", FAILURE_LIMIT, True)}


class HealthMonitor:
    """Turn each step's metrics into `health/*` alarms. `accuracy` and `format` name the reward functions to watch."""

    def __init__(self, accuracy: str | None = None, format: str | None = None, window: int = 20, smooth: int = 10):
        self.accuracy, self.format, self.window = accuracy, format, window
        self.first_entropy: float | None = None
        self.history: deque[tuple[float, float]] = deque(maxlen=window)
        self.recent = {name: deque(maxlen=smooth) for name in RATE_ALARMS}
        self.nonfinite_seen = 0.0
        self.reward_errors: dict[str, deque] = {}  # function -> its recent error fractions
        self.tool_faults = [0.0, 0]  # (sum of the steps' fault fractions, steps): the run's summary

    def check(self, metrics: dict[str, float]) -> tuple[dict[str, float], list[tuple[str, str]]]:
        """(health metrics, [(alarm name, message)] for the alarms that fire at this step)."""
        values = {name: self._rate(name, metrics) for name in RATE_ALARMS}
        failing = self._reward_errors(metrics)
        values.update(entropy_collapse=self._entropy(metrics), reward_hacking=self._hacking(metrics),
                      nonfinite=self._nonfinite(metrics), reward_errors=failing and failing[1])
        if "tools/fault_frac" in metrics:
            self.tool_faults = [self.tool_faults[0] + metrics["tools/fault_frac"], self.tool_faults[1] + 1]
        order = ("no_signal", "high_kl", "zero_variance_groups", "truncation", "entropy_collapse", "reward_hacking",
                 "nonfinite", "reward_errors", "tool_faults")
        fired = [(name, ADVICE[name].format(value=values[name], name=failing and failing[0])) for name in order
                 if values[name] is not None]
        return {f"health/{name}": float(values[name] is not None) for name in order}, fired

    def _rate(self, name: str, metrics: dict) -> float | None:
        """The mean of the metric over the last steps (those it was logged at), if past the alarm's limit."""
        key, limit, above = RATE_ALARMS[name]
        value, recent = metrics.get(key), self.recent[name]
        if value is not None and math.isfinite(value):
            recent.append(value)
        if value is None or not recent:
            return None
        mean = sum(recent) / len(recent)
        return mean if (mean > limit if above else mean < limit) else None

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

    def _reward_errors(self, metrics: dict) -> tuple[str, float] | None:
        """(the function, its mean error fraction over the last steps) that fails most, if past FAILURE_LIMIT."""
        worst = None
        for key, value in metrics.items():
            if key.startswith("reward/error_frac/") and math.isfinite(value):
                recent = self.reward_errors.setdefault(key[len("reward/error_frac/"):], deque(maxlen=10))
                recent.append(value)
        for name, recent in self.reward_errors.items():
            mean = sum(recent) / len(recent)
            if mean > FAILURE_LIMIT and (worst is None or mean > worst[1]):
                worst = (name, mean)
        return worst

    def summary(self) -> list[str]:
        """The run's end: a line when its tools failed on more than FAILURE_LIMIT of their calls on average."""
        total, steps = self.tool_faults
        if steps and total / steps > FAILURE_LIMIT:
            return [f"tools raised or timed out on {total / steps:.0%} of their calls this run (tools/errors/raised, "
                    "tools/errors/timeout)."]
        return []

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


def report_nonfinite(cfg, loop, rank: int, batch, grad_norm: float, deepspeed: bool, stopped: type) -> None:
    """A skipped non-finite step (loop.step + 1): its inputs saved, a warning printed, the run stopped (raising
    `stopped`) after max_nonfinite_steps in a row."""
    from grpo.training.checkpoint import files as ckpt

    saved = ckpt.save_nonfinite_inputs(cfg.output_dir, loop.step + 1, rank, batch)
    warning, stop = nonfinite_messages(loop.step + 1, grad_norm, saved, loop.nonfinite_in_a_row,
                                       cfg.max_nonfinite_steps, deepspeed)
    print(warning)
    if stop:
        raise stopped(stop)
