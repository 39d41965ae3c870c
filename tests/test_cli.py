"""The `grpo` command: help, and every bad input as one clear line with exit status 2 before any training."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from grpo.cli import main


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for command in ("train", "eval", "plot"):
        assert command in out


def test_help_config_prints_the_resolved_config_as_a_readable_recipe(capsys, monkeypatch):
    """Before issue 34 it printed the Markdown table, the same whatever recipe and overrides stood beside it, with
    lines up to 951 characters."""
    import yaml

    from grpo.config import GRPOConfig

    monkeypatch.setenv("COLUMNS", "100")
    recipe = str(Path(__file__).parent.parent / "recipes" / "calculator_tools.yaml")
    assert main(["train", recipe, "learning_rate=3e-4", "--help-config"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100
    assert "\nlearning_rate: 0.0003  # grpo default: 1.0e-06; TRL: 1.0e-06\n" in out
    assert "\nbf16: false  # TRL: true\n" in out and "\nnum_generations: 8\n" in out  # (as TRL's and ours: no mark)
    assert "# Peak AdamW learning rate.\n" in out  # the meanings, as comments
    assert yaml.safe_load(out) == GRPOConfig.load(recipe, ["learning_rate=3e-4"]).to_dict()  # a valid recipe
    assert main(["train", recipe, "--print-config"]) == 0
    plain = capsys.readouterr().out
    assert "# Peak AdamW" not in plain and "\nlearning_rate: 0.0002  # grpo default: 1.0e-06; TRL: 1.0e-06\n" in plain


def test_the_markdown_reference_escapes_bars_in_types():
    from grpo.config import config_reference

    text = config_reference()
    assert "| `reward_timeout` | float \\| None | `60.0` |  | Seconds one reward-function call" in text
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert rows and all(len(re.findall(r"(?<!\\)\|", line)) == 6 for line in rows)  # 5 cells each


@pytest.fixture()
def data_file(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Calculate {i} + 1\n", "answer": str(i + 1)}) + "\n"
                            for i in range(8)))
    return path


def run_bad(capsys, args):
    code = main(["train"] + args)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err  # one line, not a traceback
    return err


@pytest.mark.parametrize("extra, message", [
    (["num_generations=1"], "num_generations: must be an integer >= 2 (got 1)"),
    (["num_generations=0"], "num_generations: must be an integer >= 2 (got 0)"),
    (["prompts_per_step=null", "generation_batch_size=12"], "generation_batch_size: 12 completions is not a multiple of num_generations=8"),
    (["learnig_rate=1e-5"], "unknown config key 'learnig_rate' (did you mean 'learning_rate'?)"),
    (["reward_funcs=[no_such_reward]"], "reward_funcs: unknown reward 'no_such_reward'"),
    (["reward_funcs=[countdown]"], "reward function 'countdown' needs column 'target', which the dataset lacks"),
    (["reward_funcs=[math_accuracy]", "reward_weights=[1, 2]"], "reward_weights: has 2 entries but reward_funcs has 1"),
    (["reward_funcs=[math_accuracy]", "prompt_column=question"], "prompt_column: 'question' is not a column"),
    (["reward_funcs=[math_accuracy]", "max_prompt_length=3"], "max_prompt_length: 8 of 8 prompts are longer than 3"),
])
def test_bad_train_inputs_are_one_line(capsys, tmp_path, tiny_model_dir, data_file, extra, message):
    args = [f"model_name_or_path={tiny_model_dir}", f"dataset_name={data_file}", f"output_dir={tmp_path / 'run'}"]
    err = run_bad(capsys, args + extra)
    assert message in err


def test_empty_dataset_is_an_error(capsys, tmp_path, tiny_model_dir):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    err = run_bad(capsys, [f"model_name_or_path={tiny_model_dir}", f"dataset_name={empty}",
                           "reward_funcs=[math_accuracy]", f"output_dir={tmp_path / 'run'}"])
    assert "dataset_name:" in err and "is empty" in err


def test_missing_files_are_named(capsys, tmp_path):
    assert "recipe 'nope.yaml' not found" in run_bad(capsys, ["nope.yaml"])
    err = run_bad(capsys, [f"dataset_name={tmp_path}/missing.jsonl", "reward_funcs=[math_accuracy]"])
    assert "dataset_name:" in err and "does not exist" in err


def test_first_error_first_model_then_dataset_then_rewards(capsys, tmp_path, tiny_model_dir):
    """As a new user types them: each bad input is one line naming its key, in the order a user fixes them (a
    missing dataset file was reported as "no reward function given"; a missing model as the hub client's
    traceback)."""
    out = f"output_dir={tmp_path / 'run'}"
    missing_data = f"dataset_name={tmp_path}/nope.jsonl"
    err = run_bad(capsys, ["model_name_or_path=./no-such-model", missing_data, out])
    assert err.startswith("grpo: error: model_name_or_path: './no-such-model' does not exist")
    err = run_bad(capsys, [f"model_name_or_path={tmp_path}", out])
    assert "model_name_or_path:" in err and "without config.json" in err
    err = run_bad(capsys, [f"model_name_or_path={tiny_model_dir}", missing_data, out])
    assert "dataset_name:" in err and "nope.jsonl' does not exist" in err
    err = run_bad(capsys, [f"model_name_or_path={tiny_model_dir}", "dataset_name=nope.jsonl", out])
    assert "dataset_name: 'nope.jsonl' does not exist" in err  # (a bare file name is not sent to the hub)
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "1+1"}) + "\n")
    err = run_bad(capsys, [f"model_name_or_path={tiny_model_dir}", f"dataset_name={tmp_path / 'd.jsonl'}", out])
    assert "reward_funcs: no reward function given" in err and "task=arithmetic" in err


@pytest.mark.parametrize("extra, message", [
    (["reward_funcs=[math_accuracy]", "prompts_per_step=20"],
     "dataset_name: the dataset has 8 prompts but one step needs 20 (prompts_per_step)"),
    (["reward_funcs=[math_accuracy]", "max_completion_length=300"],
     "max_completion_length: the longest prompt (16 tokens) plus max_completion_length (300) is 316, beyond the "
     "model's context of 256 tokens"),
    (["reward_funcs=[math_accuracy]", "dynamic_sampling=true", "reward_timeout=0"],
     "reward_timeout: must be > 0 seconds, or null."),
    (["reward_funcs=[math_accuracy]", "preset=ppo"], "preset: unknown value 'ppo'"),
])
def test_more_bad_inputs_before_the_model_loads(capsys, tmp_path, tiny_model_dir, data_file, extra, message):
    args = [f"model_name_or_path={tiny_model_dir}", f"dataset_name={data_file}", f"output_dir={tmp_path / 'run'}"]
    assert message in run_bad(capsys, args + extra)


def test_all_zero_weights_warn(tmp_path, tiny_model_dir, data_file):
    from grpo.config import GRPOConfig
    from grpo.training.setup.rewards import make_reward_runner

    cfg = GRPOConfig(task=None, reward_funcs=["math_accuracy", "think_format"], reward_weights=[0, 0])
    with pytest.warns(UserWarning, match="every weight is 0"):
        make_reward_runner(cfg, None, None)


def test_no_deepspeed_line_when_deepspeed_is_merely_installed():
    """accelerate imports DeepSpeed where it is installed, and DeepSpeed then logs "Setting accelerator to CPU" on a
    machine without CUDA: grpo filters that one line out (its other messages still print)."""
    import subprocess
    import sys

    pytest.importorskip("deepspeed")
    script = ("import logging, grpo, torch\n"
              "from accelerate.utils import extract_model_from_parallel\n"
              "extract_model_from_parallel(torch.nn.Linear(1, 1))\n"
              "logging.getLogger('DeepSpeed').warning('another DeepSpeed warning')\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert "Setting accelerator to CPU" not in out.stdout + out.stderr
    assert "another DeepSpeed warning" in out.stdout + out.stderr


def test_the_calculator_task_with_the_default_model_says_which_model_has_tools(capsys, tmp_path):
    assert main(["train", "task=calculator", f"output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("grpo: error: tools: tool calling needs a chat template") and "\n" not in err
    assert "model_name_or_path=tiny-tools, as recipes/calculator_tools.yaml sets" in err


def test_saved_files_are_readable_as_the_umask_allows_and_no_past_key_values_warning(tiny_model_dir, tmp_path):
    """transformers writes model.safetensors through a mkstemp file (mode 0600), and from 5.24 warned in every
    command that the `past_key_values` keyword is deprecated."""
    import os
    import stat
    import warnings

    from datasets import Dataset

    from grpo import GRPOConfig, GRPOTrainer
    from rewards_for_tests import count_a

    out = tmp_path / "run"
    cfg = GRPOConfig(output_dir=str(out), task=None, num_generations=4, prompts_per_step=2,
                     per_device_train_batch_size=4, max_completion_length=6, max_steps=2, save_steps=1, report_to=[],
                     log_completions_steps=0, beta=0.04, engine="transformers")
    old = os.umask(0o027)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)  # (past_key_values: the sampler's and the reference's)
            GRPOTrainer(model=tiny_model_dir, reward_funcs=[count_a], args=cfg,
                        train_dataset=Dataset.from_dict({"prompt": [f"q{i}\n" for i in range(8)]})).train()
    finally:
        os.umask(old)
    for path in [out / "final" / "model.safetensors", out / "checkpoint-1" / "model.safetensors",
                 out / "checkpoint-1" / "trainer_state.pt"]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o640, path  # 0666 less the umask 027


def test_flags_and_overrides_mix_in_any_order(capsys):
    """`grpo train RECIPE --resume max_steps=9` was "unrecognized arguments: max_steps=9" (argparse ends the
    positional items at the first flag)."""
    import yaml

    recipe = str(Path(__file__).parent.parent / "recipes" / "calculator_tools.yaml")
    assert main(["train", "--print-config", recipe, "--resume", "max_steps=9", "learning_rate=3e-4"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["resume"] is True and printed["max_steps"] == 9 and printed["learning_rate"] == 3e-4
    assert main(["train", "--help-config", "max_steps=3"]) == 0
    assert "\nmax_steps: 3" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        main(["train", "--no-such-flag"])
    assert done.value.code == 2 and "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plot", "a", "b"])  # (other commands take no extra items)
    assert "unrecognized arguments: b" in capsys.readouterr().err


def test_the_task_keys_help_lists_every_task():
    import dataclasses

    from grpo.config import GRPOConfig
    from grpo.tasks import TASKS

    text = next(f.metadata["help"] for f in dataclasses.fields(GRPOConfig) if f.name == "task")
    assert all(name in text for name in TASKS), text  # (it listed arithmetic and countdown of the four)


@pytest.mark.parametrize("target", ["{file}", "{file}/run"])
def test_an_output_dir_that_is_or_is_under_a_file_is_one_line_and_writes_nothing(capsys, tmp_path, tiny_model_dir,
                                                                                  data_file, target):
    """With beta=0 (likewise LoRA, or a GPU) no reference weights are written into output_dir at the start, which
    had caught this: the lock's mkdir was a NotADirectoryError traceback."""
    file = tmp_path / "a-file"
    file.write_text("mine")
    out = target.replace("{file}", str(file))
    err = run_bad(capsys, [f"model_name_or_path={tiny_model_dir}", f"dataset_name={data_file}", "beta=0",
                           "reward_funcs=[math_accuracy]", f"output_dir={out}"])
    assert err == f"grpo: error: output_dir: {file} is a file, not a directory; choose another output_dir."
    assert file.read_text() == "mine"


