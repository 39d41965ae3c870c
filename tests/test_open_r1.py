"""open-r1 unchanged: its seven non-code reward functions (a copy of its rewards.py, tests/fixtures/, Apache-2.0)
run under the default config, where math-verify's signal.alarm needs the main thread; completions are
conversational exactly when the prompts are (open-r1's script makes [system, user] prompts: so does system_prompt
with a chat template); and a recipe in open-r1's form (its keys, local paths) loads and trains with `grpo train`."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.rewards import RewardRunner

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
r1 = pytest.importorskip("open_r1_rewards")  # needs math-verify and latex2sympy2_extended (grpo's math extra)

SEVEN = [r1.accuracy_reward, r1.format_reward, r1.tag_count_reward, r1.reasoning_steps_reward, r1.len_reward,
         r1.get_cosine_scaled_reward(), r1.get_repetition_penalty_reward(ngram_size=3, max_penalty=-1.0)]
SYSTEM = ("A conversation. The assistant thinks, then answers: <think>\n...\n</think>\n<answer>\n...\n</answer>")


def conversational(texts):
    return [[{"role": "assistant", "content": t}] for t in texts]


def test_accuracy_needs_the_main_thread_and_runs_under_the_default_timeout():
    """math-verify's parse arms signal.alarm, which Python refuses off the main thread (where grpo ran synchronous
    rewards before, to bound them); the runner now calls them in the main thread, bounded by a signal of its own."""
    completions = conversational([r"<think>\nx\n</think>\n<answer>\n$\boxed{2}$\n</answer>", r"$\boxed{3}$"])
    errors = []
    thread = threading.Thread(target=lambda: errors.append(_raises(r1.accuracy_reward, completions, ["$2$", "$2$"])))
    thread.start()
    thread.join()
    assert errors == ["ValueError"]  # what a reward thread got
    runner = RewardRunner([("accuracy", r1.accuracy_reward)], timeout_s=GRPOConfig().reward_timeout)
    out = runner([[{"role": "user", "content": "1+1?"}]] * 2, completions, [[1], [1]], {"solution": ["$2$", "$2$"]})
    assert out.per_func["accuracy"] == [1.0, 0.0] and out.timeouts == {"accuracy": 0}


def _raises(func, completions, solution):
    try:
        func(completions, solution)
    except Exception as err:  # noqa: BLE001
        return type(err).__name__
    return None


def test_the_seven_rewards_by_hand():
    good = "<think>\nStep 1: add.\nStep 2: check.\nStep 3: done.\n</think>\n<answer>\n$\\boxed{2}$\n</answer>"
    bad = "the the the the the"
    out = RewardRunner([(f.__name__, f) for f in SEVEN], timeout_s=60.0)(
        [[{"role": "user", "content": "1+1?"}]] * 2, conversational([good, bad]), [[1], [1]],
        {"solution": ["$2$", "$2$"]})
    p = out.per_func
    assert p["accuracy_reward"] == [1.0, 0.0] and p["format_reward"] == [1.0, 0.0]
    assert p["tag_count_reward"] == [1.0, 0.0] and p["reasoning_steps_reward"] == [1.0, 0.0]
    # len_reward (Kimi 1.5): the correct one is the longer: 0.5 - (len - min) / (max - min) = 0.5 - 1 = -0.5; the
    # wrong one is the shortest: min(0, 0.5 - 0) = 0
    assert p["len_reward"] == pytest.approx([-0.5, 0.0])
    assert p["repetition_penalty_reward"][1] == pytest.approx(-1.0 * (1 - 1 / 3))  # 3 trigrams, 1 distinct


@pytest.mark.parametrize("system_prompt, prompt, want", [
    (None, "What is 1+1?", str),  # text stays text (TRL)
    (SYSTEM, "What is 1+1?", list),  # open-r1's make_conversation
    (None, [{"role": "user", "content": "What is 1+1?"}], list),  # messages stay messages
])
def test_completions_are_conversational_exactly_when_the_prompts_are(tiny_chat_model_dir, tmp_path, system_prompt,
                                                                     prompt, want):
    seen = []

    def probe(prompts, completions, **kwargs):
        seen.append((type(prompts[0]), type(completions[0])))
        return [0.0] * len(completions)

    cfg = GRPOConfig(output_dir=str(tmp_path / "run"), num_generations=2, per_device_train_batch_size=2,
                     max_steps=1, max_completion_length=4, report_to=[], system_prompt=system_prompt)
    GRPOTrainer(model=tiny_chat_model_dir, reward_funcs=probe, args=cfg,
                train_dataset=Dataset.from_dict({"prompt": [prompt] * 2})).train()
    assert seen == [(want, want)]


def test_the_seven_rewards_train_under_the_default_config(tiny_chat_model_dir, tmp_path):
    data = Dataset.from_dict({"problem": ["What is 1+1?", "What is 2+2?"] * 2, "solution": ["$2$", "$4$"] * 2})
    cfg = GRPOConfig(output_dir=str(tmp_path / "run"), system_prompt=SYSTEM, num_generations=4,
                     per_device_train_batch_size=4, max_steps=2, max_completion_length=16, report_to=[])
    GRPOTrainer(model=tiny_chat_model_dir, reward_funcs=SEVEN, args=cfg, train_dataset=data).train()
    from grpo.training.tracking import read_metrics

    last = read_metrics(tmp_path / "run")[-1]
    for func in SEVEN:
        assert f"reward/{func.__name__}" in last and last[f"reward/errors/{func.__name__}"] == 0
        assert last[f"reward/timeouts/{func.__name__}"] == 0


RECIPE = """\
# open-r1's recipes/Qwen2.5-1.5B-Instruct/grpo/config_demo.yaml keys, with a local model and dataset
# Model arguments
model_name_or_path: {model}
model_revision: main
torch_dtype: float32
attn_implementation: {attn}

