"""Two `grpo vllm-serve` servers as one rollout engine (grpo.engines.vllm_fleet) on vLLM's CPU build: the run is the
one-server run bit for bit (per-row seeds: a row's completion depends on its prompt, seed and weights, not on the
server or the rows beside it). The protocol around the engines (spread, failures, exit 75): tests/test_fleet.py.

A server killed mid-run (SIGKILL, as a lost node) while the other serves: the run ends its steps on the other with a
line naming it (slow: two server starts of about a minute each).

Skipped where vLLM is not importable: `.venv-vllm/bin/python -m pytest -q tests/test_vllm_fleet.py`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
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


@needs_vllm
@pytest.mark.slow
def test_a_server_killed_mid_run_leaves_its_rows_to_the_other(tmp_path):
    """4 steps of test_distributed's job against servers A and B (weights streamed over HTTP); B is killed with
    SIGKILL once step 1 is logged. The run ends its 4 steps on A alone, with a line naming B and fleet/servers_up
    falling from 2 to 1."""
    from test_distributed import job

    model = build_tiny_model(tmp_path / "model", hidden=128)
    env = job(tmp_path, model)
    killed: list[subprocess.Popen] = []
    with serving(model, tmp_path / "a.log") as a, serving(model, tmp_path / "b.log", killed) as b:
        out = tmp_path / "run"
        trainer = subprocess.Popen(
            [sys.executable, "-m", "grpo.cli", "train", str(tmp_path / "recipe.yaml"), f"output_dir={out}",
             "max_steps=4", "eval_steps=0", "use_vllm=true", "vllm_mode=server", "vllm_server_timeout=180",
             "vllm_weight_transfer=http", f"vllm_server_base_url=http://127.0.0.1:{a},http://127.0.0.1:{b}"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 600
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text().strip():
            assert trainer.poll() is None and time.monotonic() < deadline, "the run ended before its first step"
            time.sleep(0.2)
        killed[0].kill()
        _, err = trainer.communicate(timeout=600)
    assert trainer.returncode == 0, err[-3000:]
    assert f"vLLM server http://127.0.0.1:{b} failed in" in err and "1 of 2 server(s) left" in err
    rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "reward/total" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["fleet/servers_up"] == 2 and rows[-1]["fleet/servers_up"] == 1
