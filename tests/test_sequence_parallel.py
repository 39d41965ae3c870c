"""Ulysses sequence parallelism (grpo.engines.ulysses): two gloo processes, each holding half of a ~4k-token packed
micro-batch, give the one-process packed pass's log-probs, entropies, loss and every parameter's gradient (summed
over the group) to relative 1e-5; and the settings that choose it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.config import ConfigError, GRPOConfig

HERE = Path(__file__).parent


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv-split", "kv-repeated"])
def test_two_processes_match_one(tmp_path, kv_heads):
    """4 attention heads over SP=2: 2 key/value heads split one per process; 1 key/value head is repeated first.
    Measured: log-probs ~1.5e-7, gradients <= 6.1e-7 relative (float32 summation order only); with each slice's
    position ids starting at 0 instead (the rotary error this guards against): log-probs 3.5e-4, gradients 0.14."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)])}
    port = str(29640 + kv_heads)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                             port, str(HERE / "ulysses_driver.py"), str(tmp_path), str(kv_heads), "4000"],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert out["tokens"] >= 3800 and out["scored"] >= 3600  # a few thousand tokens, as the issue asks
        for key in ("logp", "entropy", "loss"):
            assert out[key] < 1e-5, (rank, key, out[key])
        assert len(out["grads"]) == 26  # embeddings, 2 layers x 12 tensors, the final norm (the head is tied)
        worst = max(out["grads"].items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-5, (rank, worst)


def test_settings_and_aliases():
    assert GRPOConfig().sequence_parallel_size == 1
    assert GRPOConfig(ulysses_sequence_parallel_size=2).sequence_parallel_size == 2  # verl's name
    # accelerate's ParallelismConfig (TRL's parallelism_config): sp_size is Ulysses (sp_backend deepspeed)
    assert GRPOConfig(parallelism_config={"sp_size": 4, "sp_backend": "deepspeed"}).sequence_parallel_size == 4
    with pytest.raises(ConfigError, match="parallelism_config"):  # cp_size: ring attention, not built
        GRPOConfig(parallelism_config={"cp_size": 2})
    with pytest.raises(ConfigError, match="both 'parallelism_config.sp_size' and 'sequence_parallel_size'"):
        GRPOConfig(parallelism_config={"sp_size": 2}, sequence_parallel_size=4)
    with pytest.raises(ConfigError, match="sequence_parallel_size: must be >= 1"):
        GRPOConfig(sequence_parallel_size=0)
    with pytest.raises(ConfigError, match="use_remove_padding: true"):
        GRPOConfig(sequence_parallel_size=2, use_remove_padding=False)


def test_run_time_checks():
    from transformers import Qwen2Config

    from grpo.engines.ulysses import check_heads
    from grpo.training.setup import check_sequence_parallel

    with pytest.raises(ConfigError, match="3 processes do not split into groups of 2"):
        check_sequence_parallel(GRPOConfig(sequence_parallel_size=2), 3)
    with pytest.raises(ConfigError, match="does not yet lay micro-batches out"):  # until the trainer is wired
        check_sequence_parallel(GRPOConfig(sequence_parallel_size=2), 4)
    check_sequence_parallel(GRPOConfig(), 3)
    config = Qwen2Config(num_attention_heads=4, num_key_value_heads=2, hidden_size=32)
    check_heads(config, 2)
    check_heads(config, 4)  # key/value heads repeated to 4
    with pytest.raises(ValueError, match="4 attention heads do not split"):
        check_heads(config, 3)
    with pytest.raises(ValueError, match="6 key/value heads neither split"):
        check_heads(Qwen2Config(num_attention_heads=12, num_key_value_heads=6, hidden_size=48), 4)
