"""TRL's script trl/scripts/grpo.py (TRL 1.16, as installed) and an open-r1-style script built on `TrlParser`, run
with the import lines changed: `from trl import GRPOConfig` / `GRPOTrainer` become grpo's. Local tiny model, local
dataset directory, two optimizer steps; the scripts' own argument parsing (`TrlParser` over `ScriptArguments`,
`GRPOConfig`, `ModelConfig`) builds our config.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest
import yaml

trl = pytest.importorskip("trl")

TESTS = Path(__file__).parent


def data_dir(tmp_path: Path) -> Path:
    """A dataset directory `load_dataset(path)` reads as a `train` split (its file's name)."""
    d = tmp_path / "data"
    d.mkdir()
    (d / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{i} + 1 ="}) + "\n" for i in range(8)))
    return d


def trl_grpo_script(tmp_path: Path) -> Path:
    """TRL's own trl/scripts/grpo.py with its two `from trl import` lines changed to take grpo's config and
    trainer (everything else from TRL: ScriptArguments, ModelConfig, TrlParser, get_peft_config, ...)."""
    text = (Path(trl.__file__).parent / "scripts" / "grpo.py").read_text()
    edits = {
        "from trl import GRPOTrainer, get_dataset, get_peft_config, get_quantization_config":
            "from grpo import GRPOTrainer\n    from trl import get_dataset, get_peft_config, get_quantization_config",
        "from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig, TrlParser":
            "from grpo import GRPOConfig\n    from trl import DatasetMixtureConfig, ModelConfig, TrlParser",
    }
    for old, new in edits.items():
        assert text.count(old) == 1, f"TRL's grpo.py changed: {old!r} not found once"
        text = text.replace(old, new)
    path = tmp_path / "grpo_script.py"
    path.write_text(text)
    return path


def run_script(path: Path, argv: list[str], monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", [str(path), *argv])
    monkeypatch.syspath_prepend(str(TESTS))  # rewards_for_tests, as a user's own module on the path
    runpy.run_path(str(path), run_name="__main__")


def test_trl_grpo_script_trains_two_steps(tiny_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "out"
    argv = ["--model_name_or_path", tiny_model_dir, "--dataset_name", str(data_dir(tmp_path)),
            "--reward_funcs", "rewards_for_tests.count_a", "--output_dir", str(out), "--max_steps", "2",
            "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "8",
            "--eval_strategy", "no", "--report_to", "none", "--dtype", "float32", "--learning_rate", "1e-4"]
    run_script(trl_grpo_script(tmp_path), argv, monkeypatch)

    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "reward" in r] == [1, 2]
    saved = yaml.safe_load((out / "config.yaml").read_text())  # written by name: no torch object in it
    assert saved["learning_rate"] == 1e-4 and saved["max_steps"] == 2
    assert (out / "config.json").exists() or (out / "final" / "config.json").exists()


def test_trl_parser_sees_each_option_once():
    """TrlParser((ScriptArguments, GRPOConfig, ModelConfig)): the model, dataset and LoRA options belong to
    ModelConfig and ScriptArguments (as with TRL's GRPOConfig), the training options to ours, typed."""
    from trl import ModelConfig, ScriptArguments, TrlParser

    from grpo import GRPOConfig

    parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig))
    script, cfg, model = parser.parse_args_and_config([
        "--output_dir", "o", "--dataset_name", "d", "--model_name_or_path", "m", "--use_peft", "--lora_r", "4",
        "--report_to", "wandb", "tensorboard", "--model_init_kwargs", '{"device_map": "cpu"}', "--save_steps", "0.5",
        "--eval_steps", "10", "--reward_weights", "1", "0.5", "--use_chat_template", "false", "--loss_type", "dapo"])
    assert script.dataset_name == "d" and model.model_name_or_path == "m" and model.use_peft and model.lora_r == 4
    assert cfg.report_to == ["wandb", "tensorboard"] and cfg.model_init_kwargs == {"device_map": "cpu"}
    assert cfg.save_steps == 0.5 and cfg.eval_steps == 10 and isinstance(cfg.eval_steps, int)
    assert cfg.reward_weights == [1.0, 0.5] and cfg.use_chat_template is False
    # every field arrives from the parser, defaults included; loss_type still sets the pair it names, as
    # GRPOConfig(loss_type="dapo") does (dapo = rollout_token_mean + clip).
    assert (cfg.loss_aggregation, cfg.surrogate) == ("rollout_token_mean", "clip")
    assert cfg == GRPOConfig(output_dir="o", report_to=["wandb", "tensorboard"], save_steps=0.5, eval_steps=10,
                             model_init_kwargs={"device_map": "cpu"}, reward_weights=[1, 0.5],
                             use_chat_template=False, loss_type="dapo")


def test_trl_parser_preset_fills_keys_left_at_default():
    """--preset dapo through the parser: the preset's values where no flag was given (a parser passes every
    field; those at their default count as not set), a flag's value where one was."""
    from transformers import HfArgumentParser

    from grpo import GRPOConfig
    from grpo.config.presets import PRESETS

    (cfg,) = HfArgumentParser(GRPOConfig).parse_args_into_dataclasses(
        ["--output_dir", "o", "--preset", "dapo", "--epsilon", "0.1"])
    assert cfg.epsilon == 0.1
    for key, value in PRESETS["dapo"].items():
        if key != "epsilon":
            assert getattr(cfg, key) == GRPOConfig(preset="dapo", epsilon=0.1).__getattribute__(key), key


def test_dict_key_as_bad_json_names_the_key():
    from grpo import GRPOConfig
    from grpo.config.base import ConfigError

    with pytest.raises(ConfigError, match="model_init_kwargs: expected a mapping"):
        GRPOConfig(model_init_kwargs="device_map=cpu")


def test_config_yaml_writes_objects_by_name(tmp_path):
    """A torch dtype in model_init_kwargs (TRL's scripts put ModelConfig's dtype there) is written as its name."""
    torch = pytest.importorskip("torch")
    from grpo import GRPOConfig

    cfg = GRPOConfig(output_dir=str(tmp_path), model_init_kwargs={"dtype": torch.bfloat16, "device_map": None})
    cfg.save(tmp_path / "c.yaml")
    assert yaml.safe_load((tmp_path / "c.yaml").read_text())["model_init_kwargs"] == {"dtype": "bfloat16",
                                                                                    "device_map": None}
