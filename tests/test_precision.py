"""Precision on the training side (issue 29): what AdamW does to bf16 weights at a GPU recipe's learning rate, and
the start-up warning about it."""

from __future__ import annotations

import warnings

import pytest
import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer


def _length(completions, **kwargs):
    """Varies between a random model's completions, so every group has advantages and the step a gradient."""
    return [float(len(c)) for c in completions]


def _one_step(model_dir, out, **overrides):
    """(share of the trainable weights one optimizer step changed, the warnings the trainer's start gave)."""
    values = dict(output_dir=str(out), task=None, num_generations=4, prompts_per_step=2, max_completion_length=8,
                  learning_rate=1e-6, beta=0.0, max_steps=1, save_steps=0, report_to=[], log_completions_steps=0,
                  seed=0, per_device_train_batch_size=8, temperature=1.5, disable_tqdm=True)
    values.update(overrides)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = GRPOTrainer(model=model_dir, reward_funcs=[_length], args=GRPOConfig(**values),
                              train_dataset=Dataset.from_dict({"prompt": [f"q{i}\n" for i in range(8)]}))
    before = {k: p.detach().clone() for k, p in trainer.policy.named_parameters()}
    trainer.train()
    after = dict(trainer.policy.named_parameters())
    changed = sum(int((after[k].detach() != v).sum()) for k, v in before.items())
    return changed / sum(v.numel() for v in before.values()), [str(w.message) for w in caught]


def test_adamw_on_bf16_weights_at_lr_1e_6_rounds_the_step_away_and_float32_weights_under_autocast_take_it(
        tiny_model_dir, tmp_path):
    """The GPU recipe's learning rate on the tiny model's std-0.02 weights: half a bf16 ulp at |w| = 0.02 is 6e-5,
    far above Adam's first step of about lr = 1e-6, so bf16 weights stay almost all as they were; float32 weights
    under bf16 autocast (the recipe now) take the step nearly everywhere (E1 of the GPU review: 0.43% against
    98.6% on a larger model)."""
    bf16_weights, said = _one_step(tiny_model_dir, tmp_path / "bf16", torch_dtype="bfloat16")
    fp32_weights, quiet = _one_step(tiny_model_dir, tmp_path / "fp32", torch_dtype="float32", bf16=True)
    assert bf16_weights < 0.05 and fp32_weights > 0.9, (bf16_weights, fp32_weights)
    warning = [m for m in said if m.startswith("torch_dtype: bfloat16 trainable weights")]
    assert len(warning) == 1 and "learning_rate 1e-06" in warning[0] and "bf16: true" in warning[0]
    share = float(warning[0].split("leaves ")[1].split("%")[0]) / 100  # the warning's estimate of what rounds away
    assert share > 0.95 and not any("master copy" in m for m in quiet)


def test_the_rounded_away_share_is_of_low_precision_weights_only():
    from grpo.training.setup import rounded_away

    # bf16 keeps 8 significant bits: at 1.0 the ulp is 2^-7, so +1e-3 rounds back and +1e-2 does not (2^-7 / 2 is
    # 3.9e-3); at 2^-10 the ulp is 2^-17 = 7.6e-6, so +1e-3 changes it.
    w = torch.tensor([1.0, 1.0, 2.0 ** -10, -1.0], dtype=torch.bfloat16)
    assert rounded_away([w], 1e-3) == pytest.approx(3 / 4)
    assert rounded_away([w], 1e-2) == 0.0
    assert rounded_away([torch.ones(4)], 1e-9) == 0.0  # float32: nothing to warn about
