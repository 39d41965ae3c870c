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


def test_trl_parser_takes_trl_keys_grpo_has_no_setting_for(tmp_path):
    """TRL's keys that are not settings of grpo are parser options as in TRL: on the command line (--do_eval, the
    dataloader keys, open-r1's hub_model_revision) and in a recipe under fail_with_unknown_args=True (as open-r1's
    script parses); a value grpo refuses is a ConfigError naming the key, not an unknown argument."""
    from trl import ModelConfig, ScriptArguments, TrlParser

    from grpo import GRPOConfig
    from grpo.config.base import ConfigError

    parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig))
    _, cfg, _ = parser.parse_args_and_config([
        "--output_dir", "o", "--dataset_name", "d", "--do_eval", "--dataloader_num_workers", "2",
        "--dataloader_drop_last", "--dataloader_prefetch_factor", "4", "--hub_model_revision", "b",
        "--accelerator_config", '{"dispatch_batches": false}'])
    assert cfg.do_eval is True and cfg.dataloader_num_workers == 2 and cfg.dataloader_drop_last is True
    assert cfg.dataloader_prefetch_factor == 4 and cfg.accelerator_config == {"dispatch_batches": False}
    assert cfg.hub_revision == "b" == cfg.hub_model_revision  # (open-r1's name for hub_revision)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"output_dir": "o", "dataset_name": "d", "do_eval": False, "do_train": True,
                                      "dataloader_pin_memory": False, "hub_model_revision": "main",
                                      "optim": "adamw_torch", "benchmarks": [], "callbacks": []}))
    _, cfg, _ = parser.parse_args_and_config(["--config", str(recipe)], fail_with_unknown_args=True)
    assert cfg.do_eval is False and cfg.dataloader_pin_memory is False and cfg.hub_revision is None
    written = cfg.to_dict()  # config.yaml: grpo's settings, then the TRL keys set to other than TRL's default
    assert {k: written[k] for k in ("dataloader_pin_memory", "optim", "do_train")} == {
        "dataloader_pin_memory": False, "optim": "adamw_torch", "do_train": True}
    assert "do_eval" not in written and "debug" not in written and GRPOConfig(**written) == cfg
    with pytest.raises(ConfigError, match="torch_compile: True is not supported"):
        parser.parse_args_and_config(["--output_dir", "o", "--dataset_name", "d", "--torch_compile"])
    with pytest.raises(ConfigError, match="dataloader_prefetch_factor: can only be set"):
        parser.parse_args_and_config(["--output_dir", "o", "--dataset_name", "d", "--dataloader_prefetch_factor", "2"])


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


# open-r1's src/open_r1/grpo.py could not be fetched here: this is its structure reconstructed from TRL's scripts and
# open-r1's published layout (GRPOScriptArguments over TRL's ScriptArguments, TrlParser((GRPOScriptArguments,
# GRPOConfig, ModelConfig)).parse_args_and_config(), get_tokenizer/get_model, make_conversation with the config's
# system_prompt and dataset_prompt_column, then train, log/save metrics and state, save_model, the model card), with
# `from open_r1.configs import GRPOConfig` changed to grpo's and its reward registry cut to one local function.
OPEN_R1_GRPO = '''
import os
from dataclasses import dataclass, field

import datasets
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed
from transformers.trainer_utils import get_last_checkpoint
from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config

from grpo import GRPOConfig, GRPOTrainer  # was: from open_r1.configs import GRPOConfig; from trl import GRPOTrainer
from rewards_for_tests import count_a


@dataclass
class GRPOScriptArguments(ScriptArguments):
    reward_funcs: list[str] = field(default_factory=lambda: ["count_a"])
    cosine_max_len: int = field(default=1000)
    dataset_prompt_column: str = field(default="prompt")


def get_tokenizer(model_args, training_args):
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision,
                                              trust_remote_code=training_args.trust_remote_code)
    if training_args.chat_template is not None:
        tokenizer.chat_template = training_args.chat_template
    return tokenizer


def get_model(model_args, training_args):
    dtype = model_args.dtype if model_args.dtype in ["auto", None] else getattr(torch, model_args.dtype)
    return AutoModelForCausalLM.from_pretrained(
        model_args.model_name_or_path, revision=model_args.model_revision, dtype=dtype,
        trust_remote_code=training_args.trust_remote_code, attn_implementation=model_args.attn_implementation,
        use_cache=False if training_args.gradient_checkpointing else True)


def main(script_args, training_args, model_args):
    set_seed(training_args.seed)
    last_checkpoint = None
    if os.path.isdir(training_args.output_dir):
        last_checkpoint = get_last_checkpoint(training_args.output_dir)
    dataset = datasets.load_dataset(script_args.dataset_name, name=script_args.dataset_config)
    tokenizer = get_tokenizer(model_args, training_args)
    model = get_model(model_args, training_args)
    reward_funcs = [{"count_a": count_a}[name] for name in script_args.reward_funcs]

    def make_conversation(example, prompt_column: str = script_args.dataset_prompt_column):
        prompt = []
        if training_args.system_prompt is not None:
            prompt.append({"role": "system", "content": training_args.system_prompt})
        prompt.append({"role": "user", "content": example[prompt_column]})
        return {"prompt": prompt}

    dataset = dataset.map(make_conversation)
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward_funcs, args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=(dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None),
        peft_config=get_peft_config(model_args), processing_class=tokenizer)
    checkpoint = training_args.resume_from_checkpoint or last_checkpoint
    train_result = trainer.train(resume_from_checkpoint=checkpoint)
    metrics = train_result.metrics
    metrics["train_samples"] = len(dataset[script_args.dataset_train_split])
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    trainer.save_model(training_args.output_dir)
    kwargs = {"dataset_name": script_args.dataset_name, "tags": ["open-r1"]}
    if trainer.accelerator.is_main_process:
        trainer.create_model_card(**kwargs)
        trainer.model.config.use_cache = True
        trainer.model.config.save_pretrained(training_args.output_dir)
    if training_args.push_to_hub:
        trainer.push_to_hub(**kwargs)


if __name__ == "__main__":
    parser = TrlParser((GRPOScriptArguments, GRPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config()
    main(script_args, training_args, model_args)
'''


def test_open_r1_style_grpo_script_trains_two_steps(tiny_chat_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "out"
    script = tmp_path / "open_r1_grpo.py"
    script.write_text(OPEN_R1_GRPO)
    argv = ["--model_name_or_path", tiny_chat_model_dir, "--dataset_name", str(data_dir(tmp_path)),
            "--system_prompt", "Answer.", "--output_dir", str(out), "--max_steps", "2", "--num_generations", "4",
            "--per_device_train_batch_size", "4", "--max_completion_length", "8", "--eval_strategy", "no",
            "--report_to", "none", "--save_strategy", "steps", "--save_steps", "1", "--dtype", "float32"]
    run_script(script, argv, monkeypatch)

    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "reward" in r] == [1, 2]
    results = json.loads((out / "train_results.json").read_text())  # save_metrics
    assert results["train_samples"] == 8 and "train_runtime" in results
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 2  # save_state
    assert "open-r1" in (out / "README.md").read_text()  # create_model_card's tags
    assert (out / "model.safetensors").exists() and (out / "checkpoint-2").is_dir()  # the last step's checkpoint
