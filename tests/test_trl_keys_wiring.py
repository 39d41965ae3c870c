"""TRL keys grpo implements besides the loss: each one changes what it says (a trainer built on the tiny model, a
step where it takes one), and the cadence of logging, evaluation and saving reads TRL's strategies and ratios."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.config import ConfigError
from grpo.training.run.control import Cadence


def reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def trainer(model_dir, tmp_path, data=None, **values):
    funcs = values.pop("reward_funcs", reward)
    cfg = GRPOConfig(**{"output_dir": str(tmp_path / "run"), "num_generations": 2, "per_device_train_batch_size": 2,
                        "max_completion_length": 4, "max_steps": 1, "report_to": [], **values})
    data = data or Dataset.from_dict({"prompt": [f"q{i}\n" for i in range(6)]})
    return GRPOTrainer(model=model_dir, reward_funcs=funcs, args=cfg, train_dataset=data)


def test_prompt_order_keys(tiny_model_dir, tmp_path):
    ordered = trainer(tiny_model_dir, tmp_path, shuffle_dataset=False)
    assert ordered.sampler.next(6) == [0, 1, 2, 3, 4, 5]
    seeded = [trainer(tiny_model_dir, tmp_path / str(s), data_seed=s).sampler.next(6) for s in (1, 1, 2)]
    assert seeded[0] == seeded[1] != seeded[2] and sorted(seeded[2]) == list(range(6))


def test_remove_unused_columns_keeps_the_other_columns_from_the_rewards(tiny_model_dir, tmp_path):
    data = Dataset.from_dict({"prompt": ["q\n"] * 2, "answer": ["1", "2"]})
    assert trainer(tiny_model_dir, tmp_path, data).train_set.columns == {"answer": ["1", "2"]}
    assert trainer(tiny_model_dir, tmp_path, data, remove_unused_columns=True).train_set.columns == {}


def test_chat_template_and_its_kwargs(tiny_model_dir, tmp_path):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ '|' + mark if mark else '' }}"
    t = trainer(tiny_model_dir, tmp_path, chat_template=template, chat_template_kwargs={"mark": "K"},
                data=Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]] * 2}))
    assert t.tokenizer.chat_template == template
    assert t.tokenizer.decode(t.train_set.prompt_ids[0]) == "hi|K"


def test_generation_and_model_init_kwargs(tiny_model_dir, tmp_path):
    t = trainer(tiny_model_dir, tmp_path, generation_kwargs={"top_k": 5, "max_new_tokens": 3},
                model_init_kwargs={"attn_implementation": "eager"})
    assert (t.params.top_k, t.params.max_new_tokens) == (5, 3)
    assert t.policy.config._attn_implementation == "eager"


def test_lora_options_and_disable_dropout(tiny_model_dir, tmp_path):
    t = trainer(tiny_model_dir, tmp_path, use_peft=True, lora_r=4, lora_dropout=0.3, use_rslora=True,
                lora_modules_to_save=["norm"], disable_dropout=True)
    lora = t.policy.peft_config["default"]
    assert lora.use_rslora and "norm" in lora.modules_to_save
    assert all(m.p == 0.0 for m in t.policy.modules() if isinstance(m, torch.nn.Dropout))


def test_log_level_disable_tqdm_and_logging_dir(tiny_model_dir, tmp_path, capsys):
    t = trainer(tiny_model_dir, tmp_path, log_level="debug", disable_tqdm=True, report_to=["tensorboard"],
                logging_dir=str(tmp_path / "tb"))
    assert logging.getLogger("grpo").level == logging.DEBUG
    t.train()
    assert "step 1/1" not in capsys.readouterr().out  # no live display
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_trackio_gets_the_metrics(tiny_model_dir, tmp_path, monkeypatch):
    logged = []
    trl_keys = {"train/loss", "train/reward"}
    fake = types.SimpleNamespace(init=lambda **kw: logged.append(("init", kw["project"], kw["name"])) or
                                 types.SimpleNamespace(log=lambda m, step: logged.append(("log", step,
                                                                                         trl_keys <= set(m))),
                                                       finish=lambda: logged.append(("finish",))))
    monkeypatch.setitem(sys.modules, "trackio", fake)
    trainer(tiny_model_dir, tmp_path, report_to="trackio", project="p", run_name="r").train()
    assert logged == [("init", "p", "r"), ("log", 1, True), ("finish",)]  # (TRL's keys, as transformers logs them)


def test_precision_and_kernels_refused_where_they_cannot_run(tiny_model_dir, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU machine runs them")
    with pytest.raises(ConfigError, match="fp16: float16 mixed precision needs a CUDA GPU"):
        trainer(tiny_model_dir, tmp_path, fp16=True, bf16=False)
    with pytest.raises(ConfigError, match="use_liger_kernel: liger-kernel is not installed"):
        trainer(tiny_model_dir, tmp_path, use_liger_kernel=True)


def test_bf16_is_mixed_precision_over_float32_weights(tiny_model_dir, tmp_path):
    def alternate(completions, **kwargs):  # 0, 1 in each group of 2: advantages of -0.7 and 0.7
        return [float(i % 2) for i in range(len(completions))]

    t = trainer(tiny_model_dir, tmp_path, bf16=True, reward_funcs=alternate)
    assert t.accel.mixed_precision == "bf16" and t.engine.name == "transformers"
    assert next(t.policy.parameters()).dtype == torch.float32  # TRL's meaning: the weights stay float32
    assert t.train_step()["train/grad_norm"] > 0


def test_cadence_reads_strategies_and_ratios():
    cfg = GRPOConfig(logging_steps=0.25, save_steps=0.5, eval_steps=None, logging_first_step=True)
    cadence = Cadence(cfg, steps_per_epoch=4, total=8)
    assert [s for s in range(1, 9) if cadence.log(s)] == [1, 2, 4, 6, 8]  # every 2 (a quarter of 8) and the first
    assert [s for s in range(1, 9) if cadence.save(s)] == [4, 8]  # every 4, and the last (transformers' Trainer)
    assert [s for s in range(1, 9) if cadence.evaluate(s, True)] == [2, 4, 6, 8]  # eval_steps null: logging_steps
    epochs = Cadence(GRPOConfig(logging_strategy="epoch", save_strategy="epoch", eval_strategy="epoch"), 3, 7)
    assert [s for s in range(1, 8) if epochs.log(s)] == [3, 6, 7]
    assert [s for s in range(1, 8) if epochs.save(s)] == [3, 6, 7]  # (the last, partial epoch ends at 7)
    assert not any(Cadence(GRPOConfig(eval_strategy="no", logging_strategy="no"), 3, 7).evaluate(s, True)
                   for s in range(1, 8))
    samples = Cadence(GRPOConfig(log_completions=True, logging_steps=3), 10, 10)
    assert [s for s in range(1, 11) if samples.samples(s)] == [3, 6, 9, 10]
