"""Slow tier: stop signals at random points of 20 `grpo train` runs (10 with one process, 10 with two under
torchrun, alternating), each resumed with --resume to the uninterrupted run's final weights; and a double Ctrl-C.

Each run waits for a random number of logged steps, then a random fraction of a second more (so the signal lands in
generation, scoring, the update or a save; the reward takes 1 s, so a rollout is still to come after the steps
waited for), then sends SIGTERM, SIGINT or SIGUSR1 in turn: with one process to it,
with two to one worker chosen at random (the other learns of it in the per-step all-reduce). A rollout feeds two
optimizer steps (num_iterations 2), so some stops fall inside a rollout. Run:

    python -m pytest -m slow -s tests/test_signals_matrix.py

It prints the summary (runs, exit codes, max |weight difference|) and asserts every difference is 0.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from test_distributed import free_port

STEPS = 6
RECIPE = """\
model_name_or_path: {model}
dataset_name: {data}
task: null
reward_funcs: ["rewards_for_tests:paced_count_a"]
num_generations: 4
prompts_per_step: 2
per_device_train_batch_size: 4
max_completion_length: 8
learning_rate: 1.0e-2
num_iterations: 2
max_steps: {steps}
save_steps: 2
save_total_limit: 2
report_to: []
log_completions_steps: 0
disable_tqdm: true
"""
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def setup(tmp_path: Path, model: str) -> dict:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}\n"}) + "\n" for i in range(16)))
    (tmp_path / "recipe.yaml").write_text(RECIPE.format(model=model, data=data, steps=STEPS))
    here = Path(__file__).parent
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), str(here.parent)]), "OMP_NUM_THREADS": "1"}


def command(tmp_path: Path, out: Path, procs: int, port: int, resume: bool = False, extra=()) -> list[str]:
    launcher = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port)] if procs == 2 \
        else []
    return [sys.executable, *launcher, "-m", "grpo.cli", "train", str(tmp_path / "recipe.yaml"), f"output_dir={out}",
            *extra, *(["--resume"] if resume else [])]


def workers(pid: int) -> list[int]:
    """The launcher's child processes (torchrun's workers)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return sorted(found)


def logged_steps(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def interrupt(cmd, env, out: Path, procs: int, signum: int, rng: random.Random, twice: bool = False):
    """Start the run, signal it at a random point; returns (exit code, stderr, where: the steps logged then)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for = rng.randint(1, STEPS - 2)
    while logged_steps(out) < wait_for and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(0.0 if twice else rng.uniform(0.0, 0.8))  # (twice: at once, inside the next rollout's 2.5 s scoring)
    where = logged_steps(out)
    target = proc.pid if procs == 1 else rng.choice(workers(proc.pid))
    os.kill(target, signum)
    if twice:
        time.sleep(1.2)
        os.kill(target, signum)
    _, err = proc.communicate(timeout=600)
    return proc.returncode, err, where


def final(out: Path) -> dict:
    return load_file(str(out / "final" / "model.safetensors"))


@pytest.mark.slow
def test_signals_at_random_points_resume_to_the_uninterrupted_weights(tmp_path, tiny_model_dir):
    env = setup(tmp_path, tiny_model_dir)
    want = {}
    for procs in (1, 2):
        out = tmp_path / f"straight{procs}"
        done = subprocess.run(command(tmp_path, out, procs, free_port()), env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        want[procs] = final(out)
    rng, rows = random.Random(23), []
    for i in range(20):
        procs, signum = 1 + i % 2, SIGNALS[i % 3]  # (every pairing of process count and signal)
        out = tmp_path / f"run{i}"
        rc, err, where = interrupt(command(tmp_path, out, procs, free_port()), env, out, procs, signum, rng)
        stopped = [line for line in err.splitlines() if line.startswith("grpo: stopped:")]
        if rc == 0 and not stopped:  # the signal came after the last step: the run finished (handlers stay till then)
            stopped = ["finished before the signal was acted on"]
        else:
            assert len(stopped) == 1 and "Resume: " in stopped[0], err[-3000:]
            assert procs == 2 or rc == 75, (rc, err[-3000:])  # (torchrun reports its workers' 75 as its own 1)
            done = subprocess.run(command(tmp_path, out, procs, free_port(), resume=True), env=env,
                                  capture_output=True, text=True)
            assert done.returncode == 0, done.stderr[-3000:]
        got = final(out)
        diff = max((got[k] - want[procs][k]).abs().max().item() for k in got)
        rows.append(dict(run=i, processes=procs, signal=signal.Signals(signum).name, logged_steps_then=where,
                         stopped_line=stopped[0].split(";")[0], exit=rc, max_abs_diff=diff))
    slow = ['reward_funcs=["rewards_for_tests:slow_count_a"]', "num_iterations=1"]  # (a rollout every step)
    done = subprocess.run(command(tmp_path, tmp_path / "straight-slow", 1, 0, extra=slow), env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "twice"
    rc, err, where = interrupt(command(tmp_path, out, 1, 0, extra=slow), env, out, 1, signal.SIGINT, rng, twice=True)
    last = err.strip().splitlines()[-1]
    assert rc == 130 and last.startswith("grpo: interrupted:") and "Traceback" not in err, err[-3000:]
    done = subprocess.run(command(tmp_path, out, 1, 0, resume=True, extra=slow), env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    want_slow = final(tmp_path / "straight-slow")
    twice = max((final(out)[k] - want_slow[k]).abs().max().item() for k in want_slow)
    for row in rows:
        print(json.dumps(row))
    print(f"summary: {len(rows)} runs ({sum(r['processes'] == 1 for r in rows)} with 1 process, "
          f"{sum(r['processes'] == 2 for r in rows)} with 2), signals "
          f"{ {s: sum(r['signal'] == s for r in rows) for s in ('SIGTERM', 'SIGINT', 'SIGUSR1')} }, "
          f"max |dtheta| {max(r['max_abs_diff'] for r in rows)}; double SIGINT: exit {rc}, '{last}', "
          f"resumed max |dtheta| {twice}")
    assert all(r["max_abs_diff"] == 0.0 for r in rows) and twice == 0.0
    assert sum(r["exit"] != 0 for r in rows) >= 15  # (most signals land inside the run)
