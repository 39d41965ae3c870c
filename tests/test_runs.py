"""Runs that survive a cluster and a careless hand (issue 23), in one process and quickly:

- a run directory belongs to one run: reuse refused, overwrite on request, a resume that changes what the run is
  refused, one that changes the learning rate taken (and applied), config.yaml naming what ran;
- a checkpoint or final/ that cannot be written (an injected ENOSPC / EACCES) leaves the previous checkpoint whole,
  and the run resumes from it to the uninterrupted run's weights;
- an engine that runs out of memory is an error naming the setting to change;
- a stop signal finishes the step, writes its checkpoint, says how to resume and exits 75; resuming gives the
  uninterrupted run's weights; Ctrl-C twice stops at once with one line.
The matrix of signals at random points, with 1 and 2 processes: tests/test_signals_matrix.py (slow tier).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from datasets import Dataset
from safetensors.torch import load_file

import grpo.training.checkpoint.files as ckpt
import grpo.training.update.objective as objective_module
from grpo import GRPOConfig, GRPOTrainer
from grpo.cli import main as cli_main
from grpo.config import ConfigError
from grpo.training.run.errors import EngineFailed, SaveFailed, TrainingInterrupted
from grpo.training.run.faults import engine_failure
from rewards_for_tests import count_a

STEPS = 4


def config(out, **overrides) -> GRPOConfig:
    values = dict(output_dir=str(out), task=None, num_generations=4, prompts_per_step=2, per_device_train_batch_size=4,
                  max_completion_length=6, learning_rate=1e-2, beta=0.04, max_steps=STEPS, save_steps=1,
                  save_total_limit=2, report_to=[], log_completions_steps=0, seed=0)
    values.update(overrides)
    return GRPOConfig(**values)


def data() -> Dataset:
    return Dataset.from_dict({"prompt": [f"q{i}\n" for i in range(8)]})


def train(model, out, reward=count_a, resume=None, **overrides) -> GRPOTrainer:
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config(out, **overrides), train_dataset=data())
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def weights(run: Path) -> dict:
    return load_file(str(run / "final" / "model.safetensors"))


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def straight(tiny_model_dir, tmp_path_factory) -> dict:
    """The uninterrupted run's final weights."""
    out = tmp_path_factory.mktemp("straight") / "run"
    train(tiny_model_dir, out)
    return weights(out)


