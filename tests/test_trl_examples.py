"""TRL 1.16's documented GRPO examples (docs/source/grpo_trainer.md, the GRPOTrainer and trl.rewards docstrings),
run with only the import line changed: `from trl import GRPOConfig, GRPOTrainer` becomes the line below. Hub names
are the tiny local model and in-memory datasets with the documented columns; an example that passes no `args` runs
as written (in a temporary directory), the others get short runs through `args`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re

import pytest
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer  # was: from trl import GRPOConfig, GRPOTrainer


def rows(run_dir) -> list[dict]:
    from grpo.training.observe.tracking import read_metrics

    return read_metrics(run_dir)


def short(tmp_path, **values) -> GRPOConfig:
    return GRPOConfig(**{"output_dir": str(tmp_path / "out"), "max_steps": 2, "max_completion_length": 12,
                         "report_to": [], **values})


def test_quickstart(tiny_chat_model_dir, tmp_path, monkeypatch):
    """The quick start: one reward callable (TRL's own accuracy_reward, which calls math-verify's parse with
    signal.alarm: it runs in the main thread), conversational prompts with a `solution` column, no args."""
    pytest.importorskip("trl")
    from trl.rewards import accuracy_reward

    monkeypatch.chdir(tmp_path)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "What is 1 + 1?"}]] * 2,
                                 "solution": ["$2$"] * 2})  # (trl-lib/DeepMath-103K's columns)

    trainer = GRPOTrainer(
        model=tiny_chat_model_dir,
        reward_funcs=accuracy_reward,
        train_dataset=dataset,
    )
    trainer.train()

    logged = rows("runs/default")
    assert [r["step"] for r in logged if "reward" in r] == [1, 2]  # two prompts, one per rollout, one epoch
    assert all(r["rewards/accuracy_reward/mean"] == 0.0 for r in logged if "reward" in r)  # (a random tiny model)
    assert (tmp_path / "runs" / "default" / "final" / "config.json").exists()


def test_reward_function_examples(tiny_model_dir, tmp_path):
    """Examples 1.1 (characters), 3 (a `ground_truth` column, standard format) and 5 (async), together."""
    def reward_func(completions, **kwargs):
        """Reward function that assigns higher scores to longer completions (in terms of character count)."""
        return [float(len(completion)) for completion in completions]

    def reference_reward(completions, ground_truth, **kwargs):
        # Regular expression to capture content inside \boxed{}
        matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
        contents = [match.group(1) if match else "" for match in matches]
        # Reward 1 if the content is the same as the ground truth, 0 otherwise
        return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]

    async def async_reward_func(prompts, completions, **kwargs):
        # Simulate an I/O-bound call (e.g., HTTP request, database lookup)
        await asyncio.sleep(0.01)
        # Simple toy reward: 1.0 if the completion is non-empty, else 0.0
        return [1.0 if completion else 0.0 for completion in completions]

    dataset = Dataset.from_dict({"prompt": ["Problem: Solve $2x + 3 = 7$. Solution:"] * 4, "ground_truth": ["2"] * 4})
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=[reward_func, reference_reward, async_reward_func],
                          args=short(tmp_path), train_dataset=dataset)
    trainer.train()
    last = rows(tmp_path / "out")[-1]
    means = [last[f"rewards/{name}/mean"] for name in ("reward_func", "reference_reward", "async_reward_func")]
    assert last["reward"] == pytest.approx(sum(means), rel=1e-5)  # (weights 1; no None)


def test_multi_task_example_with_none(tiny_chat_model_dir, tmp_path, monkeypatch, caplog):
    """Example 4 as documented: its dataset says "code" where coding_reward_func looks for "coding", so the code
    prompts get None from both functions. TRL warns and gives those completions advantage 0; so does grpo (its
    strict behaviour, an error naming the row, is reward_on_all_none: raise)."""
    monkeypatch.chdir(tmp_path)

    def check_math_solution(prompt, completion):  # (left to the reader in TRL's docs)
        return completion.strip().startswith({"What is 2+2?": "4", "What is 3*4?": "12"}[prompt])

    def test_code_solution(prompt, completion):
        return "def " in completion

    # Define a dataset that contains both math and coding problems
    dataset = Dataset.from_list(
        [
            {"prompt": "What is 2+2?", "task": "math"},
            {"prompt": "Write a function that returns the sum of two numbers.", "task": "code"},
            {"prompt": "What is 3*4?", "task": "math"},
            {"prompt": "Write a function that returns the product of two numbers.", "task": "code"},
        ]
    )

    # Math-specific reward function
    def math_reward_func(prompts, completions, task, **kwargs):
        rewards = []
        for prompt, completion, t in zip(prompts, completions, task):
            if t == "math":
                # Calculate math-specific reward
                correct = check_math_solution(prompt, completion)
                reward = 1.0 if correct else -1.0
                rewards.append(reward)
            else:
                # Return None for non-math tasks
                rewards.append(None)
        return rewards

    # Coding-specific reward function
    def coding_reward_func(prompts, completions, task, **kwargs):
        rewards = []
        for prompt, completion, t in zip(prompts, completions, task):
            if t == "coding":
                # Calculate coding-specific reward
                works = test_code_solution(prompt, completion)
                reward = 1.0 if works else -1.0
                rewards.append(reward)
            else:
                # Return None for non-coding tasks
                rewards.append(None)
        return rewards

    # Use both task-specific reward functions
    trainer = GRPOTrainer(
        model=tiny_chat_model_dir,
        reward_funcs=[math_reward_func, coding_reward_func],
        train_dataset=dataset,
    )

    with caplog.at_level(logging.WARNING, logger="grpo.rewards.runner"):
        trainer.train()
    assert any("returned None for row" in r.getMessage() and "advantage 0" in r.getMessage() for r in caplog.records)
    logged = [r for r in rows("runs/default") if "reward" in r]
    assert len(logged) == 4 and all(r["rewards/coding_reward_func/mean"] != r["rewards/coding_reward_func/mean"]
                                    for r in logged)  # NaN: it never applied
    assert all(r["reward/coding_reward_func/none_frac"] == 1.0 for r in logged)


def test_trainer_state_log_metric_and_log_extra(tiny_model_dir, tmp_path):
    """A reward reads `trainer_state` (curriculum on global_step / max_steps) and logs a metric and a column."""
    seen = []

    def curriculum_reward(completions, trainer_state, log_metric, log_extra, **kwargs):
        progress = trainer_state.global_step / trainer_state.max_steps
        seen.append((trainer_state.global_step, trainer_state.max_steps))
        lengths = [len(c) for c in completions]
        log_metric("mean_chars", sum(lengths) / len(lengths))
        log_extra("chars", lengths)
        return [progress * n for n in lengths]

    dataset = Dataset.from_dict({"prompt": ["Tell me a fact.\n"] * 4})
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=curriculum_reward, args=short(tmp_path, max_steps=3,
                                                                                              log_completions=True),
                          train_dataset=dataset)
    trainer.train()
    assert seen == [(0, 3), (1, 3), (2, 3)]
    logged = rows(tmp_path / "out")
    samples = (tmp_path / "out" / "samples" / "step_000001.jsonl").read_text().splitlines()
    samples = [json.loads(line) for line in samples]
    assert len(samples) == 8 and all(s["chars"] == len(s["completion"]) for s in samples)  # the logged column
    assert logged[0]["mean_chars"] == pytest.approx(sum(s["chars"] for s in samples) / 8)  # the logged metric


def test_lora_through_peft_config(tiny_model_dir, tmp_path):
    from peft import LoraConfig

    dataset = Dataset.from_dict({"prompt": ["Tell me a fact.\n"] * 4})
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=lambda completions, **kw: [len(c) for c in completions],
                          args=short(tmp_path, save_steps=1, learning_rate=1e-2), train_dataset=dataset,
                          peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    trainer.train()
    checkpoint = tmp_path / "out" / "checkpoint-1"
    assert (checkpoint / "adapter_config.json").exists() and (checkpoint / "adapter_model.safetensors").exists()
    trained = sum(p.numel() for p in trainer.policy.parameters() if p.requires_grad)
    assert 0 < trained < sum(p.numel() for p in trainer.policy.parameters())


def test_a_callback_reads_the_state_and_stops_training(tiny_model_dir, tmp_path):
    """A transformers TrainerCallback: on_train_begin, on_step_end, on_log (TRL's metric names), on_save,
    on_train_end; setting control.should_training_stop ends the run after that step."""
    from transformers import TrainerCallback

    events = []

    class Recorder(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            events.append(("begin", state.max_steps))

        def on_step_end(self, args, state, control, **kwargs):
            events.append(("step", state.global_step))
            if state.global_step == 2:
                control.should_training_stop = True

        def on_log(self, args, state, control, logs=None, **kwargs):
            events.append(("log", state.global_step, "reward" in logs and "loss" in logs))

        def on_save(self, args, state, control, **kwargs):
            events.append(("save", state.global_step))

        def on_train_end(self, args, state, control, **kwargs):
            events.append(("end", state.global_step, len(state.log_history)))

    dataset = Dataset.from_dict({"prompt": ["Tell me a fact.\n"] * 8})
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=lambda completions, **kw: [len(c) for c in completions],
                          args=short(tmp_path, max_steps=5, save_steps=1), train_dataset=dataset,
                          callbacks=[Recorder])
    trainer.train()
    # the last log is transformers' end-of-training summary (with the last step's metrics under TRL's names)
    assert events == [("begin", 5), ("step", 1), ("log", 1, True), ("save", 1), ("step", 2), ("log", 2, True),
                      ("save", 2), ("log", 2, True), ("end", 2, 3)]
    assert trainer.state.global_step == 2 and trainer.state.log_history[-1]["step"] == 2
