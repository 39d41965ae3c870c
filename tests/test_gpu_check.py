"""bench/gpu_check.py with tiny shapes on the CPU (`--cpu`), as CI runs it: one JSON line per check, each ok or
skipped with its reason (the CUDA-only parts), and the numbers that must hold on any device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ["A_env", "B1", "B2", "B3", "B4", "B5", "C1", "C2", "C2b", "C3", "D"]


def run(*args: str, tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), *args, "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def test_every_check_runs_on_the_cpu_and_passes_or_says_why_not(tmp_path):
    done = run("--cpu", tmp_path=tmp_path)
    lines = [json.loads(line) for line in done.stdout.splitlines()]  # nothing but JSON lines on stdout
    by_name = {r["check"]: r for r in lines}
    assert [r["check"] for r in lines] == CHECKS
    for r in lines:
        assert r["status"] == "ok" or (r["status"] == "skipped" and r["why"]), (r, done.stderr[-2000:])
    assert done.returncode == 0
    assert by_name["B4"]["status"] == "skipped" and "CUDA only" in by_name["B4"]["why"]
    # Packed and padded passes agree in float32 on every attention that ran, with fewer tokens computed.
    ran = [e for e in by_name["B1"]["results"] if "max_abs" in e]
    assert {e["attn"] for e in ran} == {"sdpa", "eager"}
    assert all(e["max_abs"] <= 1e-4 for e in ran if e["dtype"] == "torch.float32")
    assert all(e["tokens_packed"] < e["tokens_padded"] for e in ran)
    # D1 on any device: AdamW at lr 1e-6 moves ~2% of bf16 weights (half a bf16 ulp at 0.02 is ~6e-5 >> 1e-6)
    # and every fp32 one; through the trainer, bf16 weights barely move while fp32 + autocast moves nearly all.
    assert by_name["B5"]["frac_changed"]["torch.bfloat16"] < 0.1
    assert by_name["C2"].get("refused") or by_name["C2"]["frac_weights_changed"] < 0.1
    assert by_name["C2b"]["frac_weights_changed"] > 0.5
    assert by_name["C3"]["resumed_to"] == 3


def test_only_runs_the_named_checks_and_refuses_unknown_ones(tmp_path):
    done = run("--cpu", "--only", "B3,B4", tmp_path=tmp_path)
    assert [json.loads(line)["check"] for line in done.stdout.splitlines()] == ["B3", "B4"]
    wrong = run("--cpu", "--only", "B9", tmp_path=tmp_path)
    assert wrong.returncode == 2 and "--only: unknown check(s) ['B9']" in wrong.stderr
