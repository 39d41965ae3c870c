"""With `preset: trl`, grpo trains as TRL 1.16 does: the same completions give TRL's own loss, gradient norm and KL,
step after step.

Both trainers get the tiny model, the same prompts, TRL's documented reward example 1.1 and the same completions
(TRL's `_generate_single_turn` replaced by the script, grpo's rollout engine scripted alike), so every difference
left is in what the two compute from them: TRL's defaults under the preset (loss_type dapo, the ratio-corrected KL,
a linear schedule, gradient checkpointing), beta set to 0.04 on both sides to bring the KL term in.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from datasets import Dataset

TEXTS = ["a", "bb", "aab", "aaaaaaa", "ab", "a", "bbbbbba", "aa"]  # one row each; 7 characters + EOS fit in 8


def reward_func(completions, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of character count)."""
    return [float(len(completion)) for completion in completions]  # (TRL's docs, reward example 1.1)


def script(tokenizer, rows: int) -> list[list[int]]:
    ids = [tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id] for t in TEXTS]
    return [ids[i % len(ids)] for i in range(rows)]


class Scripted:
    """grpo's side: a rollout engine writing TEXTS row by row."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def generate(self, prompt_ids, params, seeds):
        ids = script(self.tokenizer, len(prompt_ids))
        return SimpleNamespace(ids=ids, truncated=[False] * len(ids), logprobs=None)


SETTINGS = dict(num_generations=4, per_device_train_batch_size=8, max_completion_length=8, learning_rate=1e-2,
                beta=0.04, max_steps=3, logging_steps=1, bf16=False, report_to="none", save_strategy="no")


def test_preset_trl_gives_trls_loss_values(tiny_model_dir, tmp_path):
    trl = pytest.importorskip("trl")
    from transformers import AutoTokenizer

    from grpo import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    data = Dataset.from_dict({"prompt": ["q\n"] * 8})

    theirs = trl.GRPOTrainer(model=tiny_model_dir, reward_funcs=reward_func, train_dataset=data,
                             args=trl.GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **SETTINGS))
    theirs._generate_single_turn = lambda prompt_ids, *a, **k: (script(tokenizer, len(prompt_ids)), None)
    theirs.train()
    want = [row for row in theirs.state.log_history if "loss" in row]

    ours = GRPOTrainer(model=tiny_model_dir, reward_funcs=reward_func, train_dataset=data, generator=Scripted(tokenizer),
                       args=GRPOConfig(preset="trl", output_dir=str(tmp_path / "grpo"), **SETTINGS))
    assert (ours.cfg.loss_aggregation, ours.cfg.use_bias_correction_kl, ours.cfg.lr_scheduler_type) == (
        "rollout_token_mean", True, "linear")
    ours.train()
    got = [row for row in ours.state.log_history if "train_runtime" not in row]  # (the summary repeats the last step)
    # transformers' end-of-training summary: the mean of the steps' losses, both sides
    assert ours.state.log_history[-1]["train_loss"] == pytest.approx(theirs.state.log_history[-1]["train_loss"],
                                                                     abs=1e-4)

    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3]
    for mine, theirs_row in zip(got, want):
        assert mine["loss"] == pytest.approx(theirs_row["loss"], abs=1e-4)  # (TRL rounds its logged loss to 4 places)
        for key in ("grad_norm", "reward", "kl", "entropy", "learning_rate", "clip_ratio/region_mean"):
            assert mine[key] == pytest.approx(theirs_row[key], rel=1e-4, abs=1e-6), (mine["step"], key)
    assert want[-1]["kl"] > 1e-4  # the KL term did count
