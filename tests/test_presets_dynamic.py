"""Presets set the right knobs and yield to the recipe; DAPO dynamic sampling drops zero-variance groups and refills;
overlong shaping adds DAPO's soft punishment."""

from __future__ import annotations

import pytest
import torch
import yaml
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.config import ConfigError
from grpo.engines.base import ScriptedGenerator


@pytest.mark.parametrize("preset, expected", [
    ("grpo", {"beta": 0.04, "scale_rewards": "group", "loss_aggregation": "sequence_mean", "epsilon_high": 0.2}),
    ("dr_grpo", {"beta": 0.0, "scale_rewards": "none", "loss_aggregation": "constant"}),
    ("dapo", {"beta": 0.0, "epsilon_high": 0.28, "loss_aggregation": "token_mean", "dynamic_sampling": True,
              "overlong_buffer_ratio": 0.2}),
    ("gspo", {"beta": 0.0, "importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4}),
])
def test_presets_set_their_knobs(preset, expected):
    for cfg in (GRPOConfig.load(None, [f"preset={preset}"]), GRPOConfig(preset=preset)):
        assert {k: getattr(cfg, k) for k in expected} == expected


def test_recipe_keys_win_over_the_preset(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("preset: dapo\nbeta: 0.04\n")  # 0.04 is also the library default: it must still win
    cfg = GRPOConfig.load(recipe, ["epsilon_high=0.3"])
    assert (cfg.beta, cfg.epsilon_high, cfg.loss_aggregation) == (0.04, 0.3, "token_mean")
    cfg.save(tmp_path / "resolved.yaml")  # the resolved config shows what the preset set
    assert yaml.safe_load((tmp_path / "resolved.yaml").read_text())["dynamic_sampling"] is True
    with pytest.raises(ConfigError, match="preset: unknown value 'ppo'; choose one of grpo, dr_grpo, dapo, gspo"):
        GRPOConfig.load(None, ["preset=ppo"])


def scripted(tokenizer):
    """Completions 'a', 'b', 'c', 'd' by row seed; prompts starting with 'same' get the same reward for all."""
    def complete(prompt_ids, rng):
        letter = "abcd"[int(torch.randint(0, 4, (1,), generator=rng))]
        return tokenizer(letter, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return ScriptedGenerator(complete, [tokenizer.eos_token_id])


def reward(prompts, completions, **kwargs):
    return [1.0 if p.startswith("same") else float(c == "a") for p, c in zip(prompts, completions)]


def run(tiny_model_dir, tmp_path, prompts, **overrides):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = GRPOConfig(output_dir=str(tmp_path / "run"), task=None, num_generations=4, prompts_per_step=2,
                     max_completion_length=4, learning_rate=1e-3, beta=0.0, max_steps=1, save_steps=0,
                     report_to=[], log_completions_steps=0, dynamic_sampling=True, max_generation_rounds=3,
                     **overrides)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=[reward], args=cfg,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), generator=scripted(tok))
    batch = trainer.rollout()
    return trainer, batch


def test_dynamic_sampling_drops_flat_groups_and_refills(tiny_model_dir, tmp_path):
    # Half the prompts give every completion reward 1: their groups carry no signal and must be dropped.
    prompts = ["same 1", "vary 1", "same 2", "vary 2", "same 3", "vary 3", "same 4", "vary 4"]
    trainer, batch = run(tiny_model_dir, tmp_path, prompts)
    m = batch.metrics
    assert m["sampling/dropped_groups"] >= 1 and m["sampling/generation_rounds"] >= 2
    assert m["sampling/kept_groups"] == 2 and batch.input_ids.shape[0] == 8
    assert all(s["prompt"].startswith("vary") for s in batch.samples)
    assert m["groups/zero_std_frac"] == 0.0


def test_dynamic_sampling_gives_up_after_max_rounds(tiny_model_dir, tmp_path):
    trainer, batch = run(tiny_model_dir, tmp_path, ["same 1", "same 2"])
    assert batch.metrics["sampling/generation_rounds"] == 3 and batch.metrics["sampling/kept_groups"] == 0
    assert batch.advantages.abs().max() == 0  # it trains on the last round, which teaches nothing
    trainer.update(batch)


def test_overlong_shaping_adds_the_soft_punishment(tiny_model_dir, tmp_path):
    trainer, batch = run(tiny_model_dir, tmp_path, ["vary 1", "vary 2"], overlong_buffer_ratio=0.5)
    # max_completion_length 4, buffer 2: a completion of 2 tokens ('x' + EOS) is at the start of the buffer: 0.
    assert "soft_overlong" in trainer.reward_names and batch.metrics["reward/soft_overlong"] == 0.0
