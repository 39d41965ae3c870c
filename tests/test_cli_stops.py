"""Every stop of `grpo train` is one line (issue 34): bad bytes in a data file, a full disk at the start, and a stop
signal at any moment from the first instant (during `import torch`, while the model loads, after it loaded), each
with its exit status and no traceback. The signals during training: tests/test_runs.py.
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
import yaml

from grpo.cli import main as cli_main

HERE = Path(__file__).parent


def recipe(tmp_path, model, data: bytes | None = None, **extra) -> Path:
    (tmp_path / "data.jsonl").write_bytes(data or "".join(json.dumps({"prompt": f"q{i}\n"}) + "\n"
                                                          for i in range(8)).encode())
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(dict(model_name_or_path=model, dataset_name=str(tmp_path / "data.jsonl"), task=None,
                                        reward_funcs=["rewards_for_tests:count_a"], num_generations=4,
                                        prompts_per_step=2, per_device_train_batch_size=4, max_completion_length=6,
                                        max_steps=2, beta=0.04, reference_weights="disk", save_steps=1, report_to=[],
                                        log_completions_steps=0, seed=0, disable_tqdm=True,
                                        output_dir=str(tmp_path / "run"), **extra)))
    return path


def grpo_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("grpo:")]


def test_a_data_file_that_is_not_utf8_names_the_line_and_byte(tiny_model_dir, tmp_path, capsys):
    rows = b'{"prompt": "q1"}\n{"prompt": "q2 \xff\xfe"}\n'
    assert cli_main(["train", str(recipe(tmp_path, tiny_model_dir, rows))]) == 2
    err = capsys.readouterr().err
    assert grpo_lines(err) == [f"grpo: error: dataset_name: '{tmp_path}/data.jsonl' is not UTF-8: line 2 (byte 32) "
                               r"holds b'\xff'; save the file as UTF-8."] and "Traceback" not in err


def test_a_full_disk_while_writing_the_reference_weights_exits_74(tiny_model_dir, tmp_path, capsys, monkeypatch):
    import safetensors.torch

    def full(tensors, path, *args, **kwargs):
        Path(path).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    assert cli_main(["train", str(recipe(tmp_path, tiny_model_dir))]) == 74
    err = capsys.readouterr().err
    assert len(grpo_lines(err)) == 1 and "Traceback" not in err
    assert grpo_lines(err)[0].startswith(f"grpo: stopped: could not write the reference model's weights "
                                         f"(reference_weights: disk) into {tmp_path}/run: No space left on device; ")
    assert grpo_lines(err)[0].endswith(" MiB free there. Free space there, or keep the reference in memory: "
                                       "reference_weights=memory.")
    assert not list((tmp_path / "run").glob(".reference-*"))  # no partial copy of the model left behind


# A stop signal sent by the process to itself at a chosen moment, with the `grpo` command's entry point (cli.command).
# SIGINT as a terminal's: a runner that started the tests in the background passes it on ignored (which the command
# then respects, as nohup asks).
RESET = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
SIGNAL_DURING_IMPORT = """
import importlib.abc, os, signal, sys
class Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch.nn":  # (inside `import torch`, which has not finished)
            os.kill(os.getpid(), signal.{sig})
        return None
sys.meta_path.insert(0, Hook())
"""
SIGNAL_AT = """
import os, signal
import grpo.training.trainer as trainer
real = trainer.{at}
def hooked(*args, **kwargs):
    os.kill(os.getpid(), signal.{sig})
    return real(*args, **kwargs)
trainer.{at} = hooked
"""


@pytest.mark.parametrize("sig, at, code, said", [
    ("SIGINT", "import", 130, "grpo: interrupted before anything was written."),
    ("SIGTERM", "import", 75, "grpo: stopped: SIGTERM before anything was written."),
    ("SIGTERM", "load_model", 75, "grpo: stopped: SIGTERM: no checkpoint was written, nothing to resume."),
    # (CI time: the later stages in the slow tier; SIGTERM at load_model runs the same path in CI)
    pytest.param("SIGINT", "make_optimizer", 130, "grpo: interrupted: no checkpoint was written, nothing to resume.",
                 marks=pytest.mark.slow),
    pytest.param("SIGUSR1", "make_optimizer", 75, "grpo: stopped: SIGUSR1: no checkpoint was written, nothing to "
                 "resume.", marks=pytest.mark.slow),
])
def test_a_stop_signal_before_training_is_one_line(tiny_model_dir, tmp_path, sig, at, code, said):
    path = recipe(tmp_path, tiny_model_dir)
    hook = SIGNAL_DURING_IMPORT if at == "import" else SIGNAL_AT.replace("{at}", at)
    script = (RESET + hook.replace("{sig}", sig) + "import sys; from grpo import cli; sys.argv = ['grpo', 'train', "
              f"{str(path)!r}]; cli.command()")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == code, done.stderr[-3000:]
    assert grpo_lines(done.stderr) == [said] and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert not list((tmp_path / "run").glob(".reference-*"))  # the exit handlers ran: the reference file is gone


def test_the_command_runs_exit_handlers_then_exits_with_mains_status(tmp_path):
    """cli.command() ends the process with os._exit (no module-by-module teardown of torch: seconds) after running
    the exit handlers that clean up (worker pools, the reference weights' file)."""
    script = ("import atexit, sys; from grpo import cli; atexit.register(lambda: open(sys.argv[1], 'w').write('ran'));"
              " cli.main = lambda: 3; cli.command()")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "mark")], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(HERE.parent)})
    assert done.returncode == 3 and (tmp_path / "mark").read_text() == "ran"


@pytest.mark.parametrize("sig, code, said", [
    ("SIGTERM", 75, "grpo: stopped: SIGTERM before anything was written."),
    ("SIGINT", 130, "grpo: interrupted before anything was written."),
])
def test_a_stop_signal_as_the_command_starts_is_one_line(tmp_path, sig, code, said):
    """The command's own first imports (argparse, in grpo.cli before main()): SIGTERM killed it without a word (exit
    -15) and SIGINT gave a KeyboardInterrupt traceback. The handler is installed as grpo.cli starts, as the command
    (`python -m grpo.cli`, or the `grpo` script) only: a library import keeps its caller's handlers."""
    hook = SIGNAL_DURING_IMPORT.replace('"torch.nn"', '"argparse"').replace("{sig}", sig)
    (tmp_path / "sitecustomize.py").write_text(RESET + hook)  # (run as the interpreter starts)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(HERE.parent)])}
    done = subprocess.run([sys.executable, "-m", "grpo.cli", "train", "max_steps=1"], env=env, capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == code and done.stderr.splitlines() == [said], (done.returncode, done.stderr[-3000:])
    assert not (tmp_path / "runs").exists()
    library = subprocess.run([sys.executable, "-c", "import signal, grpo.cli; print(signal.getsignal(signal.SIGTERM)"
                              " is signal.SIG_DFL)"], env={**env, "PYTHONPATH": str(HERE.parent)},
                             capture_output=True, text=True, timeout=120)
    assert library.stdout.split()[-1:] == ["True"], library.stderr[-3000:]
