"""TRL's and open-r1's config keys (grpo.config.trl_keys): every field of TRL 1.16's GRPOConfig is accepted or
refused by name, with TRL's defaults and values; `preset: trl`; a whole trl.GRPOConfig as `args`; the generated
docs/from_trl.md."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest

from grpo.config import LOSS_TYPES, ConfigError, GRPOConfig, from_trl
from grpo.config.reference import WHY_OURS, differing_defaults, from_trl_reference
from grpo.config.trl_keys import TABLE, TRL_KEYS, accepts, canonical

trl = pytest.importorskip("trl")  # CI installs it (bench/requirements.txt)


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def _trl_fields() -> list[tuple[dataclasses.Field, str]]:
    import transformers

    ta = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    return [(f, "ta" if f.name in ta else "trl") for f in dataclasses.fields(trl.GRPOConfig)]


def _other(value):
    """A value of the same kind that is not `value`."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 7
    if isinstance(value, float):
        return value + 0.5
    if isinstance(value, str):
        return value + "-other"
    if isinstance(value, list):
        return ["other"]
    if isinstance(value, dict):
        return {"other": 1}
    return "other"


def test_every_trl_grpoconfig_field_has_a_row_with_trls_default():
    fields = _trl_fields()
    assert sum(source == "trl" for _, source in fields) == 77 and sum(s == "ta" for _, s in fields) == 114
    for f, source in fields:
        row = TRL_KEYS.get(f.name)
        assert row is not None, f"{f.name} ({source}) has no row in grpo/config/trl_keys.py"
        assert row.source == source, f.name
        assert accepts(row, _default(f)), (f.name, row.default, _default(f))
    for cls, source in ((trl.ModelConfig, "model"), (trl.ScriptArguments, "script")):
        for f in dataclasses.fields(cls):
            row = TRL_KEYS.get(f.name)
            assert row is not None and row.source == source, f.name
            assert accepts(row, _default(f)), f.name


def test_trls_agent_arguments_are_implemented_rows():
    import inspect

    agent = {"tools", "environment_factory", "rollout_func"}
    from grpo import GRPOTrainer

    theirs = list(inspect.signature(trl.GRPOTrainer.__init__).parameters)
    ours = list(inspect.signature(GRPOTrainer.__init__).parameters)
    assert agent <= set(theirs) and ours[:len(theirs)] == theirs  # positional in TRL's order
    rows = {row.name: row for row in TABLE if row.source == "trainer"}
    assert set(rows) == agent and all(row.kind == "field" for row in rows.values())
    assert TRL_KEYS["max_tool_calling_iterations"].kind == "field"
    cfg = from_trl(trl.GRPOConfig(output_dir="x", use_cpu=True, max_tool_calling_iterations=3, report_to="none"))
    assert cfg.max_tool_calling_iterations == 3  # TRL's value, read as a field (it was refused before agents)
    assert GRPOConfig(tools=["calculator"], rollout_func=None).tools == ["calculator"]


@pytest.mark.parametrize("name", [f.name for f, _ in _trl_fields()])
def test_every_field_is_accepted_at_trls_default(name):
    f = next(f for f, _ in _trl_fields() if f.name == name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = GRPOConfig(**{name: _default(f)})
    assert getattr(cfg, name) is not None or _default(f) is None or name in ("bf16",)


# Keys with two values, both of which are grpo's behaviour (or TRL's own derived value, as dataloader_pin_memory
# under use_cpu): either is accepted.
EITHER = {"logging_nan_inf_filter", "hub_always_push", "dataloader_pin_memory", "do_train"}


@pytest.mark.parametrize("row", [r for r in TABLE if r.kind == "default"], ids=lambda r: r.name)
def test_keys_not_built_are_refused_by_name_with_the_reason(row):
    value = _other(row.default)
    if row.name in EITHER:
        assert accepts(row, value) and GRPOConfig(**{row.name: value}).__getattr__(row.name) == value
        return
    assert not accepts(row, value)
    with pytest.raises(ConfigError) as err:
        GRPOConfig(**{row.name: value})
    message = str(err.value)
    assert message.startswith(f"{row.name}: ") and row.note in message and "leave it at" in message
    assert "\n" not in message


def test_an_unknown_key_is_refused_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"unknown config key 'per_device_train_batchsize' \(did you mean "
                                          r"'per_device_train_batch_size'\?\)"):
        GRPOConfig(per_device_train_batchsize=4)


def test_trl_value_forms_are_read_as_trl_means_them():
    assert GRPOConfig(scale_rewards=False).scale_rewards == "none"
    assert GRPOConfig(scale_rewards=True).scale_rewards == "group"
    assert GRPOConfig(report_to="none").report_to == []
    assert "tensorboard" in GRPOConfig(report_to="all").report_to
    assert GRPOConfig(warmup_steps=0.1).warmup_steps == 0.1 and GRPOConfig(warmup_steps=5.0).warmup_steps == 5
    assert GRPOConfig(bf16=None).bf16 is True and GRPOConfig(bf16=None, fp16=True).bf16 is False
    assert GRPOConfig("out-dir").output_dir == "out-dir"  # TRL takes output_dir first
    cfg = GRPOConfig(generation_kwargs={"temperature": 0.5, "max_new_tokens": 12})
    assert cfg.temperature == 0.5 and cfg.max_completion_length == 12
    with pytest.raises(ConfigError, match="generation_kwargs: 'length_penalty' is not a setting"):
        GRPOConfig(generation_kwargs={"length_penalty": -0.1})
    with pytest.raises(ConfigError, match="cosine_with_min_lr needs one of min_lr or min_lr_rate"):
        GRPOConfig(lr_scheduler_type="cosine_with_min_lr")
    assert GRPOConfig(optim="adamw_torch").optim == "adamw_torch"  # (grpo's AdamW either way)


