"""GRPO with vLLM rollouts (`use_vllm`), on vLLM's CPU build: the run learns, the engine follows the policy's
weights step by step, the importance-sampling correction reaches the loss, and the default recipe trains.

Skipped where vLLM is not importable: `bash scripts/vllm_env.sh`, then
`.venv-vllm/bin/python -m pytest -q tests/test_vllm.py tests/test_vllm_training.py`.
"""

from __future__ import annotations

import json
import statistics

import pytest
from datasets import Dataset

from conftest import build_tiny_model
from grpo import GRPOConfig, GRPOTrainer
from grpo.engines.base import SamplingParams
from grpo.engines.sampling import TransformersSampler
from rewards_for_tests import count_a
from test_vllm import needs_vllm

# A small KV cache and no torch.compile warm-up: the engine starts in seconds (on the CPU build
# gpu_memory_utilization is the fraction of the machine's RAM that must be free at start).
VLLM = {"use_vllm": True, "vllm_gpu_memory_utilization": 0.1,
        "vllm_engine_kwargs": {"enforce_eager": True, "kv_cache_memory_bytes": 32 << 20}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # hidden 128 over 4 heads: vLLM's CPU attention has kernels for head sizes of 32 and up, not the fixture's 8
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-vllm"), hidden=128))


def config(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path / "run"), task=None, num_generations=8, prompts_per_step=4,
                  max_completion_length=8, learning_rate=2e-2, beta=0.0, max_steps=20, save_steps=0, report_to=[],
                  log_completions_steps=0, seed=0, **VLLM)
    values.update(overrides)
    return GRPOConfig(**values)


def prompts():
    return Dataset.from_dict({"prompt": [f"q{i % 10}\n" for i in range(16)]})


def metrics_of(run_dir):
    return [row for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "reward/total" in row]


@needs_vllm
def test_reward_rises_with_vllm_rollouts_and_the_engine_follows_the_policy(model_dir, tmp_path):
    t = GRPOTrainer(model=model_dir, reward_funcs=[count_a], args=config(tmp_path), train_dataset=prompts())
    assert type(t.generator).__name__ == "VLLMEngine"
    t.train()
    rows = metrics_of(tmp_path / "run")
    r = [row["reward/total"] for row in rows]
    first, last = sum(r[:3]) / 3, sum(r[-3:]) / 3
    assert first < 0.15 and last > first + 0.3, (r[:3], r[-3:])
    # vLLM sampled from the trainer's weights at every step: the importance ratio pi_old / pi_vllm is 1 up to
    # float32 rounding, and so is the engine-vs-trainer KL 0
    for row in rows:
        assert abs(row["sampling/importance_ratio_mean"] - 1) < 1e-3 and abs(row["sampling/importance_engine_kl"]) < 1e-4
        assert row["sampling/importance_bounded_frac"] == 0.0
    # after the last optimizer step the engine holds the trained weights: greedy completions equal our sampler's
    t.rollouts.ready_engine()
    ids = [t.tokenizer(f"q{i}\n")["input_ids"] for i in range(4)]
    greedy = SamplingParams(8, top_k=1)
    ours = TransformersSampler(t.policy, t.tokenizer.pad_token_id, [t.tokenizer.eos_token_id])
    assert t.generator.generate(ids, greedy, [0, 1, 2, 3]).ids == ours.generate(ids, greedy, [0, 1, 2, 3]).ids


@needs_vllm
@pytest.mark.parametrize("correction", [True, False])
def test_the_importance_weights_reach_the_loss(model_dir, tmp_path, correction):
    """token_mask with clip_max 0.5: every ratio (1 up to rounding) is masked, so the surrogate has no gradient and,
    with beta 0, the weights do not move; with the correction off the same run moves them."""
    cfg = config(tmp_path, max_steps=1, vllm_importance_sampling_correction=correction,
                 vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=0.5)
    t = GRPOTrainer(model=model_dir, reward_funcs=[count_a], args=cfg, train_dataset=prompts(),
                    )
    before = {k: v.clone() for k, v in t.policy.state_dict().items()}
    metrics = t.train_step()
    moved = max((t.policy.state_dict()[k] - before[k]).abs().max().item() for k in before)
    if correction:
        assert metrics["sampling/importance_bounded_frac"] == 1.0 and metrics["train/grad_norm"] == 0.0
        assert moved == 0.0
    else:
        assert "sampling/importance_bounded_frac" not in metrics and moved > 1e-3


@needs_vllm
def test_the_default_recipe_trains_30_steps_with_vllm(tmp_path):
    """`grpo train max_steps=30 use_vllm=true ...`: the default job's reward rises with vLLM rollouts as it does with
    the project's own sampler (there 0.54 -> 0.59 from the first ten steps to the third ten)."""
    from grpo.cli import main

    code = main(["train", f"output_dir={tmp_path / 'run'}", "max_steps=30", "eval_steps=0", "task_eval_size=0",
                 "report_to=[]", "save_steps=0", "use_vllm=true", "vllm_gpu_memory_utilization=0.1",
                 "vllm_engine_kwargs={enforce_eager: true, kv_cache_memory_bytes: 33554432}"])
    assert code == 0
    r = [row["reward/total"] for row in metrics_of(tmp_path / "run")]
    assert len(r) == 30 and statistics.mean(r[20:]) > statistics.mean(r[:10]), r


@needs_vllm
def test_two_processes_each_with_a_colocated_engine_train_as_one(model_dir, tmp_path):
    """Under torch.distributed (2 processes, gloo) each process has its own vLLM engine for its share of the rows;
    sampling seeds belong to rows, so both layouts sample the same completions and reach the same weights."""
    from safetensors.torch import load_file

    from test_distributed import free_port, job, run

    env = job(tmp_path, model_dir)  # test_distributed's recipe: 3 steps of 4 x 8 completions, beta 0.04, lr 1e-2
    vllm = ["use_vllm=true", "vllm_gpu_memory_utilization=0.05",
            "vllm_engine_kwargs={enforce_eager: true, kv_cache_memory_bytes: 33554432}"]
    run(["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "grpo.cli"],
        tmp_path / "two", env, overrides=vllm)
    run(["-m", "grpo.cli"], tmp_path / "one", env, overrides=vllm)
    one, two = (load_file(str(tmp_path / d / "final" / "model.safetensors")) for d in ("one", "two"))
    # Same completions and gradients up to float summation order (all-reduce against one batch). Adam moves a
    # weight whose gradient is ~0 by up to lr whichever its sign, so order can flip a handful of those: measured 5
    # of 32,768 in one matrix off by up to 2.5e-4 (3 steps at lr 1e-2 move weights ~3e-2), every other one < 1e-5.
    off = sum(int(((one[k] - two[k]).abs() > 1e-5).sum()) for k in one)
    assert off < 1e-3 * sum(t.numel() for t in one.values()), off
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-3
    rewards = [[json.loads(line)["reward/total"] for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
               for d in ("one", "two")]
    assert rewards[0] == rewards[1]
