"""Config: typed, validated once, every bad value one line naming the key."""

from __future__ import annotations

import pytest

from grpo.config import ConfigError, GRPOConfig, config_reference, parse_override


@pytest.mark.parametrize("values, message", [
    ({"num_generations": 0}, "num_generations: must be an integer >= 2 (got 0)"),
    ({"num_generations": 1}, "num_generations: must be an integer >= 2 (got 1)"),
    ({"temperature": 0}, "temperature: must be > 0"),
    ({"top_p": 1.5}, "top_p: must be in (0, 1]"),
    ({"learning_rate": "fast"}, "learning_rate: expected float, got 'fast'"),
    ({"learning_rate": -1e-6}, "learning_rate: must be a finite number > 0"),
    ({"beta": -0.1}, "beta: must be >= 0"),
    ({"epsilon": 0.2, "epsilon_high": 0.1}, "epsilon_high: must be >= epsilon"),
    ({"scale_rewards": "sometimes"}, "scale_rewards: unknown value 'sometimes'; choose one of group, batch, none"),
    ({"loss_type": "bogus"}, "loss_type: unknown value 'bogus'"),
    ({"kl_estimator": "k4"}, "kl_estimator: unknown value 'k4'"),
    ({"max_steps": 0}, "max_steps: must be >= 1, or -1"),
    ({"reward_funcs": ["a", "b"], "reward_weights": [1.0]}, "reward_weights: has 1 entries but reward_funcs has 2"),
    ({"report_to": ["mlflow"]}, "report_to: unknown sink"),
    ({"num_iterations": 0}, "num_iterations: must be >= 1"),
    ({"num_generations": 8, "generation_batch_size": 12},
     "generation_batch_size: 12 completions is not a multiple of num_generations=8"),
])
def test_bad_values_name_the_key(values, message):
    with pytest.raises(ConfigError) as err:
        GRPOConfig.from_dict(values)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_key_suggests_the_close_one():
    with pytest.raises(ConfigError, match=r"unknown config key 'learnig_rate' \(did you mean 'learning_rate'\?\)"):
        GRPOConfig.from_dict({"learnig_rate": 1e-5})


def test_seed_aliases_and_trl_loss_type():
    # Seed 004's recipe keys: kl_penalty and clip_range are beta and epsilon.
    cfg = GRPOConfig.from_dict({"kl_penalty": 0.01, "clip_range": 0.3, "loss_type": "dr_grpo", "bf16": True})
    assert (cfg.beta, cfg.epsilon, cfg.epsilon_high) == (0.01, 0.3, 0.3)
    # TRL's meanings: dr_grpo is a constant normalizer with the clip surrogate; bf16 is mixed precision over the
    # weights' own dtype (torch_dtype sets that)
    assert (cfg.loss_aggregation, cfg.surrogate) == ("constant", "clip") and cfg.torch_dtype == "float32" and cfg.bf16
    with pytest.raises(ConfigError, match="both 'kl_penalty' and 'beta' are set"):
        GRPOConfig.from_dict({"kl_penalty": 0.01, "beta": 0.02})


def test_yaml_strings_are_coerced_by_type(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rate: 1e-6\nnum_generations: 16\nreward_funcs: accuracy\n")
    cfg = GRPOConfig.load(recipe, ["beta=0", "report_to=[]", "temperature=0.6"])
    assert cfg.learning_rate == 1e-6 and cfg.num_generations == 16 and cfg.reward_funcs == ["accuracy"]
    assert cfg.beta == 0.0 and cfg.report_to == [] and cfg.temperature == 0.6


def test_override_parsing():
    assert parse_override("lora_target_modules=[q_proj, v_proj]") == ("lora_target_modules", ["q_proj", "v_proj"])
    with pytest.raises(ConfigError, match="must look like key=value"):
        parse_override("beta")


def test_resolved_config_round_trips(tmp_path):
    cfg = GRPOConfig.from_dict({"beta": 0.0, "num_generations": 4})
    cfg.save(tmp_path / "config.yaml")
    again = GRPOConfig.load(tmp_path / "config.yaml")
    assert again == cfg


def test_reference_lists_every_key():
    from grpo.config.trl_fields import NAMES, settings

    text = config_reference()
    for f in settings(GRPOConfig):
        assert f"| `{f.name}` |" in text
    assert not any(f"| `{name}` |" in text for name in NAMES)  # TRL's keys without a setting: docs/from_trl.md


def test_docs_config_md_is_generated_from_the_dataclass():
    from pathlib import Path

    path = Path(__file__).parent.parent / "docs" / "config.md"
    assert path.read_text() == config_reference(), "docs/config.md is stale: run `grpo train --help-config > docs/config.md`"


def test_a_shipped_model_is_named_by_its_name_unless_a_directory_of_that_name_exists(tmp_path, monkeypatch):
    from grpo.config.base import ASSETS

    assert GRPOConfig(model_name_or_path="tiny-tools").model_name_or_path == str(ASSETS / "tiny-tools")
    assert GRPOConfig(model_name_or_path="Qwen/Qwen2.5-0.5B").model_name_or_path == "Qwen/Qwen2.5-0.5B"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-tools").mkdir()  # the user's own directory wins
    assert GRPOConfig(model_name_or_path="tiny-tools").model_name_or_path == "tiny-tools"