def test_a_logging_dir_under_a_file_is_one_line_and_leaves_no_lock(capsys, tmp_path, tiny_model_dir, data_file):
    file = tmp_path / "a-file"
    file.write_text("mine")
    out = tmp_path / "run"
    err = run_bad(capsys, [f"model_name_or_path={tiny_model_dir}", f"dataset_name={data_file}", "max_steps=1",
                           "reward_funcs=[math_accuracy]", f"logging_dir={file}/tb", f"output_dir={out}"])
    assert err == f"grpo: error: logging_dir: {file} is a file, not a directory; choose another logging_dir."
    assert not out.exists()  # (it was a NotADirectoryError traceback after config.yaml, with the lock left)


def test_a_tracker_not_installed_is_one_line_and_leaves_no_lock_or_files(capsys, tmp_path, tiny_model_dir,
                                                                          data_file):
    """report_to=[wandb] without wandb: an ImportError traceback after config.yaml, layout.yaml and metrics.jsonl
    were written, with the run's lock left behind."""
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    out = tmp_path / "run"
    err = run_bad(capsys, [f"model_name_or_path={tiny_model_dir}", f"dataset_name={data_file}",
                           "reward_funcs=[math_accuracy]", "report_to=[wandb]", f"output_dir={out}"])
    assert err == ("grpo: error: report_to: 'wandb' needs the wandb package, which is not installed; pip install "
                   "wandb, or drop 'wandb' from report_to.")
    assert not out.exists()


