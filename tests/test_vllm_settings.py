"""How grpo builds and drives a vLLM engine, checked against a stand-in `vllm` module that records every call (no
vLLM needed, so these run in every environment): the engine's construction settings (TRL's), its dtype, sleep
level 2 with the weights woken before the KV cache, per-row seeds, and the combinations refused by name.

What the stand-in cannot show: that vLLM's sleep mode frees and takes back GPU memory (vLLM's CPU build has none;
tests/test_vllm.py checks the refusal there), and what a real engine does with these settings (the CPU build runs
them in tests/test_vllm.py, test_vllm_training.py and test_vllm_server.py).
"""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

from conftest import build_tiny_model
from grpo.config import ConfigError, GRPOConfig
from grpo.engines.base import SamplingParams


class FakeLLM:
    """vllm.LLM as grpo uses it; every call is appended to `calls`."""

    calls: list = []
    built: dict = {}

    def __init__(self, **kwargs):
        FakeLLM.built = {**kwargs, "env_rank": os.environ.get("RANK"), "env_port": os.environ.get("MASTER_PORT")}
        config = types.SimpleNamespace(get_vocab_size=lambda: 100)
        self.llm_engine = types.SimpleNamespace(model_config=config)

    def collective_rpc(self, method, kwargs):
        FakeLLM.sent = kwargs["weights_iterator"]
        FakeLLM.calls.append((method, len(list(kwargs["weights_iterator"]))))

    def reset_prefix_cache(self):
        FakeLLM.calls.append(("reset_prefix_cache",))

    def sleep(self, level):
        FakeLLM.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        FakeLLM.calls.append(("wake_up", tags))

    def generate(self, requests, sampling, use_tqdm):
        FakeLLM.calls.append(("generate", [p.seed for p in sampling]))
        step = {7: types.SimpleNamespace(logprob=-0.5)}
        out = types.SimpleNamespace(token_ids=[7], logprobs=[step])
        return [types.SimpleNamespace(outputs=[out]) for _ in requests]


@pytest.fixture
def fake_vllm(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = FakeLLM, lambda **kw: types.SimpleNamespace(**kw)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_sleep_mode_available=lambda: True, device_type="cuda")
    for name, module in {"vllm": vllm, "vllm.inputs": inputs, "vllm.platforms": platforms}.items():
        monkeypatch.setitem(sys.modules, name, module)
    FakeLLM.calls, FakeLLM.built = [], {}
    return FakeLLM


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny")))


class Accelerator:
    """The parts of accelerate's Accelerator that make_vllm reads."""

    def __init__(self, mixed_precision="no", num_processes=1):
        self.mixed_precision, self.num_processes, self.process_index = mixed_precision, num_processes, 0
        self.is_main_process, self.device = True, torch.device("cpu")


class Tokenizer:
    eos_token_id = 2


def test_the_colocated_engine_is_built_with_trls_settings(fake_vllm, policy):
    from grpo.engines.select import make_vllm

    cfg = GRPOConfig(use_vllm=True, seed=3)
    for key in ("RANK", "MASTER_PORT"):
        assert key not in os.environ  # (the launcher's variables are set only while vLLM starts)
    make_vllm(cfg, policy, Tokenizer(), Accelerator(), rows=64)
    built = fake_vllm.built
    # D5: TRL's max_num_seqs (the rows of one rollout on this process), max_num_batched_tokens and executor
    assert built["max_num_seqs"] == 64 and built["max_num_batched_tokens"] == 4096
    assert built["distributed_executor_backend"] == "external_launcher"
    assert built["env_rank"] == "0" and built["env_port"] is not None  # one process: rank 0 of 1
    assert "RANK" not in os.environ and "MASTER_PORT" not in os.environ
    assert built["seed"] == 3 and built["logprobs_mode"] == "processed_logprobs"
    # the policy's weights were loaded at once (one tensor per parameter, tied embeddings once)
    assert fake_vllm.calls[0][0] == "reload_weights" and fake_vllm.calls[1] == ("reset_prefix_cache",)
    # vllm_engine_kwargs win over the defaults
    make_vllm(GRPOConfig(use_vllm=True, vllm_engine_kwargs={"max_num_batched_tokens": 8192}), policy, Tokenizer(),
              Accelerator(), rows=64)
    assert fake_vllm.built["max_num_batched_tokens"] == 8192


@pytest.mark.parametrize("precision, want", [("no", "float32"), ("bf16", "bfloat16"), ("fp16", "float16")])
def test_the_engine_runs_in_the_dtype_the_trainer_computes_in(fake_vllm, policy, precision, want):
    """D6: float32 master weights under bf16 autocast give a bfloat16 engine, not a float32 one."""
    from grpo.engines.select import make_vllm

    assert next(policy.parameters()).dtype == torch.float32
    make_vllm(GRPOConfig(use_vllm=True), policy, Tokenizer(), Accelerator(precision))
    assert fake_vllm.built["dtype"] == want


