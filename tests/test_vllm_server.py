"""Server mode (`grpo vllm-serve`, `vllm_mode: server`): a server on 127.0.0.1 serves two trainer processes with one
request a step, as it serves one; the main process pushes the policy's weights into it in buckets, over a gloo group
or a streamed POST, and the server then samples from them.

Skipped where vLLM is not importable: `bash scripts/vllm_env.sh`, then `.venv-vllm/bin/python -m pytest -q
tests/test_vllm_server.py`.
"""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def serving(model, log, process: list | None = None):
    """`grpo vllm-serve` of `model` on a free local port (yielded; its log to `log`), stopped after; `process`, a
    list, gets its Popen (a test that kills it)."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "grpo.cli", "vllm-serve", "--model", str(model), "--host",
                             "127.0.0.1", "--port", str(port), "--dtype", "float32", "--gpu-memory-utilization", "0.1",
                             "--set", "enforce_eager=true", "--set", "kv_cache_memory_bytes=33554432"],
                            env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    if process is not None:
        process.append(proc)
    try:
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture
def server(tmp_path):
    model = build_tiny_model(tmp_path / "model", hidden=128)  # head size 32: vLLM's CPU attention needs >= 32
    with serving(model, tmp_path / "server.log") as port:
        yield model, port


@needs_vllm
def test_a_server_serves_two_trainer_processes_and_takes_their_weights(server, tmp_path):
    """Two trainer processes against one server: the main process sends one generate request a step with both
    processes' rows and pushes the weights over a gloo group; the run samples the same completions and reaches the
    same weights as one process against the same server."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.engines.vllm_server import VLLMServerClient

    model_dir, port = server
    tok = AutoTokenizer.from_pretrained(model_dir)
    client = VLLMServerClient(f"http://127.0.0.1:{port}", [tok.eos_token_id], timeout=180, push=False)
    prompts = [tok(f"q{i}\n")["input_ids"] for i in range(4)]
    greedy = SamplingParams(8, top_k=1)
    before = client.generate(prompts, greedy, [0, 1, 2, 3]).ids

    from test_distributed import job, run

    env = job(tmp_path, model_dir)  # test_distributed's recipe and data (16 prompts, 4 x 8 completions a step)
    overrides = [f"eval_dataset_name={tmp_path / 'data.jsonl'}", "eval_steps=0", "max_steps=2",
                 "learning_rate=2e-2", "beta=0", "use_vllm=true", "vllm_mode=server", "vllm_server_host=127.0.0.1",
                 f"vllm_server_port={port}", "vllm_server_timeout=120", f"vllm_group_port={free_port()}"]
    run(["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "grpo.cli"],
        tmp_path / "two", env, overrides=overrides)
    rows = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if "reward/total" in r]) == 2 and "eval/accuracy" in rows[-1]

    # Pushed at the start, before the second rollout and before the final eval, by the main process only
    assert client._call("/health")["weights_version"] == 3
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "two" / "final")
    ours = TransformersSampler(trained, tok.pad_token_id, [tok.eos_token_id]).generate(prompts, greedy, [0, 1, 2, 3])
    after = client.generate(prompts, greedy, [0, 1, 2, 3]).ids
    assert after == ours.ids and after != before

    # One process against the same server (which now holds the two-process run's weights until the first push)
    run(["-m", "grpo.cli"], tmp_path / "one", env, overrides=overrides)
    rewards = [[json.loads(line).get("reward/total") for line in (tmp_path / d / "metrics.jsonl").read_text()
                .splitlines()] for d in ("one", "two")]
    assert rewards[0] == rewards[1]
    one, two = (load_file(str(tmp_path / d / "final" / "model.safetensors")) for d in ("one", "two"))
    # same completions; gradients equal up to float summation order (see test_vllm_training's two-process test)
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-3


@needs_vllm
@pytest.mark.parametrize("transport", ["http", "collective"])
def test_weights_reach_the_server_bucket_by_bucket(server, transport, monkeypatch):
    """Pushed in buckets of at most 64 KiB (the tiny model's 4 MB in ~60 of them), the server samples from exactly
    the pushed weights: greedy completions equal our sampler's on the policy, and change with it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.engines import vllm_weights
    from grpo.engines.vllm_server import VLLMServerClient
    from test_vllm import noised

    monkeypatch.setattr(vllm_weights, "BUCKET_BYTES", 64 << 10)
    model_dir, port = server
    tok = AutoTokenizer.from_pretrained(model_dir)
    client = VLLMServerClient(f"http://127.0.0.1:{port}", [tok.eos_token_id], timeout=180, transport=transport,
                              group_port=free_port())
    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = [tok(f"q{i}\n")["input_ids"] for i in range(4)]
    greedy = SamplingParams(8, top_k=1)
    seen = []
    for scale in (0.0, 0.5):
        policy = noised(base, scale=scale, seed=3)
        client.update_weights(policy)
        got = client.generate(prompts, greedy, [0, 1, 2, 3]).ids
        assert got == TransformersSampler(policy, tok.pad_token_id, [tok.eos_token_id]).generate(
            prompts, greedy, [0, 1, 2, 3]).ids
        seen.append(got)
    assert seen[0] != seen[1]
    assert client._call("/health")["weights_version"] == 2


def test_no_server_is_a_clear_error(tmp_path):
    """(The client needs no vLLM: this runs in every environment.)"""
    from grpo.config import ConfigError, GRPOConfig
    from grpo.engines.select import make_vllm

    cfg = GRPOConfig(use_vllm=True, vllm_mode="server", vllm_server_host="127.0.0.1", vllm_server_port=free_port(),
                     vllm_server_timeout=1)

    class OneProcess:
        is_main_process, num_processes, process_index, device = True, 1, 0, "cpu"

    class Tok:
        eos_token_id = 0

    with pytest.raises(ConfigError, match="vllm_mode: server: no vLLM server answered at http://127.0.0.1:.* "
                                          "start one with `grpo vllm-serve --model PATH`"):
        make_vllm(cfg, None, Tok(), OneProcess())
