"""Process supervision end to end: step rewards from the arithmetic step checker reach the loss as per-token
advantages (DeepSeekMath 4.1.3), and training raises the share of correct steps."""

from __future__ import annotations

import json

import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.engines.base import ScriptedGenerator

GOOD = "2 * 3 = 6\n6 + 1 = 7\n</think>\n<answer>7</answer>"
FIRST_WRONG = "2 * 3 = 5\n5 + 1 = 6\n</think>\n<answer>6</answer>"
SECOND_WRONG = "2 * 3 = 6\n6 + 1 = 8\n</think>\n<answer>8</answer>"


def test_step_rewards_become_token_advantages(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    order = [GOOD, FIRST_WRONG, SECOND_WRONG, GOOD]
    calls = []

    def complete(prompt_ids, rng):  # rows come in order: group 0 gets GOOD, FIRST_WRONG, SECOND_WRONG, GOOD
        text = order[len(calls) % 4]
        calls.append(text)
        return tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    cfg = GRPOConfig(output_dir=str(tmp_path / "run"), task=None, num_generations=4, prompts_per_step=2,
                     max_completion_length=64, learning_rate=1e-3, beta=0.0, max_steps=2, save_steps=0,
                     report_to=[], log_completions_steps=0, step_reward_funcs=["arithmetic_steps"],
                     outcome_weight=0.0, process_weight=1.0)
    data = Dataset.from_dict({"prompt": ["Calculate 2 * 3 + 1\n"] * 4, "answer": ["7"] * 4})
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=["math_accuracy"], args=cfg, train_dataset=data,
                          generator=ScriptedGenerator(complete, [tok.eos_token_id]))
    batch = trainer.rollout()
    adv = batch.advantages
    assert adv.shape == batch.completion_mask.shape  # (N, T): per-token advantages
    # Step scores of group 0: GOOD [1, 1], FIRST_WRONG [0, 1] ("5 + 1 = 6" is right given its line),
    # SECOND_WRONG [1, 0], GOOD [1, 1]. All 8 together: mean 0.75, unbiased std sqrt(1.5 / 7) = 0.46291;
    # normalized with eps 1e-4: right = 0.25 / 0.46301 = 0.53995, wrong = -0.75 / 0.46301 = -1.61984.
    # A token's advantage sums the normalized rewards of the steps ending at or after it. The character tokenizer
    # makes token index = character index: step 1 is line 1 (chars 0-8), step 2 is line 2 (chars 10-18).
    right, wrong = 0.53995, -1.61984
    expected = {  # text: (advantage at token 0, at token 14, at the last completion token)
        GOOD: (2 * right, right, 0.0),
        FIRST_WRONG: (wrong + right, right, 0.0),
        SECOND_WRONG: (right + wrong, wrong, 0.0),
    }
    for row, text in enumerate(calls[:4]):
        n = int(batch.completion_mask[row].sum())
        want = expected[text]
        got = (adv[row, 0].item(), adv[row, 14].item(), adv[row, n - 1].item())
        assert all(abs(g - w) < 1e-3 for g, w in zip(got, want)), (text, got, want)
    # Group 1 repeats the same four completions, so its advantages equal group 0's.
    assert torch.allclose(adv[4:8], adv[0:4])
    assert batch.metrics["reward/step/first_wrong_found_frac"] == 0.5  # FIRST_WRONG and SECOND_WRONG of 4
    trainer.update(batch)


def test_process_supervision_logs_step_metrics(tiny_model_dir, tmp_path):
    """With the real sampler, outcome and step rewards mixed: the run completes and logs step metrics each step."""
    cfg = GRPOConfig(output_dir=str(tmp_path / "run"), task=None, num_generations=4, prompts_per_step=2,
                     max_completion_length=16, learning_rate=1e-3, beta=0.0, max_steps=3, save_steps=0,
                     report_to=[], log_completions_steps=0, step_reward_funcs=["arithmetic_steps"],
                     outcome_weight=0.5, process_weight=1.0)
    data = Dataset.from_dict({"prompt": ["1 + 1 = "] * 4, "answer": ["2"] * 4})
    GRPOTrainer(model=tiny_model_dir, reward_funcs=["math_accuracy"], args=cfg, train_dataset=data).train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all("reward/step/count" in r for r in rows if "reward/total" in r)