# Data training arguments
dataset_name: {data}
dataset_prompt_column: problem
system_prompt: "{system}"

# GRPO trainer config
bf16: true
use_vllm: {vllm}
do_eval: false
gradient_accumulation_steps: 2
gradient_checkpointing: true
gradient_checkpointing_kwargs:
  use_reentrant: false
hub_model_id: Qwen2.5-1.5B-Open-R1-GRPO
hub_strategy: every_save
learning_rate: 2.0e-05
log_completions: true
log_level: info
logging_first_step: true
logging_steps: 1
logging_strategy: steps
lr_scheduler_type: cosine_with_min_lr
lr_scheduler_kwargs:
  min_lr_rate: 0.1
max_prompt_length: 512
max_completion_length: 16
max_steps: 2
num_generations: 4
num_train_epochs: 1
output_dir: {out}
overwrite_output_dir: true
per_device_eval_batch_size: 4
per_device_train_batch_size: 2
push_to_hub: {push}
report_to:
{report}
reward_funcs:
- accuracy
- format
- tag_count
reward_weights:
- 1.0
- 1.0
- 1.0
save_strategy: "epoch"
save_total_limit: 1
seed: 42
temperature: 0.7
warmup_ratio: 0.1
"""


def test_an_open_r1_recipe_loads_and_trains(tiny_chat_model_dir, tmp_path, capsys):
    from grpo.cli import main

    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"problem": f"What is {i}+1?", "solution": f"${i + 1}$"}) + "\n"
                            for i in range(8)))
    recipe = tmp_path / "config_demo.yaml"
    as_published = dict(model=tiny_chat_model_dir, data=data, out=tmp_path / "published", system=SYSTEM.replace(
        "\n", "\\n"), attn="flash_attention_2", vllm="true", push="true", report="- wandb")
    recipe.write_text(RECIPE.format(**as_published))
    cfg = GRPOConfig.load(recipe)  # every key of the recipe is accepted as open-r1's script reads it
    assert (cfg.prompt_column, cfg.lr_scheduler_kwargs, cfg.log_completions) == ("problem", {"min_lr_rate": 0.1}, True)
    # With this machine's limits (no hub, no vLLM, no flash-attention, no wandb): the rest as published.
    recipe.write_text(RECIPE.format(**{**as_published, "out": tmp_path / "run", "attn": "sdpa", "vllm": "false",
                                       "push": "false", "report": "- tensorboard"}))
    assert main(["train", str(recipe)]) == 0
    from grpo.training.tracking import read_metrics

    logged = read_metrics(tmp_path / "run")
    assert [r["step"] for r in logged] == [1, 2]
    assert {"reward/math_accuracy", "reward/r1_format", "reward/tag_count", "rewards/tag_count/mean"} <= set(logged[0])
    assert (tmp_path / "run" / "final" / "config.json").exists()


def test_the_timeout_still_bounds_a_reward_that_uses_signal_alarm():
    """math-verify arms and cancels SIGALRM inside parse; the runner's own deadline uses another signal, so a reward
    that parses and then hangs is still stopped."""
    import time

    from math_verify import parse

    def parses_then_hangs(completions, **kwargs):
        parse("$1 + 1$")  # signal.alarm(5) ... signal.alarm(0)
        time.sleep(30)
        return [0.0] * len(completions)

    runner = RewardRunner([("hangs", parses_then_hangs)], on_error="zero", timeout_s=0.5)
    started = time.monotonic()
    out = runner(["p"], ["c"], [[1]], {})
    assert out.timeouts == {"hangs": 1} and time.monotonic() - started < 20
