"""TRL's script trl/scripts/grpo.py (TRL 1.16, as installed) and open-r1's src/open_r1/grpo.py (vendored in
tests/vendor, huggingface/open-r1@1416fa0), run with the import lines changed: `from trl import GRPOConfig` /
`GRPOTrainer` (and open-r1's reward functions) become grpo's. Local tiny model, local dataset directory, two
optimizer steps; the scripts' own argument parsing (`TrlParser` over `ScriptArguments`, `GRPOConfig`,
`ModelConfig`) builds our config. TRL's examples/scripts/grpo_vlm.py (vendored, huggingface/trl@7f8fbf0) with only
its GRPOTrainer import changed, on the tiny vision model.
"""

from __future__ import annotations

import itertools
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


VENDOR = TESTS / "vendor"  # open-r1's src/open_r1 (grpo.py and what it imports but rewards.py) and a recipe


def open_r1_recipe(tmp_path: Path, model: str, data: Path, out: Path) -> Path:
    """open-r1's recipes/Qwen2.5-1.5B-Instruct/grpo/config_demo.yaml with what this machine cannot do changed:
    the tiny model, a local dataset, no GPU (float32, sdpa, no vLLM), no hub or wandb, a handful of short steps.
    Every other key (do_eval, log_level, cosine schedule, warmup_ratio, overwrite_output_dir, reward_funcs and
    weights, save_strategy epoch, ...) is open-r1's."""
    recipe = yaml.safe_load((VENDOR / "open_r1_config_demo.yaml").read_text())
    local = {"model_name_or_path": model, "torch_dtype": None, "dtype": "float32", "attn_implementation": "sdpa",
             "dataset_name": str(data), "bf16": False, "use_vllm": False, "push_to_hub": False, "report_to": ["none"],
             "output_dir": str(out), "max_steps": 2, "num_generations": 4, "per_device_train_batch_size": 4,
             "gradient_accumulation_steps": 1, "max_completion_length": 8, "per_device_eval_batch_size": 4}
    assert set(local) - {"dtype", "max_steps"} <= set(recipe) | {"dtype"}, "open-r1's recipe changed"
    recipe.update(local)
    recipe.pop("torch_dtype")  # (TRL 1.16's ModelConfig: dtype; open-r1 pins trl 0.18)
    path = tmp_path / "config_demo.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_open_r1_grpo_script_trains_two_steps(tiny_chat_model_dir, tmp_path, monkeypatch):
    """open-r1's own src/open_r1/grpo.py (vendored, its imports of the trainer and the reward functions changed to
    grpo's) on its config_demo recipe: TrlParser((GRPOScriptArguments, open-r1's GRPOConfig over grpo's,
    ModelConfig)).parse_args_and_config() with unknown keys failing, open-r1's accuracy/format/tag_count rewards,
    train, save_metrics/save_state, save_model, the model card. The data has a test split: the script passes it
    as eval_dataset when eval_strategy is not "no" (grpo's default: steps; TRL's: no)."""
    import datasets

    data = tmp_path / "data"
    rows = [{"problem": f"What is {i} + 1?", "solution": f"${i + 1}$"} for i in range(8)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(rows[:2])}).save_to_disk(str(data))
    monkeypatch.setattr(datasets, "load_dataset", lambda path, name=None, **kw: datasets.load_from_disk(path))
    out = tmp_path / "out"
    recipe = open_r1_recipe(tmp_path, tiny_chat_model_dir, data, out)
    monkeypatch.syspath_prepend(str(VENDOR))
    for name in [m for m in sys.modules if m == "open_r1" or m.startswith("open_r1.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "argv", ["grpo.py", "--config", str(recipe)])
    runpy.run_path(str(VENDOR / "open_r1" / "grpo.py"), run_name="__main__")

    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "reward" in r] == [1, 2]
    # open-r1's accuracy, format and tag_count, as grpo names them (math_accuracy, r1_format, tag_count)
    assert {"rewards/math_accuracy/mean", "rewards/r1_format/mean", "rewards/tag_count/mean"} <= set(steps[0])
    results = json.loads((out / "train_results.json").read_text())  # save_metrics
    assert results["train_samples"] == 8 and "train_runtime" in results
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 2  # save_state
    assert "open-r1" in (out / "README.md").read_text()  # create_model_card's tags
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["lr_scheduler_type"] == "cosine" and saved["warmup_ratio"] == 0.1 and saved["system_prompt"]
    assert (out / "model.safetensors").exists() and (out / "checkpoint-2").is_dir()  # save_strategy epoch's end


def test_open_r1_get_reward_funcs_takes_script_args_settings():
    """grpo.rewards.get_reward_funcs(script_args), open-r1's: its names, configured by the script's settings (open-r1's
    defaults for those missing), and open-r1's ValueError for an unknown name."""
    from types import SimpleNamespace

    from grpo.rewards import get_reward_funcs

    cosine, accuracy = get_reward_funcs(SimpleNamespace(reward_funcs=["cosine", "accuracy"], cosine_max_len=50))
    assert (cosine.max_len, cosine.max_value_wrong) == (50, -0.5) and type(accuracy).__name__ == "MathAccuracy"
    with pytest.raises(ValueError, match="no_such_reward"):
        get_reward_funcs(SimpleNamespace(reward_funcs=["no_such_reward"]))


def test_a_dataclass_subclass_is_built_as_grpo_config():
    """open-r1's pattern, `@dataclass class GRPOConfig(<our GRPOConfig>)` with keys of its own: the subclass keeps our
    construction (loss_type's pair, aliases, TRL's keys checked) and its own fields."""
    from dataclasses import dataclass, field

    from grpo import GRPOConfig
    from grpo.config.base import ConfigError

    @dataclass
    class Sub(GRPOConfig):
        benchmarks: list[str] = field(default_factory=list)
        mine: int = 1

    cfg = Sub(loss_type="dapo", mine=2, num_generations_eval=3, benchmarks=["aime24"])
    assert (cfg.loss_aggregation, cfg.mine, cfg.eval_num_samples, cfg.benchmarks) == ("rollout_token_mean", 2, 3,
                                                                                        ["aime24"])
    with pytest.raises(ConfigError, match="^torch_compile: True is not supported"):
        Sub(torch_compile=True)


def test_trl_grpo_vlm_script_trains_two_steps(tmp_path, monkeypatch):
    """TRL's examples/scripts/grpo_vlm.py (vendored, only GRPOTrainer's import changed to grpo's; TRL's GRPOConfig,
    ModelConfig and TrlParser) with its documented LoRA options on grpo's tiny vision model. Its hub dataset
    (lmms-lab/multimodal-open-r1-8k-verified) is swapped for shapes pictures in its columns (`image`, `problem`,
    `solution` in LaTeX, as math_verify parses it): 108 rows, as its train_test_split holds 100 out for the test
    split; some grey and one too big, so its RGB conversion and size filter have work. Its own rewards, TRL's
    think_format_reward and accuracy_reward (math_verify), score the completions; then save_model."""
    import datasets

    from grpo.tasks import get_task

    rows = [{"image": r["image"], "problem": r["prompt"][-1]["content"], "solution": f"${r['answer']}$"}
            for r in get_task("shapes").make_rows("train", 108, 0)]
    for r in rows[::9]:
        r["image"] = r["image"].convert("L")
    rows[1]["image"] = rows[1]["image"].resize((600, 600))
    data = datasets.Dataset.from_list(rows)
    asked = []
    monkeypatch.setattr(datasets, "load_dataset", lambda path, split: asked.append((path, split)) or data)
    out = tmp_path / "out"
    argv = ["--model_name_or_path", "tiny-vision", "--output_dir", str(out), "--learning_rate", "1e-3",
            "--dtype", "float32", "--bf16", "false",  # (TRL's GRPOConfig defaults to bf16, refused on a CPU)
            "--max_completion_length", "8", "--use_peft", "--lora_target_modules", "q_proj", "v_proj",
            "--log_completions", "--per_device_train_batch_size", "4", "--num_generations", "4",
            "--max_steps", "2", "--logging_steps", "1", "--report_to", "none"]
    run_script(VENDOR / "trl_grpo_vlm.py", argv, monkeypatch)

    assert asked == [("lmms-lab/multimodal-open-r1-8k-verified", "train")]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    scored = [r for r in steps if "reward" in r]
    assert [r["step"] for r in scored] == [1, 2]
    for r, name in itertools.product(scored, ["think_format_reward", "accuracy_reward"]):
        # both of the script's rewards scored every row: no error, and math_verify parsed each `$n$` (else None)
        assert r[f"reward/error_frac/{name}"] == 0 and r[f"reward/{name}/none_frac"] == 0
        assert 0.0 <= r[f"rewards/{name}/mean"] <= 1.0
    assert list((out / "samples").glob("step_*.jsonl"))  # --log_completions
    assert (out / "adapter_model.safetensors").exists() and (out / "preprocessor_config.json").exists()