def test_sleep_mode_drops_the_weights_and_wakes_them_before_the_kv_cache(fake_vllm, policy, monkeypatch):
    """D8: level 2, then on waking: the weights' memory, the policy's weights loaded into it, the KV cache's. N5:
    torch's cached free blocks go back to the device before each wake_up (vLLM's pool cannot use them)."""
    from grpo.engines.sharding import hf_weights
    from grpo.engines.vllm import VLLMEngine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (as on a GPU: the calls are recorded)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: fake_vllm.calls.append(("empty_cache",)))
    engine = VLLMEngine("path", policy, eos_ids=[2], enable_sleep_mode=True)
    fake_vllm.calls.clear()
    engine.sleep()
    engine.update_weights(policy)  # asleep: nothing to write into yet
    assert fake_vllm.calls == [("sleep", 2)]
    engine.wake()
    n = len(list(hf_weights(policy)))  # every tensor, in transformers' names
    assert fake_vllm.calls == [("sleep", 2), ("empty_cache",), ("wake_up", ["weights"]), ("reload_weights", n),
                               ("reset_prefix_cache",), ("empty_cache",), ("wake_up", ["kv_cache"])]
    engine.wake()  # awake already: nothing
    engine.update_weights(policy)  # awake: loaded at once
    assert fake_vllm.calls[-2:] == [("reload_weights", n), ("reset_prefix_cache",)]
    without = VLLMEngine("path", policy, eos_ids=[2])
    fake_vllm.calls.clear()
    without.sleep()
    without.wake()
    assert fake_vllm.calls == []


@pytest.mark.parametrize("setting, device, seeded", [(None, "cpu", True), (None, "cuda", False), (True, "cuda", True),
                                                     (False, "cpu", False)])
def test_per_row_seeds_are_a_setting(fake_vllm, policy, setting, device, seeded):
    """D9: a seed on each request makes vLLM sample row by row; off by default on GPUs."""
    from grpo.engines.select import make_vllm

    accelerator = Accelerator()
    accelerator.device = torch.device(device)
    engine = make_vllm(GRPOConfig(use_vllm=True, vllm_per_row_seeds=setting), policy, Tokenizer(), accelerator)
    out = engine.generate([[1, 2], [1, 3]], SamplingParams(4), [11, 12])
    assert fake_vllm.calls[-1] == ("generate", [11, 12] if seeded else [None, None])
    assert out.ids == [[7], [7]] and out.logprobs == [[-0.5], [-0.5]]


def test_a_tensor_parallel_server_hands_its_workers_host_tensors(fake_vllm):
    """`grpo vllm-serve --tensor-parallel-size 2`: the weights received (on the server's GPU over NCCL) are pickled
    to vLLM's worker processes, and a pickled CUDA tensor lands on cuda:0 in every worker (gpu_review2 N4): each is
    copied to host memory first. (A stand-in for a CUDA tensor records the copy: the CPU has none.)"""
    from grpo.engines.vllm import VLLMEngine

    class OnDevice:
        def __init__(self, value):
            self.value = value

        def cpu(self):
            return torch.full((2,), self.value)

    engine = VLLMEngine("path", None, eos_ids=[2], tensor_parallel_size=2)
    engine.load_weights(iter([("a", OnDevice(1.0)), ("b", OnDevice(2.0))]))
    assert [(name, t.device.type, t.tolist()) for name, t in fake_vllm.sent] == [("a", "cpu", [1.0, 1.0]),
                                                                                  ("b", "cpu", [2.0, 2.0])]


def test_colocated_tensor_parallel_is_refused_in_one_process(fake_vllm, policy):
    """D20: the engine's workers would be other processes, and each update would pickle the model to them."""
    from grpo.engines.select import make_vllm

    with pytest.raises(ConfigError, match="vllm_tensor_parallel_size: a colocated engine .* vllm_mode: server"):
        make_vllm(GRPOConfig(use_vllm=True, vllm_tensor_parallel_size=2), policy, Tokenizer(), Accelerator())
    assert fake_vllm.built == {}


def test_server_mode_on_several_machines_needs_the_servers_address(monkeypatch, policy):
    """D17: the default host 0.0.0.0 would point every machine's trainer at itself."""
    from grpo.engines.select import make_vllm

    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cfg = GRPOConfig(use_vllm=True, vllm_mode="server", vllm_server_timeout=1)
    with pytest.raises(ConfigError, match="vllm_server_base_url: this run spans 2 machines, and '0.0.0.0' would "
                                          "point each one at itself"):
        make_vllm(cfg, policy, Tokenizer(), Accelerator())
    # with the server's address given it goes on to connect (and finds nothing on this port)
    cfg = GRPOConfig(use_vllm=True, vllm_mode="server", vllm_server_host="127.0.0.2", vllm_server_port=9,
                     vllm_server_timeout=0.1)
    with pytest.raises(ConfigError, match="no vLLM server answered at http://127.0.0.2:9"):
        make_vllm(cfg, policy, Tokenizer(), Accelerator())


def test_a_server_that_cannot_join_the_weight_transfer_group_is_a_clear_error(policy):
    """A stand-in server that answers but never joins the group (as one that cannot reach vllm_group_port)."""
    import json
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from grpo.engines.select import make_vllm

    class Answers(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self._json({"model": "m", "weights_version": 0, "device": "cpu", "dtype": "float32"})

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self._json({"ok": True})

        def _json(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        group_port = s.getsockname()[1]
    cfg = GRPOConfig(use_vllm=True, vllm_mode="server", vllm_server_base_url=f"http://127.0.0.1:{server.server_port}",
                     vllm_server_timeout=2, vllm_group_port=group_port)
    try:
        with pytest.raises(ConfigError, match=f"vllm_mode: server: vllm_group_port: the server did not join .* at "
                                              f"127.0.0.1:{group_port} .* or set vllm_weight_transfer: http"):
            make_vllm(cfg, policy, Tokenizer(), Accelerator())
    finally:
        server.shutdown()
