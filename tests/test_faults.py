"""Fault injection through the whole trainer: a NaN loss step is skipped and survived, a NaN streak stops the run
with the last checkpoint intact, and faulty reward functions either stop the run with a named error or are counted.
"""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset

import grpo.training.update.objective as objective_module
from grpo import GRPOConfig, GRPOTrainer
from grpo.training.checkpoint.files import latest_checkpoint
from grpo.rewards import RewardError
from grpo.training.trainer import TrainingStopped
from rewards_for_tests import count_a


def config(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path / "run"), task=None, num_generations=4, prompts_per_step=2,
                  max_completion_length=6, learning_rate=1e-2, beta=0.0, max_steps=4, save_steps=1, report_to=[],
                  log_completions_steps=0, seed=0)
    values.update(overrides)
    return GRPOConfig(**values)


def data():
    return Dataset.from_dict({"prompt": [f"q{i}\n" for i in range(8)]})


def nan_loss_at(steps: set[int], trainer_ref: list):
    """Wrap policy_loss so its loss is NaN while the trainer is at one of `steps` (1-based)."""
    real = objective_module.policy_loss

    def patched(*args, **kwargs):
        out = real(*args, **kwargs)
        if trainer_ref[0].step + 1 in steps:
            out.loss = out.loss * float("nan")
        return out

    return patched


def test_nan_loss_step_is_skipped_and_the_run_survives(tiny_model_dir, tmp_path, monkeypatch):
    ref: list = [None]
    monkeypatch.setattr(objective_module, "policy_loss", nan_loss_at({2}, ref))
    t = GRPOTrainer(model=tiny_model_dir, reward_funcs=[count_a], args=config(tmp_path), train_dataset=data())
    ref[0] = t
    t.train()
    assert all(torch.isfinite(p).all() for p in t.policy.parameters())
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["health/nonfinite_steps"] for r in rows] == [0, 1, 1, 1]
    assert rows[1]["train/grad_norm"] == "NaN"  # logged as NaN (strict-JSON string), not hidden as 0.0
    saved = torch.load(tmp_path / "run" / "nonfinite" / "step_000002_rank0.pt", weights_only=False)
    assert saved["input_ids"].shape[0] == 8 and len(saved["samples"]) == 8


def test_nan_streak_stops_with_last_checkpoint_intact(tiny_model_dir, tmp_path, monkeypatch):
    ref: list = [None]
    monkeypatch.setattr(objective_module, "policy_loss", nan_loss_at({3, 4, 5, 6}, ref))
    cfg = config(tmp_path, max_steps=8, max_nonfinite_steps=2)
    t = GRPOTrainer(model=tiny_model_dir, reward_funcs=[count_a], args=cfg, train_dataset=data())
    ref[0] = t
    message = r"step 4: 2 non-finite gradient norms in a row \(max_nonfinite_steps=2\)"
    with pytest.raises(TrainingStopped, match=message):
        t.train()
    last = latest_checkpoint(tmp_path / "run")
    assert last is not None and last.name == "checkpoint-3"  # step 3 was skipped but saved finite weights


def raises(completions, **kwargs):
    raise KeyError("boom")


def wrong_length(completions, **kwargs):
    return [1.0]


def returns_string(completions, **kwargs):
    return ["good"] * len(completions)


def returns_nan(completions, **kwargs):
    return [float("nan")] * len(completions)


def returns_inf(completions, **kwargs):
    return [float("inf")] * len(completions)


def all_none(completions, **kwargs):
    return [None] * len(completions)


@pytest.mark.parametrize("func, message", [
    (raises, "reward function 'raises' raised KeyError"),
    (wrong_length, "reward function 'wrong_length' returned 1 rewards for 8 completions"),
    (returns_string, "'returns_string'"),
    (returns_nan, "reward function 'returns_nan' returned nan for row 0"),
    (returns_inf, "reward function 'returns_inf' returned inf for row 0"),
    (all_none, "every reward function (all_none) returned None for row 0"),
])
def test_faulty_reward_stops_with_a_named_error(tiny_model_dir, tmp_path, func, message):
    # (a row no function scores stops the run with reward_on_all_none: raise; TRL's warning is the default)
    t = GRPOTrainer(model=tiny_model_dir, reward_funcs=[func], args=config(tmp_path, reward_on_all_none="raise"),
                    train_dataset=data())
    with pytest.raises(RewardError) as err:
        t.train()
    assert message in str(err.value), str(err.value)


def test_faulty_rewards_counted_when_asked(tiny_model_dir, tmp_path):
    cfg = config(tmp_path, reward_on_error="zero", reward_on_nonfinite="none", max_steps=2, save_steps=0)
    t = GRPOTrainer(model=tiny_model_dir, reward_funcs=[count_a, raises, returns_nan], args=cfg,
                    train_dataset=data())
    metrics = t.train()
    assert metrics["reward/errors/raises"] == 8 and metrics["reward/errors/returns_nan"] == 8
    assert metrics["reward/errors/count_a"] == 0


def test_hanging_reward_costs_seconds(tiny_model_dir, tmp_path):
    import time

    def hangs(completions, **kwargs):
        time.sleep(60)

    cfg = config(tmp_path, reward_on_error="zero", reward_timeout=0.5, max_steps=2, save_steps=0)
    start = time.monotonic()
    metrics = GRPOTrainer(model=tiny_model_dir, reward_funcs=[count_a, hangs], args=cfg, train_dataset=data()).train()
    assert metrics["reward/timeouts/hangs"] == 1 and time.monotonic() - start < 30


def test_a_reward_failing_on_every_row_prints_once_then_alarms_and_sums_up(tiny_model_dir, tmp_path, capsys, caplog):
    """reward_on_error: zero with a function that raises on every row printed a line per row (192 in 3 steps, issue
    34): now its first failure is one line, the health alarm reward_errors fires, and the run's end says how often
    it failed; the hints name the config's keys."""
    import logging

    cfg = config(tmp_path, reward_on_error="zero", max_steps=3, save_steps=0, disable_tqdm=False)
    with caplog.at_level(logging.WARNING, logger="grpo.rewards.runner"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=[count_a, raises], args=cfg, train_dataset=data()).train()
    logged = [r.getMessage() for r in caplog.records if "raises" in r.getMessage()]
    assert len(logged) == 1 and logged[0].startswith("reward function 'raises' raised KeyError('boom') on row 0")
    out = capsys.readouterr().out
    assert out.count("WARNING reward_errors: reward function 'raises' failed on 100% of its rows") == 1
    assert "WARNING  reward function 'raises' failed on 24 of 24 rows (100%) this run; the first: reward function " \
           "'raises' raised KeyError('boom') on row 0" in out
    with pytest.raises(RewardError, match=r"or set reward_on_error: zero to score such rows 0"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=[raises], args=config(tmp_path / "b"),
                    train_dataset=data()).train()
    with pytest.raises(RewardError, match=r"or set reward_on_nonfinite: none to skip such values"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=[returns_nan], args=config(tmp_path / "c"),
                    train_dataset=data()).train()
