"""torch's thread count when num_threads is null (grpo/training/setup/threads.py): one thread for a small model, else the
usable CPUs over the run's processes on the machine; OMP_NUM_THREADS or num_threads, when given, as given."""

from __future__ import annotations

import types

import pytest
import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.training.setup import threads
from rewards_for_tests import count_a


@pytest.fixture()
def torch_threads(monkeypatch):
    """torch at 2 threads, as its default is on a 2-core machine, without OMP_NUM_THREADS; put back after."""
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_the_library_default_gives_a_small_model_one_thread(tiny_model_dir, tmp_path, torch_threads):
    """The README's Python example (GRPOConfig without num_threads) ran torch's default, a thread per core: 5 min
    18 s for 50 steps on 2 cores against 14 s with num_threads=1 (issue 38)."""
    cfg = GRPOConfig(output_dir=str(tmp_path / "run"), task=None, num_generations=2, prompts_per_step=2,
                     max_completion_length=4, max_steps=1, report_to=[])
    GRPOTrainer(model=tiny_model_dir, reward_funcs=[count_a], args=cfg,
                train_dataset=Dataset.from_dict({"prompt": ["q\n"] * 4}))
    assert torch.get_num_threads() == 1


def large_model(layers: int = 1):
    """A module of 2**23 + 2**11 float32 parameters (32 MiB and 8 KiB, just over SMALL_LAYER_BYTES) in `layers`
    layers."""
    model = torch.nn.Linear(2**12, 2**11)
    model.config = types.SimpleNamespace(num_hidden_layers=layers)
    return model


def test_a_larger_model_shares_the_usable_cpus_among_the_runs_processes(monkeypatch, torch_threads):
    monkeypatch.setattr(threads, "usable_cpus", lambda: 8)
    assert threads.layer_bytes(large_model()) == 4 * (2**23 + 2**11) > threads.SMALL_LAYER_BYTES
    assert threads.set_threads(None, large_model()) == 8
    assert threads.set_threads(None, large_model(layers=2)) == 1  # (16 MiB a layer: small)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # (two ranks on this machine, torchrun's or accelerate's variable)
    assert threads.set_threads(None, large_model()) == 4
    assert threads.set_threads(None, large_model(), max_staleness=1) == 2  # (each rank's rollout worker: a core)
    monkeypatch.setattr(threads, "usable_cpus", lambda: 3)
    assert threads.set_threads(None, large_model(), max_staleness=1) == 1  # (never 0)


def test_omp_num_threads_or_num_threads_as_given(monkeypatch, torch_threads):
    monkeypatch.setattr(threads, "usable_cpus", lambda: 8)
    assert threads.set_threads(3, large_model()) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)
    assert threads.set_threads(None, large_model()) == 2
