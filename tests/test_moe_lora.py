"""LoRA on an MoE's experts (`lora_target_parameters`, TRL's key; peft's `target_parameters`): transformers 5 stacks
each layer's experts in one parameter (E, out, in), which peft wraps with a low-rank update per expert."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file

from grpo import GRPOConfig, GRPOTrainer
from grpo.config import ConfigError

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def length(completions, **kwargs):
    return [len(c) / 8 for c in completions]


def trainer_for(out, **overrides):
    values = dict(output_dir=str(out), model_name_or_path="tiny-moe", task=None, num_generations=4,
                  prompts_per_step=2, max_completion_length=8, learning_rate=5e-2, max_steps=2, save_steps=0,
                  report_to=[], log_completions_steps=0, seed=0, per_device_train_batch_size=4, use_peft=True,
                  lora_target_modules=["q_proj"], lora_target_parameters=EXPERTS, lora_dropout=0.0)
    values.update(overrides)
    return GRPOTrainer(reward_funcs=[length], args=GRPOConfig(**values),
                       train_dataset=Dataset.from_dict({"prompt": [f"q{i}\n" for i in range(8)]}))


def test_lora_on_the_experts_trains_saves_and_merges(tmp_path):
    """Adapters on every layer's stacked experts train (their B matrices, zero at start, move) while the experts'
    own weights stay frozen; the adapter file holds them; final/ is the merged model, whose experts differ from
    tiny-moe's by the adapters' update and whose other weights do not move (only q_proj has adapters besides)."""
    from transformers import AutoModelForCausalLM

    from grpo.config.base import ASSETS

    trainer = trainer_for(tmp_path / "run")
    policy = trainer.policy
    experts = {n: p for n, p in policy.named_parameters() if "experts" in n}
    trainable = {n for n, p in experts.items() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)  # (the stacked experts themselves are frozen)
    layers = policy.get_base_model().config.num_hidden_layers
    assert len([n for n in trainable if "lora_B" in n]) == 2 * layers  # (gate_up_proj and down_proj, each layer)
    trainer.train()
    assert all(experts[n].abs().max() > 0 for n in trainable if "lora_B" in n)
    adapter = load_file(str(tmp_path / "run" / "final" / "adapter" / "adapter_model.safetensors"))
    assert any("experts" in k and "lora_B" in k for k in adapter)
    base = AutoModelForCausalLM.from_pretrained(ASSETS / "tiny-moe")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    for layer_base, layer_merged in zip(base.model.layers, merged.model.layers):
        assert (layer_merged.mlp.experts.gate_up_proj - layer_base.mlp.experts.gate_up_proj).abs().max() > 1e-6
        assert (layer_merged.mlp.experts.down_proj - layer_base.mlp.experts.down_proj).abs().max() > 1e-6
        assert torch.equal(layer_merged.mlp.gate.weight, layer_base.mlp.gate.weight)
        assert torch.equal(layer_merged.self_attn.k_proj.weight, layer_base.self_attn.k_proj.weight)


def test_a_parameter_the_model_lacks_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match="lora_target_parameters"):
        trainer_for(tmp_path / "run", lora_target_parameters=["mlp.experts.no_such_proj"])