# ---- run directories ------------------------------------------------------------------------------------------
def test_a_run_directory_is_not_reused_without_resume_or_overwrite(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    train(tiny_model_dir, out, max_steps=2)
    before = (out / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match=r"output_dir: .* holds a run \(checkpoint-1, checkpoint-2, config.yaml, "
                                          r"final, finished.json, layout.yaml, ...\); continue it with "
                                          r"--resume.*overwrite_output_dir: true"):
        train(tiny_model_dir, out, max_steps=2)
    assert (out / "metrics.jsonl").read_text() == before  # nothing of the first run was touched
    assert (out / "checkpoint-1").is_dir()


def test_overwrite_output_dir_starts_over(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    train(tiny_model_dir, out, max_steps=3)
    (out / "notes.txt").write_text("mine")
    train(tiny_model_dir, out, max_steps=1, overwrite_output_dir=True)
    assert "deleted the previous run's" in capsys.readouterr().out
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]  # the new run's (its last step);
    # the old checkpoint-2/3 are gone, so a later --resume cannot continue the old run
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1
    assert (out / "notes.txt").read_text() == "mine"  # not a file grpo writes: left alone


def test_resume_refuses_a_change_of_what_the_run_is(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    train(tiny_model_dir, out, max_steps=2)
    with pytest.raises(ConfigError, match=r"resume: num_generations 4 -> 2 would make this another run .* start a "
                                          r"new run from its weights \(model_name_or_path: .*checkpoint-2"):
        train(tiny_model_dir, out, resume=True, max_steps=3, num_generations=2)
    with pytest.raises(ConfigError, match=r"resume: reward_funcs \['rewards_for_tests:count_a'\] -> "
                                          r"\['test_runs:count_b'\]"):
        train(tiny_model_dir, out, reward=count_b, resume=True, max_steps=3)
    with pytest.raises(ConfigError, match=r"layout.prompts_per_rollout 2 -> 1"):
        train(tiny_model_dir, out, resume=True, max_steps=3, prompts_per_step=1)


def count_b(completions, **kwargs):
    return [c.count("b") / max(1, len(c)) for c in completions]


def test_resume_takes_a_new_learning_rate_and_says_so(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    train(tiny_model_dir, out, max_steps=2)
    capsys.readouterr()
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=[count_a], train_dataset=data(),
                          args=config(out, max_steps=3, learning_rate=1e-3, logging_steps=5))
    seen = []
    trainer.optimizer.step = lambda real=trainer.optimizer.step: (seen.append(trainer.optimizer.param_groups[0]["lr"]),
                                                                  real())[1]
    trainer.train(resume_from_checkpoint=True)
    said = capsys.readouterr().out
    assert "resume: changed since the checkpoint, taken from now on: learning_rate 0.01 -> 0.001; max_steps 2 -> 3" \
        in said and "logging_steps" not in said  # (how often it logs: not worth a word)
    assert seen == [1e-3]  # (step 3, from checkpoint-2, the first run's last step) restored as it was, the
    # optimizer and its schedule would have stepped at 1e-2


def test_config_yaml_names_what_ran(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    cfg = config(out, task="arithmetic", max_steps=1, task_eval_size=0, max_completion_length=4)
    GRPOTrainer(model=tiny_model_dir, args=cfg).train()
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["reward_funcs"] == ["math_accuracy", "think_format"]  # the task's (the config said [])
    assert saved["model_name_or_path"] == tiny_model_dir and saved["task"] == "arithmetic"
    assert GRPOConfig.load(out / "config.yaml").reward_funcs == ["math_accuracy", "think_format"]  # a valid recipe
    out2 = tmp_path / "run2"
    train(tiny_model_dir, out2, max_steps=1)  # a callable and a train_dataset: its import path, no task
    saved = yaml.safe_load((out2 / "config.yaml").read_text())
    assert saved["reward_funcs"] == ["rewards_for_tests:count_a"] and saved["task"] is None
    assert saved["reward_weights"] == [1.0]


# ---- disk faults --------------------------------------------------------------------------------------------------
def fail_save_at(monkeypatch, step: int, number: int, trainer_ref: list) -> None:
    """torch.save of checkpoint-<step>'s trainer_state.pt raises OSError(number), as a full disk would."""
    real = ckpt.torch.save

    def save(obj, path, *args, **kwargs):
        if Path(path).parent.name == f"checkpoint-{step}.tmp":
            raise OSError(number, os.strerror(number), str(path))
        return real(obj, path, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", save)


def test_a_full_disk_keeps_the_previous_checkpoint_and_resumes(tiny_model_dir, tmp_path, monkeypatch, straight):
    out = tmp_path / "run"
    fail_save_at(monkeypatch, 3, errno.ENOSPC, [])
    with pytest.raises(SaveFailed, match=r"could not write .*checkpoint-3: No space left on device "
                                         r"\(.*checkpoint-3.tmp/trainer_state.pt\); .* MiB free there\. the newest "
                                         r"complete checkpoint, .*checkpoint-2, is intact") as err:
        train(tiny_model_dir, out, save_total_limit=1)
    assert err.value.exit_code == 74
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-2"]
    monkeypatch.undo()  # space freed
    train(tiny_model_dir, out, resume=True, save_total_limit=1)
    assert max_diff(weights(out), straight) == 0.0


def test_a_final_write_without_permission_says_so(tiny_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "run"
    from transformers import PreTrainedTokenizerBase

    real = PreTrainedTokenizerBase.save_pretrained

    def refuse(self, path, *args, **kwargs):
        if not Path(path).name.startswith("final"):  # (final/, written as final.tmp/)
            return real(self, path, *args, **kwargs)
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(Path(path) / "tokenizer.json"))

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", refuse)
    with pytest.raises(SaveFailed, match=r"could not write .*final: Permission denied \(.*final.tmp/tokenizer.json\)"
                                         r".*checkpoint-4, is intact"):  # (the last step's, as transformers)
        train(tiny_model_dir, out, save_steps=3)
    assert not (out / "final").exists() and not (out / "final.tmp").exists()


def test_a_full_disk_while_writing_final_leaves_no_half_written_final(tiny_model_dir, tmp_path, monkeypatch):
    """final/ is written beside (final.tmp/) and moved in once whole, as a checkpoint is (docs/runs.md): the disk
    filling up at the weights left final/ with its config.json and no weights, which from_pretrained then took for a
    model."""
    import transformers.modeling_utils as modeling_utils

    real = modeling_utils.safe_save_file

    def full(tensors, filename, *args, **kwargs):
        if not Path(filename).parent.name.startswith("final"):
            return real(tensors, filename, *args, **kwargs)
        Path(filename).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(filename))

    monkeypatch.setattr(modeling_utils, "safe_save_file", full)
    out = tmp_path / "run"
    with pytest.raises(SaveFailed, match=r"could not write .*final: No space left on device .*checkpoint-4, is "
                                         r"intact") as err:  # (the last step's checkpoint, as transformers writes it)
        train(tiny_model_dir, out, save_steps=3)
    assert err.value.exit_code == 74
    assert not (out / "final").exists() and not (out / "final.tmp").exists()
    monkeypatch.undo()
    trainer = train(tiny_model_dir, out / "again", max_steps=1)  # (final/ over nothing: made by the rename)
    final = out / "again" / "final"
    (final / "notes.txt").write_text("mine")
    trainer.save_model(final)  # (over a final/ that holds a model and a file of the user's: each file replaced)
    assert (final / "model.safetensors").is_file() and (final / "notes.txt").read_text() == "mine"
    assert not (out / "again" / "final.tmp").exists()


# ---- engine faults -----------------------------------------------------------------------------------------------
def test_out_of_memory_names_the_setting(tiny_model_dir, tmp_path, monkeypatch):
    out, ref = tmp_path / "run", []
    real = objective_module.policy_loss

    def loss(*args, **kwargs):
        if ref[0].step + 1 == 3:  # (the third step's update)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(objective_module, "policy_loss", loss)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=[count_a], args=config(out), train_dataset=data())
    ref.append(trainer)
    with pytest.raises(EngineFailed, match=r"out of device memory in update \(OutOfMemoryError: CUDA out of memory.*"
                                           r"lower per_device_train_batch_size .*checkpoint-2 is intact"):
        trainer.train()
    assert ckpt.latest_checkpoint(out).name == "checkpoint-2"


def test_generation_out_of_memory_and_a_dead_vllm_engine_name_the_setting(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=[count_a], args=config(out), train_dataset=data())

    def generate(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    trainer.generator.generate = generate
    with pytest.raises(EngineFailed, match=r"in generation .*lower generation_batch_size .*no checkpoint was written"):
        trainer.train()
    dead = type("EngineDeadError", (RuntimeError,), {"__module__": "vllm.v1.engine.exceptions"})
    failure = engine_failure(dead("EngineCore encountered an issue"), GRPOConfig(use_vllm=True), "generation")
    assert "the vLLM engine failed in generation (EngineDeadError" in str(failure)
    assert "vllm_gpu_memory_utilization (now 0.3)" in str(failure)
    oom = engine_failure(torch.OutOfMemoryError("CUDA out of memory"), GRPOConfig(use_vllm=True), "update")
    assert "lower vllm_gpu_memory_utilization (now 0.3" in str(oom)
    assert engine_failure(ValueError("a bug"), GRPOConfig(), "update") is None  # not an engine fault: as it was


# ---- signals -----------------------------------------------------------------------------------------------------
class SignalAt:
    """A reward function that sends `signum` to this process while scoring rollout `at` (1-based), `times` times
    `gap_s` apart (a person pressing Ctrl-C twice)."""

    def __init__(self, signum, at, times=1, gap_s=0.0):
        self.signum, self.at, self.times, self.gap_s, self.calls = signum, at, times, gap_s, 0
        self.__name__ = "count_a"

    def __call__(self, completions, **kwargs):
        import time

        self.calls += 1
        if self.calls == self.at:
            for k in range(self.times):
                time.sleep(self.gap_s if k else 0.0)
                os.kill(os.getpid(), self.signum)
        return count_a(completions, **kwargs)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_a_stop_signal_saves_the_step_and_resume_continues_exactly(tiny_model_dir, tmp_path, signum, straight):
    out, before = tmp_path / "run", signal.getsignal(signum)  # (SIG_IGN for SIGINT under a shell's `cmd &`)
    with pytest.raises(TrainingInterrupted, match=rf"{signal.Signals(signum).name} after step 2 of 4; "
                                                   r"wrote .*checkpoint-2\. Resume: ") as err:
        train(tiny_model_dir, out, reward=SignalAt(signum, at=2), save_steps=0)  # (no checkpoint of its own)
    assert err.value.exit_code == 75
    assert ckpt.latest_checkpoint(out).name == "checkpoint-2" and not (out / "final").exists()
    assert signal.getsignal(signum) == before  # handlers put back
    train(tiny_model_dir, out, reward=SignalAt(signum, at=10**9), resume=True, save_steps=0)
    assert max_diff(weights(out), straight) == 0.0


def recipe(tmp_path, model) -> Path:
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}\n"}) + "\n" for i in range(8)))
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(dict(model_name_or_path=model, dataset_name=str(tmp_path / "data.jsonl"), task=None,
                                        reward_funcs=["test_runs:SIGNAL_REWARD"], num_generations=4, prompts_per_step=2,
                                        per_device_train_batch_size=4, max_completion_length=6, max_steps=STEPS,
                                        save_steps=0, report_to=[], log_completions_steps=0, seed=0,
                                        disable_tqdm=True)))
    return path


SIGNAL_REWARD = SignalAt(signal.SIGTERM, at=10**9)


def test_grpo_train_exits_75_with_the_resume_command_and_twice_ctrl_c_stops_at_once(tiny_model_dir, tmp_path,
                                                                                      capsys):
    path, out = recipe(tmp_path, tiny_model_dir), tmp_path / "run"
    SIGNAL_REWARD.__init__(signal.SIGTERM, at=3)
    assert cli_main(["train", str(path), f"output_dir={out}"]) == 75
    err = capsys.readouterr().err
    assert err.splitlines() == [  # (two lines: no blank one, no "stopped: SIGTERM: stopped")
        "grpo: SIGTERM: finishing this optimizer step, then writing a checkpoint (Ctrl-C again to stop at once).",
        f"grpo: stopped: SIGTERM after step 3 of 4; wrote {out}/checkpoint-3. Resume: grpo train {path} "
        f"output_dir={out} --resume"], err
    SIGNAL_REWARD.__init__(signal.SIGINT, at=1, times=2, gap_s=1.5)  # (the resumed run's first rollout: step 4)
    assert cli_main(["train", str(path), f"output_dir={out}", "--resume"]) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (f"grpo: interrupted: the newest checkpoint is {out}/checkpoint-3; resume: "
                                            f"grpo train {path} output_dir={out} --resume")
    assert "Traceback" not in err and not (out / "final").exists()


def test_the_grpo_command_ignores_stop_signals_once_its_run_is_complete(tiny_model_dir, tmp_path):
    """A launcher's signal reaching one worker after its train() returned (another still writing final/) must not
    kill it (SIGTERM's default action, or an uncaught KeyboardInterrupt: exit -2, seen in the slow signal matrix).
    As the command (argv from sys.argv) the run ends with the stop signals ignored; a caller's main([...]) keeps
    its own handlers."""
    path, out = recipe(tmp_path, tiny_model_dir), tmp_path / "run"
    SIGNAL_REWARD.__init__(signal.SIGTERM, at=10**9)
    script = ("import signal, sys; from grpo import cli; sys.argv = ['grpo', 'train', sys.argv[1], sys.argv[2]]; "
              "code = cli.main(); print(code, [signal.getsignal(s).name for s in "
              "(signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)])")
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), str(here.parent)])}
    done = subprocess.run([sys.executable, "-c", script, str(path), f"output_dir={out}"], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "0 ['SIG_IGN', 'SIG_IGN', 'SIG_IGN']"
    before = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]  # (a shell's `cmd &` ignores SIGINT)
    assert cli_main(["train", str(path), f"output_dir={tmp_path / 'again'}"]) == 0
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == before
