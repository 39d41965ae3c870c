"""Server mode (`grpo vllm-serve`, `vllm_mode: server`): a server on 127.0.0.1 serves two trainer processes; the main
process pushes the policy's weights into it after each optimizer step, and the server then samples from them.

Skipped where vLLM is not importable: `bash scripts/vllm_env.sh`, then `.venv-vllm/bin/python -m pytest -q
tests/test_vllm_server.py`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from conftest import build_tiny_model
from grpo.engines.base import SamplingParams
from grpo.engines.sampling import TransformersSampler
from test_vllm import needs_vllm

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(tmp_path):
    model = build_tiny_model(tmp_path / "model", hidden=128)  # head size 32: vLLM's CPU attention needs >= 32
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "grpo.cli", "vllm-serve", "--model", str(model), "--host",
                             "127.0.0.1", "--port", str(port), "--dtype", "float32", "--gpu-memory-utilization", "0.1",
                             "--set", "enforce_eager=true", "--set", "kv_cache_memory_bytes=33554432"],
                            env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "server.log", "w"))
    try:
        yield model, port
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@needs_vllm
def test_a_server_serves_two_trainer_processes_and_takes_their_weights(server, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.engines.vllm_server import VLLMServerClient

    model_dir, port = server
    tok = AutoTokenizer.from_pretrained(model_dir)
    client = VLLMServerClient(f"http://127.0.0.1:{port}", [tok.eos_token_id], timeout=180)
    prompts = [tok(f"q{i}\n")["input_ids"] for i in range(4)]
    greedy = SamplingParams(8, top_k=1)
    before = client.generate(prompts, greedy, [0, 1, 2, 3]).ids

    from test_distributed import job, run

    env = job(tmp_path, model_dir)  # test_distributed's recipe and data (16 prompts, 4 x 8 completions a step)
    run(["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "grpo.cli"],
        tmp_path / "run", env, overrides=[
            f"eval_dataset_name={tmp_path / 'data.jsonl'}", "eval_steps=0", "max_steps=2", "learning_rate=2e-2",
            "beta=0", "use_vllm=true", "vllm_mode=server", "vllm_server_host=127.0.0.1",
            f"vllm_server_port={port}", "vllm_server_timeout=120"])
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if "reward/total" in r]) == 2 and "eval/accuracy" in rows[-1]

    # Pushed before the second rollout and before the final eval, by the main process only
    assert client._call("/health")["weights_version"] == 2
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    ours = TransformersSampler(trained, tok.pad_token_id, [tok.eos_token_id]).generate(prompts, greedy, [0, 1, 2, 3])
    after = client.generate(prompts, greedy, [0, 1, 2, 3]).ids
    assert after == ours.ids and after != before


def test_no_server_is_a_clear_error(tmp_path):
    """(The client needs no vLLM: this runs in every environment.)"""
    from grpo.config import ConfigError, GRPOConfig
    from grpo.engines.select import make_vllm

    cfg = GRPOConfig(use_vllm=True, vllm_mode="server", vllm_server_host="127.0.0.1", vllm_server_port=free_port(),
                     vllm_server_timeout=1)

    class OneProcess:
        is_main_process, num_processes = True, 1

    class Tok:
        eos_token_id = 0

    with pytest.raises(ConfigError, match="vllm_mode: server: no vLLM server answered at http://127.0.0.1:.* "
                                          "start one with `grpo vllm-serve --model PATH`"):
        make_vllm(cfg, None, Tok(), OneProcess())