def test_a_run_that_fails_as_it_starts_gives_its_lock_back(tmp_path, tiny_model_dir, data_file, monkeypatch):
    """Anything failing between the lock and the loop (a tracker, a full disk writing config.yaml) left the lock."""
    from grpo.training.observe.summary import RunFiles

    def fails(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(RunFiles, "write", fails)
    out = tmp_path / "run"
    with pytest.raises(OSError):
        main(["train", f"model_name_or_path={tiny_model_dir}", f"dataset_name={data_file}", "max_steps=1",
              "reward_funcs=[math_accuracy]", "report_to=[]", f"output_dir={out}"])
    assert not (out / ".grpo.lock").exists()


def test_a_model_without_tokenizer_files_or_with_a_tokenizer_past_its_vocabulary_is_one_line(capsys, tmp_path,
                                                                                             tiny_model_dir, data_file):
    """transformers builds an empty tokenizer from config.json alone (the run failed minutes later in a reshape of 0
    elements); a pad token past the embeddings was an IndexError in the first forward pass."""
    import shutil

    from transformers import AutoTokenizer

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(Path(tiny_model_dir) / name, bare / name)
    args = [f"dataset_name={data_file}", "reward_funcs=[math_accuracy]", f"output_dir={tmp_path / 'run'}"]
    err = run_bad(capsys, [f"model_name_or_path={bare}", *args])
    assert err.startswith(f"grpo: error: model_name_or_path: {str(bare)!r} has no tokenizer files (tokenizer.json")
    big = tmp_path / "big"
    shutil.copytree(tiny_model_dir, big)
    tok = AutoTokenizer.from_pretrained(big)
    tok.add_tokens(["<extra0>", "<extra1>"])
    tok.pad_token = "<extra1>"
    tok.save_pretrained(big)
    err = run_bad(capsys, [f"model_name_or_path={big}", *args])
    assert err.startswith(f"grpo: error: model_name_or_path: the tokenizer of {str(big)!r} has {len(tok)} tokens "
                          "but the model has 258 embeddings (config.json vocab_size), and the pad token uses id "
                          f"{tok.pad_token_id} ('<extra1>')")
    assert not (tmp_path / "run").exists()


def test_the_long_prompt_advice_leads_to_a_run(capsys, tmp_path, tiny_model_dir):
    """The refusal of a prompt longer than max_prompt_length said `set prompt_truncation=left`; prompts cut to
    max_prompt_length (250) plus max_completion_length (16) passed the model's context (256), and the run was
    refused a second time. The advice now names a max_prompt_length that fits: followed, the run trains."""
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"prompt": "x" * 300 + f" {i}\n"}) + "\n" for i in range(4)))
    args = ["train", f"model_name_or_path={tiny_model_dir}", f"dataset_name={data}", "task=null",
            "reward_funcs=[rewards_for_tests:count_a]", "max_prompt_length=250", "max_completion_length=16",
            "num_generations=2", "prompts_per_step=2", "per_device_train_batch_size=4", "max_steps=1",
            "report_to=[]", "log_completions_steps=0", "save_steps=0", f"output_dir={tmp_path / 'run'}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    advice = re.search(r"set ((?:\w+=\w+ ?)+) to cut them", err)
    assert advice and advice.group(1).split() == ["prompt_truncation=left", "max_prompt_length=240"], err
    assert main(args + advice.group(1).split()) == 0, capsys.readouterr().err
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()


def test_a_malformed_json_line_is_one_line_naming_the_parsers_reason(capfd, tmp_path, tiny_model_dir):
    """datasets logged the parser's error on a line of its own and raised "An error occurred while generating the
    dataset", which the refusal quoted."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{bad json\n')
    assert main(["train", f"model_name_or_path={tiny_model_dir}", f"dataset_name={bad}", "task=null",
                 "reward_funcs=[think_format]", f"output_dir={tmp_path / 'run'}"]) == 2
    assert capfd.readouterr().err.splitlines() == [
        f"grpo: error: dataset_name: could not read {str(bad)!r} as json (ArrowInvalid: JSON parse error: Missing a "
        "name for object member. in row 1)."]
