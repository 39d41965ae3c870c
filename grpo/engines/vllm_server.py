"""vLLM as a server (`vllm_mode: server`): `grpo vllm-serve` runs one engine that any number of trainer processes,
on this machine or another, send prompts to; the main trainer process pushes the policy's weights into it after each
optimizer step.

The protocol is three HTTP endpoints with JSON bodies (weights as one safetensors blob), served by the standard
library, so a trainer needs neither vLLM nor a web framework to talk to it:

    GET  /health          {"model": ..., "weights_version": n}
    POST /generate        {"prompt_ids", "params" (SamplingParams' fields), "seeds", "eos_ids"}
                          -> {"ids", "truncated", "logprobs"}
    POST /update_weights  safetensors bytes of the policy's weights under transformers' names (LoRA merged)
                          -> {"weights_version": n}

Requests run one at a time on the engine (vLLM's `LLM` is not thread-safe); each generate request's rows keep their
own seeds, so completions do not depend on which trainer process asked or in which order. Weights travel over HTTP:
simple and tested here on the CPU, but for large models on GPUs a collective (NCCL) transfer as in TRL would be
faster; that is not built yet.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from grpo.engines.base import Completions, SamplingParams


def serve(model: str, host: str = "0.0.0.0", port: int = 8000, **engine_kwargs) -> None:
    """Run a vLLM engine for `model` behind the HTTP endpoints above until interrupted."""
    from safetensors.torch import load as load_safetensors

    from grpo.engines.vllm import VLLMEngine

    engine = VLLMEngine(model, eos_ids=[], **engine_kwargs)
    lock = threading.Lock()
    state = {"weights_version": 0}

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, body: dict, status: int = 200) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path != "/health":
                return self._reply({"error": f"no endpoint {self.path}"}, 404)
            self._reply({"model": model, **state})

        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            try:
                with lock:
                    if self.path == "/generate":
                        request = json.loads(body)
                        engine.eos_ids = list(request["eos_ids"])
                        out = engine.generate(request["prompt_ids"], SamplingParams(**request["params"]),
                                              request["seeds"])
                        return self._reply(dataclasses.asdict(out))
                    if self.path == "/update_weights":
                        engine.load_weights(load_safetensors(body).items())
                        state["weights_version"] += 1
                        return self._reply(state)
                self._reply({"error": f"no endpoint {self.path}"}, 404)
            except Exception as err:  # noqa: BLE001 - the trainer gets the reason, the server stays up
                self._reply({"error": f"{type(err).__name__}: {err}"}, 500)

        def log_message(self, *args) -> None:  # one line per request would drown the engine's own log
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    print(f"grpo vllm-serve: {model} on http://{host}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


class VLLMServerClient:
    """The rollout engine of a trainer process in server mode: `generate` asks the server; `update_weights` pushes
    the policy's weights when this process is the one that pushes (`push`), then waits at `barrier` so that no
    process generates from the old weights. Waits up to `timeout` seconds for the server to answer at first."""

    def __init__(self, base_url: str, eos_ids: list[int], timeout: float = 240.0, push: bool = True,
                 barrier=None):
        self.url, self.eos_ids, self.push, self.barrier = base_url.rstrip("/"), list(eos_ids), push, barrier
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.info = self._call("/health")
                break
            except OSError as err:
                if time.monotonic() > deadline:
                    raise ConnectionError(f"no vLLM server answered at {self.url} within {timeout:g} s ({err}); "
                                          f"start one with `grpo vllm-serve --model PATH`, or check "
                                          f"vllm_server_base_url / vllm_server_host / vllm_server_port") from None
                time.sleep(1.0)

    def _call(self, path: str, body: bytes | None = None, content_type: str = "application/json") -> dict:
        request = urllib.request.Request(self.url + path, data=body, headers={"Content-Type": content_type})
        try:
            with urllib.request.urlopen(request) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            reason = json.loads(err.read() or b"{}").get("error", err.reason)
            raise RuntimeError(f"vLLM server {self.url}{path}: {reason}") from None

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, seeds: list[int]) -> Completions:
        body = {"prompt_ids": prompt_ids, "params": dataclasses.asdict(params), "seeds": list(seeds),
                "eos_ids": self.eos_ids}
        return Completions(**self._call("/generate", json.dumps(body).encode()))

    def update_weights(self, model) -> None:
        from grpo.engines.sharding import hf_weights, sharding

        if not self.push and sharding(model) is not None:
            for _ in hf_weights(model):  # gathering a sharded model is collective: every process takes part
                pass
        if self.push:
            from safetensors.torch import save

            seen: set[int] = set()
            tensors = {}
            for name, tensor in hf_weights(model):
                tensor = tensor.detach().to("cpu").contiguous()
                if tensor.untyped_storage().data_ptr() in seen:  # (tied weights: safetensors wants no sharing)
                    tensor = tensor.clone()
                seen.add(tensor.untyped_storage().data_ptr())
                tensors[name] = tensor
            self._call("/update_weights", save(tensors), "application/octet-stream")
        if self.barrier is not None:
            self.barrier()
