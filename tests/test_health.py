"""Each health alarm fires on the metrics that should provoke it, and stays quiet on healthy ones."""

from __future__ import annotations

import json
from pathlib import Path

from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.training.observe.health import HealthMonitor

HEALTHY = {"advantage/std": 0.9, "policy/kl_divergence": 0.01, "groups/zero_std_frac": 0.1,
           "completion/truncated_frac": 0.05, "policy/entropy": 2.0, "health/nonfinite_steps": 0.0,
           "reward/math_accuracy": 0.4, "reward/think_format": 0.9}


def fired(monitor, **changes):
    values, alarms = monitor.check({**HEALTHY, **changes})
    assert set(values) == {f"health/{n}" for n in ("no_signal", "high_kl", "zero_variance_groups", "truncation",
                                                     "entropy_collapse", "reward_hacking", "nonfinite",
                                                     "reward_errors", "tool_faults")}
    return {name for name, _ in alarms}


def test_healthy_metrics_fire_nothing():
    assert fired(HealthMonitor("math_accuracy", "think_format")) == set()


def test_failing_rewards_and_tools_alarm_past_a_tenth_of_rows_or_calls():
    m = HealthMonitor("math_accuracy", "think_format")
    assert fired(m, **{"reward/error_frac/math_accuracy": 0.1, "tools/fault_frac": 0.1}) == set()  # (at the limit)
    assert fired(m, **{"reward/error_frac/math_accuracy": 1.0, "tools/fault_frac": 1.0}) == {"reward_errors",
                                                                                             "tool_faults"}
    _, alarms = m.check({**HEALTHY, "reward/error_frac/math_accuracy": 1.0, "tools/fault_frac": 1.0})
    assert dict(alarms)["reward_errors"].startswith("reward function 'math_accuracy' failed on 70% of its rows")
    # (the mean of the last steps: 0.1, 1.0, 1.0)
    assert m.summary() == ["tools raised or timed out on 70% of their calls this run (tools/errors/raised, "
                           "tools/errors/timeout)."]


def test_each_threshold_alarm():
    """Each rate alarm fires once the mean of the last steps passes its limit (a steady unhealthy value: at once)."""
    for changes, name in [({"advantage/std": 0.05}, "no_signal"), ({"policy/kl_divergence": 0.06}, "high_kl"),
                          ({"groups/zero_std_frac": 0.8}, "zero_variance_groups"),
                          ({"completion/truncated_frac": 0.6}, "truncation")]:
        m = HealthMonitor("math_accuracy", "think_format")
        assert [fired(m, **changes) for _ in range(3)] == [{name}] * 3
    m = HealthMonitor("math_accuracy", "think_format")
    fired(m)  # first step: entropy 2.0 is the reference
    assert fired(m, **{"policy/entropy": 0.19}) == {"entropy_collapse"}  # < 10% of 2.0
    assert fired(m, **{"policy/entropy": 0.21}) == set()
    assert fired(m, **{"health/nonfinite_steps": 1.0}) == {"nonfinite"}
    assert fired(m, **{"health/nonfinite_steps": 1.0}) == set()  # only on the step it happened


def test_rate_alarms_judge_the_mean_of_the_last_ten_steps():
    """One noisy step among healthy ones fires nothing; the alarm fires when the 10-step mean passes the limit."""
    m = HealthMonitor("math_accuracy", "think_format")
    for _ in range(9):
        fired(m, **{"policy/kl_divergence": 0.03, "groups/zero_std_frac": 0.4})
    # one step at KL 0.12 and 7 of 8 groups all-equal: means (9 x 0.03 + 0.12) / 10 = 0.039, (9 x 0.4 + 0.875) / 10
    # = 0.4475: below 0.05 and 0.75
    assert fired(m, **{"policy/kl_divergence": 0.12, "groups/zero_std_frac": 0.875}) == set()
    # KL 0.07 for 9 more steps: the window holds 0.12 and 9 x 0.07, mean (0.12 + 0.63) / 10 = 0.075 > 0.05; it first
    # passes 0.05 after 3 steps: (6 x 0.03 + 0.12 + 3 x 0.07) / 10 = 0.051
    steps = [fired(m, **{"policy/kl_divergence": 0.07}) for _ in range(9)]
    assert steps[:2] == [set(), set()] and all(s == {"high_kl"} for s in steps[2:])


def test_the_default_job_raises_no_alarm():
    """The default job's recorded metrics (`grpo train`, 300 steps; per-step: 22 steps with KL > 0.05, 33 with more
    than half of the groups all-equal) fire no alarm."""
    rows = [json.loads(line) for line in (Path(__file__).parent / "fixtures" / "default_job_metrics.jsonl").open()]
    assert len(rows) == 300
    assert sum(r["policy/kl_divergence"] > 0.05 for r in rows) == 22
    assert sum(r["groups/zero_std_frac"] > 0.5 for r in rows) == 33
    m = HealthMonitor("math_accuracy", "think_format")
    assert [a for r in rows for a in m.check(r)[1]] == []


def test_reward_hacking_needs_format_up_and_accuracy_flat():
    m = HealthMonitor("math_accuracy", "think_format", window=10)
    for step in range(10):  # format climbs 0.5 -> 0.95, accuracy stays 0.40
        names = fired(m, **{"reward/think_format": 0.5 + 0.05 * step, "reward/math_accuracy": 0.4})
    # mean of the last 5 (0.85) minus the first 5 (0.6) = 0.25 > 0.2, accuracy moved 0 < 0.02.
    assert names == {"reward_hacking"}
    m = HealthMonitor("math_accuracy", "think_format", window=10)
    for step in range(10):  # both climb: learning, not hacking
        names = fired(m, **{"reward/think_format": 0.5 + 0.05 * step, "reward/math_accuracy": 0.3 + 0.03 * step})
    assert names == set()


def test_alarm_message_gives_the_advice():
    _, alarms = HealthMonitor().check({**HEALTHY, "policy/kl_divergence": 0.08})
    assert alarms == [("high_kl", "KL 0.080 > 0.05 over the last steps: the policy is drifting from the reference. "
                                  "Lower learning_rate or raise beta.")]


def test_trainer_logs_the_zero_variance_alarm(tiny_model_dir, tmp_path):
    """A constant reward gives every group zero variance: the run says so in its metrics."""
    def constant(completions, **kwargs):
        return [1.0] * len(completions)

    cfg = GRPOConfig(output_dir=str(tmp_path / "run"), task=None, num_generations=4, prompts_per_step=2,
                     max_completion_length=4, learning_rate=1e-3, beta=0.0, max_steps=2, save_steps=0,
                     report_to=[], log_completions_steps=0)
    metrics = GRPOTrainer(model=tiny_model_dir, reward_funcs=[constant], args=cfg,
                          train_dataset=Dataset.from_dict({"prompt": ["a", "b"]})).train()
    assert metrics["health/zero_variance_groups"] == 1.0 and metrics["health/no_signal"] == 1.0