def test_loss_type_sets_aggregation_and_surrogate_and_refuses_a_contradiction():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (luspo warns without a sequence-level ratio, as TRL does)
        for loss_type, (aggregation, surrogate) in LOSS_TYPES.items():
            cfg = GRPOConfig(loss_type=loss_type)
            assert (cfg.loss_aggregation, cfg.surrogate) == (aggregation, surrogate), loss_type
    with pytest.raises(ConfigError, match="loss_type: 'dapo' means loss_aggregation='rollout_token_mean'"):
        GRPOConfig(loss_type="dapo", loss_aggregation="sequence_mean")
    assert GRPOConfig(preset="trl", loss_aggregation="sequence_mean").loss_type is None  # hand-set pair wins


def test_preset_trl_gives_trls_defaults_to_every_key_not_set():
    cfg = GRPOConfig(preset="trl", learning_rate=3e-6)
    same = {"output_dir": "trainer_output", "bf16": True, "min_p": 0.0, "report_to": [], "model_name_or_path": None,
            "gradient_accumulation_steps": None, "torch_dtype": "float32", "reward_funcs": [], "epsilon_high": 0.2}
    for row in TABLE:
        if row.kind != "field" or row.source not in ("trl", "ta") or row.name == "learning_rate":
            continue
        want = same.get(row.name, row.default)
        if row.name == "model_name_or_path":
            continue
        assert canonical(getattr(cfg, row.name)) == want, row.name
    assert cfg.learning_rate == 3e-6 and cfg.task is None and cfg.use_chat_template is False


def test_a_whole_trl_config_keeps_trls_values():
    t = trl.GRPOConfig(output_dir="out", use_cpu=True, beta=0.1, loss_type="bnpo", lr_scheduler_type="cosine",
                       per_device_train_batch_size=4, gradient_accumulation_steps=2, steps_per_generation=4,
                       num_generations=4, report_to="none")
    for cfg in (from_trl(t), GRPOConfig(**dataclasses.asdict(t))):
        assert (cfg.beta, cfg.loss_aggregation, cfg.surrogate) == (0.1, "micro_batch_token_mean", "clip")
        assert (cfg.lr_scheduler_type, cfg.max_completion_length, cfg.num_train_epochs) == ("cosine", 512, 3.0)
        assert (cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps, cfg.steps_per_generation) == (4, 2, 4)
        assert cfg.use_bias_correction_kl is True and cfg.gradient_checkpointing is True and cfg.bf16 is True
    assert from_trl(t).task is None  # (preset trl: TRL has no built-in task)


def test_open_r1_keys():
    cfg = GRPOConfig(dataset_prompt_column="problem", cosine_max_len=500, hub_model_revision="v1",
                     wandb_project="p", code_language="cpp")
    assert (cfg.prompt_column, cfg.hub_revision, cfg.wandb_project) == ("problem", "v1", "p")
    assert cfg.open_r1_rewards == {"cosine_max_len": 500, "code_language": "cpp"}
    assert cfg.cosine_max_len == 500 and cfg.repetition_n_grams == 3  # read as open-r1 does
    again = GRPOConfig(**cfg.to_dict())
    assert again == cfg


def test_docs_from_trl_md_is_generated_from_the_table():
    path = Path(__file__).parent.parent / "docs" / "from_trl.md"
    assert path.read_text() == from_trl_reference(), "docs/from_trl.md is stale: run `python -m grpo.config.reference`"


def test_every_default_that_differs_from_trls_has_a_reason():
    differing = differing_defaults()
    assert {"beta", "loss_type", "max_completion_length", "lr_scheduler_type"} <= {k for k, _, _ in differing}
    for key, ours, theirs in differing:
        assert WHY_OURS.get(key), f"{key}: ours {ours!r}, TRL's {theirs!r}: say why in WHY_OURS"


def test_the_readme_lists_every_default_that_differs():
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    section = readme[readme.index("## Coming from TRL"):readme.index("## A real model on a GPU")]
    missing = [key for key, _, _ in differing_defaults() if f"`{key}`" not in section and key not in (
        "model_name_or_path", "reward_funcs", "torch_dtype")]  # (ours: the shipped model and the task's rewards)
    assert not missing, f"README's Coming from TRL table lacks {missing}"


def test_a_data_file_with_a_task_takes_the_tasks_prefill():
    assert GRPOConfig(dataset_name="data.jsonl").task is None  # a data file of its own
    assert GRPOConfig(dataset_name="data.jsonl", task="arithmetic").task == "arithmetic"


def test_num_beams_is_refused_with_its_reason_and_continuous_batching_is_accepted():
    """TRL hands generation_kwargs' num_beams to generate (beam sampling); grpo refuses it, saying why. TRL's
    continuous-batching keys (the docs example) change nothing here: grpo's samplers batch each rollout."""
    with pytest.raises(ConfigError, match=r"generation_kwargs: num_beams=2 is beam search: .* not samples of the "
                                          r"policy"):
        GRPOConfig(generation_kwargs={"do_sample": True, "num_beams": 2})
    cfg = GRPOConfig(generation_kwargs={"num_beams": 1, "top_k": 5}, use_transformers_continuous_batching=True,
                     transformers_continuous_batching_config={"num_blocks": 64, "max_batch_tokens": 256})
    assert cfg.top_k == 5 and cfg.transformers_continuous_batching_config == {"num_blocks": 64,
                                                                             "max_batch_tokens": 256}
    with pytest.raises(ConfigError, match="transformers_continuous_batching_config: 8 must be a mapping"):
        GRPOConfig(transformers_continuous_batching_config=8)
