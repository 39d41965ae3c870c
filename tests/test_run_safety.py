"""What a careless hand does to a run directory (issue 34), in one process:

- a damaged newest checkpoint (a file cut short, changed, or deleted) is named in one line and resume falls back to
  the newest intact one, ending at the uninterrupted run's weights bit for bit; `damaged_checkpoint: refuse` stops
  naming both;
- one run per directory at a time: a lock with the holder's host and pid, a dead holder's lock taken over, a live
  one's refused (a second `grpo train` process, tests/test_cli_stops.py), overwrite_output_dir included;
- `--resume` of a finished run does nothing unless max_steps grew.
FSDP2's damaged checkpoint: tests/test_sharded.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import grpo.training.checkpoint.files as ckpt
from grpo.config import ConfigError
from grpo.training.run.errors import TrainingInterrupted
from test_runs import SignalAt, max_diff, train, weights


@pytest.fixture(scope="module")
def stopped(tiny_model_dir, tmp_path_factory):
    """A run of 4 steps stopped by SIGTERM after step 3 (checkpoint-2 and checkpoint-3 on disk), and the
    uninterrupted run's final weights."""
    base = tmp_path_factory.mktemp("damaged")
    train(tiny_model_dir, base / "straight")
    with pytest.raises(TrainingInterrupted):
        train(tiny_model_dir, base / "stopped", reward=SignalAt(signal.SIGTERM, at=3))
    assert sorted(p.name for p in (base / "stopped").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    return base / "stopped", weights(base / "straight")


def resume(model, out, **overrides):
    return train(model, out, reward=SignalAt(signal.SIGTERM, at=10**9), resume=True, **overrides)  # (the same
    # reward function as the stopped run's, never signalling)


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def overwrite_64_bytes(path: Path) -> None:
    with open(path, "r+b") as fh:
        fh.seek(path.stat().st_size // 2)
        fh.write(bytes(64))  # (zeros over the middle of the weights: the size is unchanged)


@pytest.mark.parametrize("name, harm, why", [
    ("model.safetensors", truncate, r"model.safetensors has \d+ bytes, its manifest says \d+"),
    ("trainer_state.pt", truncate, r"trainer_state.pt has \d+ bytes, its manifest says \d+"),
    ("trainer_state.pt", Path.unlink, r"trainer_state.pt is missing"),
    ("model.safetensors", overwrite_64_bytes, r"model.safetensors has changed since it was written \(sha256"),
    ("manifest.json", Path.unlink, r"manifest.json is missing"),  # (was skipped without a word)
])
def test_a_damaged_checkpoint_is_named_and_resume_falls_back_exactly(tiny_model_dir, stopped, tmp_path, capsys,
                                                                     name, harm, why):
    source, want = stopped
    out = tmp_path / "run"
    shutil.copytree(source, out)
    harm(out / "checkpoint-3" / name)
    capsys.readouterr()
    resume(tiny_model_dir, out)
    said = capsys.readouterr().out.splitlines()
    line = [s for s in said if " is damaged: " in s]
    assert len(line) == 1, said
    assert line[0].startswith(f"resume: {out}/checkpoint-3 is damaged: ")
    import re

    assert re.search(why, line[0]) and line[0].endswith(f"Falling back to {out}/checkpoint-2, the newest intact "
                                                        "checkpoint."), line[0]
    assert max_diff(weights(out), want) == 0.0


def test_a_damaged_checkpoint_refused_when_asked_or_named(tiny_model_dir, stopped, tmp_path):
    source, _ = stopped
    out = tmp_path / "run"
    shutil.copytree(source, out)
    truncate(out / "checkpoint-3" / "model.safetensors")
    with pytest.raises(ConfigError, match=rf"resume: {out}/checkpoint-3 is damaged: model.safetensors has .* The "
                                          rf"newest intact checkpoint is {out}/checkpoint-2: resume from it with "
                                          r"damaged_checkpoint: fall_back"):
        resume(tiny_model_dir, out, damaged_checkpoint="refuse")
    with pytest.raises(ConfigError, match=rf"resume_from_checkpoint: {out}/checkpoint-3 is damaged: "
                                          r"model.safetensors has"):
        train(tiny_model_dir, out, reward=SignalAt(signal.SIGTERM, at=10**9), resume=str(out / "checkpoint-3"))
    (out / "checkpoint-2" / "trainer_state.pt").unlink()
    with pytest.raises(ConfigError, match=r"checkpoint-2 is damaged: trainer_state.pt is missing; no intact "
                                          r"checkpoint is left"):
        resume(tiny_model_dir, out)


def test_the_manifest_records_every_file_with_its_size_and_digest(stopped):
    source, _ = stopped
    manifest = json.loads((source / "checkpoint-3" / ckpt.MANIFEST).read_text())
    names = ckpt.file_names(source / "checkpoint-3")
    assert sorted(manifest["files"]) == names and {"model.safetensors", "trainer_state.pt"} <= set(names)
    import hashlib

    data = (source / "checkpoint-3" / "model.safetensors").read_bytes()
    assert manifest["files"]["model.safetensors"] == {"bytes": len(data), "sha256": [hashlib.sha256(data).hexdigest()]}
    big = source / "big.bin"  # (not part of it: a file of three blocks, hashed block by block)
    big.write_bytes(bytes(range(256)) * (ckpt.BLOCK // 256 * 2 + 1))
    try:
        blocks = ckpt.file_records(source, ["big.bin"])["big.bin"]["sha256"]
        data = big.read_bytes()
        assert blocks == [hashlib.sha256(data[k:k + ckpt.BLOCK]).hexdigest() for k in (0, ckpt.BLOCK, 2 * ckpt.BLOCK)]
    finally:
        big.unlink()
    assert ckpt.damage(source / "checkpoint-3") is None


# ---- one run per directory ---------------------------------------------------------------------------------------
def test_a_live_holder_is_refused_and_a_dead_ones_lock_taken_over(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    train(tiny_model_dir, out, max_steps=2)
    assert not (out / ".grpo.lock").exists()  # given back at the end
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (out / ".grpo.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": holder.pid,
                                                    "since": "then"}))
        for extra in ({"overwrite_output_dir": True}, {"resume": True, "max_steps": 3}):
            with pytest.raises(ConfigError, match=rf"output_dir: {out} is in use by a run still going \(pid "
                                                  rf"{holder.pid} on this host, since then\)"):
                train(tiny_model_dir, out, **extra)
    finally:
        holder.kill()
        holder.wait()
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".grpo.lock"} == before
    capsys.readouterr()
    train(tiny_model_dir, out, resume=True, max_steps=3)  # the holder is gone: its lock is stale
    assert f"output_dir: taking over {out}/.grpo.lock from pid {holder.pid}, which is no longer running." in \
        capsys.readouterr().out
    assert not (out / ".grpo.lock").exists()
    (out / ".grpo.lock").write_text(json.dumps({"host": "elsewhere", "pid": 1, "since": "then"}))
    with pytest.raises(ConfigError, match=r"pid 1 on host elsewhere, since then\); .*if that run is gone, delete "):
        train(tiny_model_dir, out, resume=True, max_steps=4)


def test_a_live_holders_lock_is_refused_before_the_model_loads(tiny_model_dir, tmp_path, monkeypatch):
    """The refusal came from train(), after the model (25-34 s for a 0.5B one) and the engine were built."""
    import grpo.training.trainer as trainer_module

    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (out / ".grpo.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": holder.pid,
                                                    "since": "then"}))

        def load_model(*args, **kwargs):
            raise AssertionError("the model was loaded")

        monkeypatch.setattr(trainer_module, "load_model", load_model)
        with pytest.raises(ConfigError, match=rf"output_dir: {out} is in use by a run still going"):
            train(tiny_model_dir, out, overwrite_output_dir=True)
    finally:
        holder.kill()
        holder.wait()


