"""Server mode's weight push (`vllm_mode: server`): time and peak host memory on both sides, for a randomly
initialised model of Qwen2.5-0.5B's shapes (vocab 151,936, hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, tied embeddings; 494M parameters, 0.99 GB in bfloat16), on vLLM's CPU build.

    PYTHONPATH=$PWD .venv-vllm/bin/python bench/weight_push.py --transport collective   # or http
    # before (one safetensors blob over HTTP): the same script against grpo at 41face4
    git archive 41face4 grpo | tar -x -C /tmp/grpo-41face4
    PYTHONPATH=/tmp/grpo-41face4 .venv-vllm/bin/python bench/weight_push.py --transport blob

It starts `grpo vllm-serve` (from the grpo on PYTHONPATH) on the model, loads the same model in this process as the
trainer's policy, perturbs it, pushes it `--pushes` times and prints one JSON line per push: seconds, and each
side's peak resident memory during the push above its resident memory just before (Linux's VmHWM, reset through
/proc/PID/clear_refs before each push). Then it checks that the server samples from the pushed weights: greedy
completions equal those of the policy's own forward passes.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

SHAPE = dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
             num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True, max_position_embeddings=4096)


def model_dir(path: Path) -> Path:
    from transformers import AutoModelForCausalLM, Qwen2Config

    if not (path / "config.json").exists():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(Qwen2Config(**SHAPE), dtype=torch.bfloat16)
        model.save_pretrained(path)
    return path


def rss(pid: int | str = "self") -> dict[str, float]:
    """Resident and peak resident memory (GB) of a process."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {key: int(fields[key].split()[0]) / 1e6 for key in ("VmRSS", "VmHWM")}


def reset_peak(pid: int | str = "self") -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # (5: reset the peak resident set size to the current one)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transport", choices=["collective", "http", "blob"], default="collective",
                        help="blob: the client of grpo before the bucketed push (it has no transport setting)")
    parser.add_argument("--pushes", type=int, default=3)
    parser.add_argument("--model-dir", default="/tmp/qwen2.5-0.5b-shaped")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from transformers import AutoModelForCausalLM

    import grpo
    from grpo.engines.base import SamplingParams
    from grpo.engines.sampling import TransformersSampler
    from grpo.engines.vllm_server import VLLMServerClient

    path = model_dir(Path(args.model_dir))
    port = free_port()
    log = open(f"/tmp/weight_push_server_{port}.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "grpo.cli", "vllm-serve", "--model", str(path), "--host",
                               "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "512",
                               "--gpu-memory-utilization", "0.1", "--set", "enforce_eager=true", "--set",
                               "kv_cache_memory_bytes=134217728"], stdout=log, stderr=log,
                              cwd=Path(grpo.__file__).parents[1])  # (`-m grpo.cli` imports the grpo of its cwd first)
    try:
        options = {} if args.transport == "blob" else {"transport": args.transport, "group_port": free_port()}
        client = VLLMServerClient(f"http://127.0.0.1:{port}", [0], timeout=600, **options)
        policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        gen = torch.Generator().manual_seed(1)
        for push in range(args.pushes):
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * 0.002)
            before = {"trainer": rss(), "server": rss(server.pid)}
            reset_peak()
            reset_peak(server.pid)
            start = time.perf_counter()
            client.update_weights(policy)
            seconds = time.perf_counter() - start
            after = {"trainer": rss(), "server": rss(server.pid)}
            print(json.dumps({"transport": args.transport, "push": push, "seconds": round(seconds, 2),
                              **{f"{side}_peak_gb_above": round(after[side]["VmHWM"] - before[side]["VmRSS"], 2)
                                 for side in ("trainer", "server")},
                              **{f"{side}_rss_gb_before": round(before[side]["VmRSS"], 2)
                                 for side in ("trainer", "server")}}), flush=True)
        prompts = [[100 + i, 200 + i, 300 + i] for i in range(2)]
        greedy = SamplingParams(4, top_k=1)
        got = client.generate(prompts, greedy, [0, 1]).ids
        want = TransformersSampler(policy.float(), 0, [0]).generate(prompts, greedy, [0, 1]).ids
        print(json.dumps({"server_greedy": got, "policy_greedy": want, "same": got == want}), flush=True)
    finally:
        server.terminate()
        server.wait(timeout=120)


if __name__ == "__main__":
    main()
