"""Two `grpo vllm-serve` servers as one rollout engine (grpo.engines.vllm_fleet) on vLLM's CPU build: the run is the
one-server run bit for bit (per-row seeds: a row's completion depends on its prompt, seed and weights, not on the
server or the rows beside it). The protocol around the engines (spread, failures, exit 75): tests/test_fleet.py.

Skipped where vLLM is not importable: `.venv-vllm/bin/python -m pytest -q tests/test_vllm_fleet.py`.
"""

from __future__ import annotations

import json

import torch

from conftest import build_tiny_model
from test_vllm import needs_vllm
from test_fleet import free_ports
from test_vllm_server import serving


@needs_vllm
def test_two_servers_give_the_one_server_run_bit_for_bit(tmp_path):
    """3 steps of test_distributed's job (4 prompts x 8 completions, beta 0.04) against server A, then against A and
    B (weights pushed to both over two gloo groups, each step's rows spread over both): the same rewards at every
    step and the same final weights, bit for bit."""
    from safetensors.torch import load_file

    from test_distributed import job, run

    model = build_tiny_model(tmp_path / "model", hidden=128)  # head size 32: vLLM's CPU attention needs >= 32
    env = job(tmp_path, model)
    with serving(model, tmp_path / "a.log") as a, serving(model, tmp_path / "b.log") as b:
        common = ["eval_steps=0", "use_vllm=true", "vllm_mode=server", "vllm_server_timeout=180",
                  f"vllm_group_port={free_ports(2)}"]
        run(["-m", "grpo.cli"], tmp_path / "one", env, overrides=[*common, f"vllm_server_base_url=http://127.0.0.1:{a}"])
        run(["-m", "grpo.cli"], tmp_path / "two", env,
            overrides=[*common, f"vllm_server_base_url=http://127.0.0.1:{a},http://127.0.0.1:{b}"])
    logs = [[json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
            for d in ("one", "two")]
    assert [r.get("reward/total") for r in logs[0]] == [r.get("reward/total") for r in logs[1]]
    assert [r.get("fleet/servers_up") for r in logs[1] if "reward/total" in r] == [2, 2, 2]
    one, two = (load_file(str(tmp_path / d / "final" / "model.safetensors")) for d in ("one", "two"))
    assert all(torch.equal(one[k], two[k]) for k in one)
