"""bench/gpu_check.py with tiny shapes on the CPU (`--cpu`), as CI runs it: one JSON line per check, each ok or
skipped with its reason (the CUDA-only parts), the numbers that must hold on any device, and the last line naming
what went untested; --only, --budget, and the fresh process after a broken CUDA context."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ["A_env", "B1", "B2", "B3", "B4", "B5", "B6", "B7", "B8", "C1", "C2", "C2b", "C3", "C4", "C5", "E1", "D"]


def run(*args: str, tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), *args, "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def test_every_check_runs_on_the_cpu_and_passes_or_says_why_not(tmp_path):
    done = run("--cpu", tmp_path=tmp_path)
    lines = [json.loads(line) for line in done.stdout.splitlines()]  # nothing but JSON lines on stdout
    by_name = {r["check"]: r for r in lines}
    assert [r["check"] for r in lines] == CHECKS + ["untested"]
    for r in lines[:-1]:
        assert r["status"] == "ok" or (r["status"] == "skipped" and r["why"]), (r, done.stderr[-2000:])
    assert done.returncode == 0
    assert by_name["B4"]["status"] == "skipped" and "CUDA only" in by_name["B4"]["why"]
    # Packed and padded passes agree in float32 on every attention that ran, with fewer tokens computed.
    ran = [e for e in by_name["B1"]["results"] if "max_abs" in e]
    assert {e["attn"] for e in ran} == {"sdpa", "eager"}
    assert all(e["max_abs"] <= 1e-4 for e in ran if e["dtype"] == "torch.float32")
    assert all(e["tokens_packed"] < e["tokens_padded"] for e in ran)
    # D1 on any device: grpo's AdamW at lr 1e-6 moves ~2% of bf16 weights (half a bf16 ulp at 0.02 is ~6e-5 >> 1e-6)
    # and every fp32 one, and the trainer's warning estimates the 98% it leaves; through the trainer, bf16 weights
    # barely move (with the warning) while fp32 + autocast moves nearly all.
    optimizer = by_name["B5"]["optimizer"]
    assert optimizer["bfloat16"]["frac_changed"] < 0.1 and optimizer["bfloat16"]["warned"]
    assert abs(1 - optimizer["bfloat16"]["frac_changed"] - optimizer["bfloat16"]["rounded_away_estimate"]) <= 0.01
    assert by_name["C2"].get("refused") or by_name["C2"]["frac_weights_changed"] < 0.1
    assert by_name["C2b"]["frac_weights_changed"] > 0.5
    assert by_name["C3"]["resumed_to"] == 3
    # The sampler's log-probs against the update's: measured and within bf16's bound in every training check.
    for name in ("C1", "C2b", "E1"):
        assert by_name[name]["sampler_logp_gap"]["worst_step_mean"] <= 1e-2, by_name[name]
    assert by_name["B6"]["passes"]["plain: gradient_rel_diff"] == 0.0  # (the CPU: the hooks move nothing)
    assert by_name["B7"]["results"]["float32 head"]["max_abs"] <= 1e-4
    assert by_name["B8"]["status"] == "ok" and by_name["B8"]["tensors"] > 0
    assert by_name["C4"]["weights_max_abs_diff"] == 0.0
    assert by_name["E1"]["memory_peak_gib_per_step"] == [None, None]  # (no accelerator: no memory/peak_gib)
    untested = by_name["untested"]
    assert untested["status"] == "info" and "B4" in untested["skipped_checks"]
    assert any(k.startswith("vLLM") for k in untested["paths"])


def test_only_runs_the_named_checks_in_order_and_refuses_unknown_ones(tmp_path):
    done = run("--cpu", "--only", "B7,B3,B4", tmp_path=tmp_path)
    assert [json.loads(line)["check"] for line in done.stdout.splitlines()] == ["B7", "B3", "B4", "untested"]
    wrong = run("--cpu", "--only", "B9", tmp_path=tmp_path)
    assert wrong.returncode == 2 and "--only: unknown check(s) ['B9']" in wrong.stderr


def test_budget_skips_what_no_longer_fits(monkeypatch, capsys, tmp_path):
    """--budget on a GPU (the CPU is not budgeted): a check whose estimate exceeds what is left is skipped, saying
    so, and the checks after it still get their turn."""
    sys.path.insert(0, str(ROOT))
    from bench import gpu_check

    monkeypatch.setattr(gpu_check, "RESULTS", sys.stdout)
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "all_checks", lambda: {"B3": lambda ctx: {}, "D": lambda ctx: {}})
    monkeypatch.setattr(gpu_check, "run_check", lambda name, fn, ctx: {"check": name, "status": "ok", "seconds": 0})
    monkeypatch.setattr(gpu_check, "untested", lambda ctx, records: {"check": "untested", "status": "info",
                                                                    "skipped_checks": [r["check"] for r in records
                                                                                       if r["status"] == "skipped"]})
    assert gpu_check.main(["--only", "D,B3", "--budget", "60", "--out", str(tmp_path)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    # D's estimate (ESTIMATE_S: 140 s) does not fit in 60; B3's (1 s) does.
    assert gpu_check.ESTIMATE_S["D"][0] > 60 > gpu_check.ESTIMATE_S["B3"][0]
    assert [(r["check"], r["status"]) for r in lines] == [("D", "skipped"), ("B3", "ok"), ("untested", "info")]
    assert lines[0]["why"].startswith(f"--budget 60 s: about {gpu_check.ESTIMATE_S['D'][0]} s estimated")
    assert lines[2]["skipped_checks"] == ["D"]


def test_a_broken_cuda_context_sends_the_remaining_checks_to_a_fresh_process(monkeypatch, capsys, tmp_path):
    sys.path.insert(0, str(ROOT))
    from bench import gpu_check

    def device_assert(ctx):
        raise RuntimeError("CUDA error: device-side assert triggered")

    relaunched = []
    monkeypatch.setattr(gpu_check, "RESULTS", sys.stdout)
    monkeypatch.setattr(gpu_check, "all_checks", lambda: {"B1": device_assert, "B2": None, "B3": None})
    monkeypatch.setattr(gpu_check, "context_broken", lambda ctx: "AcceleratorError: device-side assert triggered")
    monkeypatch.setattr(gpu_check, "continue_in_fresh_process",
                        lambda names, args, spent: relaunched.append(names) or 0)
    assert gpu_check.main(["--cpu", "--only", "B1,B2,B3", "--out", str(tmp_path)]) == 1
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["check"], r["status"]) for r in lines] == [("B1", "error"), ("restart", "info")]
    assert relaunched == [["B2", "B3"]] and "device-side assert" in lines[0]["error"]
