"""The seed tutorial's recipes (seed 004: config_grpo_tutorial.yaml, config_grpo_exercise.yaml) and the GRPOConfig
call of seed 000 run as written, with the model and dataset paths pointed at local files.

Only the run length is cut (max_steps, max_completion_length) so the test takes seconds; every other key is the
seed's own.
"""

from __future__ import annotations

import json

import pytest
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.cli import main

TUTORIAL = """\
model_name_or_path: {model}
dataset_name: {data}
num_train_epochs: 1
max_steps: 500

# GRPO-specific settings
num_generations: 16  # Generate 16 per prompt
temperature: 0.6
top_p: 0.95
max_completion_length: 2048

# Reward configuration
reward_funcs:
  - accuracy
  - format

reward_weights:
  - 1.0
  - 0.1

# Stability settings
learning_rate: 1e-6
clip_range: 0.2
kl_penalty: 0.01

output_dir: {out}
"""

EXERCISE = """\
model_name_or_path: {model}
dataset_name: {data}
num_train_epochs: 1
max_steps: 50

num_generations: 8
temperature: 0.6

reward_funcs:
  - accuracy
  - format

reward_weights:
  - 1.0
  - 0.1

learning_rate: 1e-6
output_dir: {out}
"""


@pytest.fixture(scope="module")
def math_100_samples(tmp_path_factory):
    """Stands in for the seed's `load_dataset('open-r1/OpenR1-Math-220k', split='train[:100]').save_to_disk(...)`:
    the same column names (problem, solution), saved the same way."""
    path = tmp_path_factory.mktemp("data") / "math_100_samples"
    rows = [{"problem": f"what is {i} + {i}\n", "solution": f"the answer is \\boxed{{{2 * i}}}"} for i in range(100)]
    Dataset.from_list(rows).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("recipe", [TUTORIAL, EXERCISE], ids=["tutorial", "exercise"])
def test_seed_004_recipes_run(tmp_path, tiny_model_dir, math_100_samples, recipe):
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe.format(model=tiny_model_dir, data=math_100_samples, out=tmp_path / "out"))
    code = main(["train", str(path), "max_steps=2", "max_completion_length=24", "report_to=[]"])
    assert code == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/total" in r] == [1, 2]
    assert "reward/math_accuracy" in rows[-1] and "reward/r1_format" in rows[-1]  # (open-r1's accuracy and format)
    assert (tmp_path / "out" / "final" / "config.json").exists()


def test_seed_000_grpoconfig_call_runs(tmp_path, tiny_model_dir, math_100_samples):
    from datasets import load_from_disk

    training_args = GRPOConfig(
        output_dir=str(tmp_path / "qwen-r1-tiny"),
        learning_rate=5e-7,
        lr_scheduler_type="cosine",
        logging_steps=10,
        max_steps=2,  # seed: 100
        per_device_train_batch_size=1,
        gradient_accumulation_steps=1,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        bf16=True,
        # GRPO specific parameters
        max_prompt_length=256,
        max_completion_length=32,  # seed: 1024
        num_generations=2,
        beta=0.001,
        report_to=[],
    )
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=["math_accuracy", "think_format"], args=training_args,
                          train_dataset=load_from_disk(str(math_100_samples)))
    assert (trainer.B, trainer.G) == (1, 2)  # 1 completion per micro-batch, one group of 2 per step
    trainer.train()
    assert (tmp_path / "qwen-r1-tiny" / "final" / "model.safetensors").exists()
