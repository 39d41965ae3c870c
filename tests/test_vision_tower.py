"""freeze_vision_tower (verl's key) on the tiny vision model: the vision side (Qwen2-VL's `model.visual`, its tower
and merger) frozen or trained, in full fine-tuning and under LoRA."""

from __future__ import annotations

import pytest
import torch

from grpo.config import ConfigError
from grpo.tasks import get_task
from grpo.training.data.vision import vision_modules
from test_vision import larger_answer, vision_config


def trained(tmp_path, **overrides):
    """(parameter names that require a gradient, names whose values moved in 2 steps) of a run."""
    from grpo.training.trainer import GRPOTrainer

    trainer = GRPOTrainer(args=vision_config(tmp_path, max_completion_length=4, learning_rate=1e-2, **overrides),
                          reward_funcs=larger_answer,
                          train_dataset=get_task("shapes").dataset("train", n=8))
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    trainer.train()
    now = dict(trainer.policy.named_parameters())
    return ({n for n, p in now.items() if p.requires_grad}, {n for n in before if not torch.equal(before[n], now[n])})


def test_the_vision_side_is_the_tower_and_its_merger():
    from transformers import AutoModelForImageTextToText, AutoModelForCausalLM

    assert vision_modules(AutoModelForImageTextToText.from_pretrained("grpo/assets/tiny-vision")) == ["model.visual"]
    assert vision_modules(AutoModelForCausalLM.from_pretrained("grpo/assets/tiny-arith")) == []


def test_frozen_in_full_fine_tuning_the_tower_keeps_its_weights(tmp_path):
    """Without the key the tower trains (test_vision); with it no `model.visual.` weight takes a gradient or moves,
    and the language model's do."""
    grads, moved = trained(tmp_path, freeze_vision_tower=True)
    assert not any(n.startswith("model.visual.") for n in grads | moved)
    assert any(n.startswith("model.language_model.") for n in moved)


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "trained"])
def test_under_lora_the_tower_gets_adapters_only_when_trained(tmp_path, frozen):
    """LoRA on 'all-linear': with the tower frozen, adapters sit on the language model only (none in
    `model.visual.`); trained, the tower's linear layers get adapters too and they move."""
    grads, moved = trained(tmp_path, use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0,
                           freeze_vision_tower=frozen)
    assert grads and all("lora_" in n for n in grads) and moved <= grads
    tower = {n for n in grads if ".visual." in n}
    assert any(".language_model." in n for n in moved)
    if frozen:
        assert not tower
    else:
        assert tower and tower & moved


def test_freezing_a_language_models_tower_is_an_error(tmp_path):
    from grpo.training.trainer import GRPOTrainer

    with pytest.raises(ConfigError, match="freeze_vision_tower: the model is not a vision-language model"):
        GRPOTrainer(args=vision_config(tmp_path, model_name_or_path="tiny-arith", task="arithmetic",
                                       freeze_vision_tower=True))