def test_resume_of_a_finished_run_does_nothing_unless_max_steps_grew(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    train(tiny_model_dir, out, max_steps=2)
    final = (out / "final" / "model.safetensors").read_bytes()
    metrics = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    trainer = train(tiny_model_dir, out, resume=True, max_steps=2)
    said = capsys.readouterr().out
    assert said == (f"resume: the run in {out} finished at step 2 (final/ written): nothing to do; raise max_steps "
                    "above 2 to train it further.\n")
    assert trainer.step == 2 and (out / "metrics.jsonl").read_text() == metrics
    assert (out / "final" / "model.safetensors").read_bytes() == final
    train(tiny_model_dir, out, resume=True, max_steps=3)
    assert [json.loads(r)["step"] for r in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert json.loads((out / "finished.json").read_text()) == {"step": 3}


def held_count_a(completions, **kwargs):
    """count_a, scoring step 2 onwards only once the file $GRPO_TEST_RELEASE exists (the first run stays live)."""
    import time

    from rewards_for_tests import count_a

    held_count_a.calls = getattr(held_count_a, "calls", 0) + 1
    while held_count_a.calls > 1 and not Path(os.environ["GRPO_TEST_RELEASE"]).exists():
        time.sleep(0.1)
    return count_a(completions, **kwargs)


def test_a_second_grpo_train_into_a_live_runs_directory_is_refused(tiny_model_dir, tmp_path):
    from test_runs import recipe

    path, out = recipe(tmp_path, tiny_model_dir), tmp_path / "run"
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), str(here.parent)]),
           "GRPO_TEST_RELEASE": str(tmp_path / "release")}
    command = [sys.executable, "-m", "grpo.cli", "train", str(path), f"output_dir={out}",
               "reward_funcs=[test_run_safety:held_count_a]", "save_steps=1", "max_steps=6"]
    first = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoint-1").is_dir() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (out / ".grpo.lock").is_file() and first.poll() is None
        taken = sorted(p.relative_to(out) for p in out.rglob("*"))
        second = subprocess.run([*command, "overwrite_output_dir=true"], env=env, capture_output=True, text=True,
                                timeout=120)
        assert second.returncode == 2
        assert second.stderr.strip().splitlines() == [
            f"grpo: error: output_dir: {out} is in use by a run still going (pid {first.pid} on this host, since "
            f"{json.loads((out / '.grpo.lock').read_text())['since']}); wait for it to end or choose another "
            f"output_dir (if that run is gone, delete {out}/.grpo.lock)."]
        assert set(taken) <= {p.relative_to(out) for p in out.rglob("*")}  # nothing of the first run deleted
        (tmp_path / "release").touch()
        assert first.wait(timeout=120) == 0, first.stderr.read()[-2000:]
    finally:
        first.kill()
    assert [json.loads(r)["step"] for r in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    assert not (out / ".grpo.lock").exists()


def test_trainer_state_loads_onto_the_cpu(tmp_path, monkeypatch):
    """Every process of a DDP resume reads trainer_state.pt: mapped to the CPU, not to the device it was saved from
    (cuda:0 for every rank, with rank 0's optimizer state: gpu_review2 N2). The CPU cannot save a CUDA tensor, so
    the test records the map_location torch.load gets."""
    torch_load, seen = ckpt.torch.load, []

    def spy(*args, **kwargs):
        seen.append(kwargs.get("map_location"))
        return torch_load(*args, **kwargs)

    ckpt.torch.save({"step": 3, "optimizer": {"state": {0: {"exp_avg": ckpt.torch.ones(2)}}}}, tmp_path / ckpt.STATE)
    monkeypatch.setattr(ckpt.torch, "load", spy)
    state = ckpt.load_trainer_state(tmp_path)
    assert state["step"] == 3 and seen == ["cpu"]
