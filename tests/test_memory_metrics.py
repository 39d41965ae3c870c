"""`memory/peak_gib`: each optimizer step's peak accelerator memory (grpo.training.observe.memory), from CUDA's allocator
counters reset at the step's start; absent on the CPU. The CUDA counters are faked here (no GPU in CI)."""

from __future__ import annotations

import json

import pytest
import torch

from grpo import GRPOConfig, GRPOTrainer
from grpo.training.observe import memory
from grpo.training import trainer as trainer_module
from rewards_for_tests import count_a

GIB = 2**30


class FakeAllocator:
    """CUDA's counters as torch keeps them: bytes in use now, and the most in use since the last reset (a reset
    sets the peak to what is in use then)."""

    def __init__(self, in_use: int, peak: int):
        self.in_use, self.peak = in_use, peak
        self.resets = 0

    def reset_peak_memory_stats(self, device=None):
        self.peak, self.resets = self.in_use, self.resets + 1

    def max_memory_allocated(self, device=None):
        return self.peak

    def transient(self, size: int):  # a buffer allocated and freed again
        self.peak = max(self.peak, self.in_use + size)


@pytest.fixture
def fake_cuda(monkeypatch):
    """The allocator above behind torch.cuda's two calls, and the trainer's device taken as cuda:0 by the memory
    functions (the model itself stays on the CPU)."""
    fake = FakeAllocator(in_use=2 * GIB, peak=10 * GIB)  # (a peak left over from before the run: reset away)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake.reset_peak_memory_stats)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", fake.max_memory_allocated)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(trainer_module, "reset_peak_memory", lambda device: memory.reset_peak_memory(cuda))
    monkeypatch.setattr(trainer_module, "peak_memory_metrics", lambda device: memory.peak_memory_metrics(cuda))
    return fake


def tiny_trainer(model_dir, tmp_path, steps: int) -> GRPOTrainer:
    cfg = GRPOConfig(output_dir=str(tmp_path / "run"), task=None, num_generations=4, prompts_per_step=2,
                     max_completion_length=4, max_steps=steps, save_steps=0, report_to=[], log_completions_steps=0,
                     task_eval_size=0, seed=0, use_cpu=True)
    return GRPOTrainer(model=model_dir, reward_funcs=[count_a], args=cfg,
                       train_dataset=[{"prompt": f"q{i}\n"} for i in range(8)])


def test_each_step_logs_its_own_peak_in_gib(tiny_model_dir, tmp_path, fake_cuda):
    t = tiny_trainer(tiny_model_dir, tmp_path, steps=2)
    generate, sizes = t.generator.generate, iter([1.5 * GIB, 0.5 * GIB])

    def generate_with_a_buffer(*args, **kwargs):  # step 1's rollout holds 1.5 GiB more for a moment, step 2's 0.5
        fake_cuda.transient(int(next(sizes)))
        return generate(*args, **kwargs)

    t.generator.generate = generate_with_a_buffer
    t.train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    peaks = [r["memory/peak_gib"] for r in rows if "memory/peak_gib" in r]
    # 2 GiB in use + the step's buffer; without the reset at each step's start: 10 and 10 (the old peak), and with
    # the reset after the rollout: 2 and 2.
    assert peaks == [3.5, 2.5] and fake_cuda.resets == 2


def test_no_peak_is_logged_on_the_cpu(tiny_model_dir, tmp_path):
    metrics = tiny_trainer(tiny_model_dir, tmp_path, steps=1).train_step()
    assert "time/step" in metrics and not any(k.startswith("memory/") for k in metrics)
    assert memory.peak_memory_metrics(torch.device("cpu")) == {}
