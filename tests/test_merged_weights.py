"""The whole weights handed to an engine that keeps its own copy (vLLM) or written as a sharded run's merged final/
(`grpo.engines.sharding.hf_weights`): a plain model loaded from them gives the adapted policy's logits, for LoRA and
for DoRA, whose merged weight rescales each output row by its magnitude vector."""

from __future__ import annotations

import pytest
import torch

from grpo.engines.sharding import hf_weights


def _tiny():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return Qwen2ForCausalLM(config).eval()


def _trained_adapter(use_dora: bool):
    """A LoRA / DoRA policy whose adapters and magnitudes moved off their initial values (B = 0 at init would make
    every merge trivially the base)."""
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(_tiny(), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0,
                                                use_dora=use_dora))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
            elif "lora_magnitude_vector" in name:
                p.mul_(1 + 0.3 * torch.rand_like(p))
    return policy.eval()


@pytest.mark.parametrize("use_dora", [False, True])
def test_a_model_loaded_from_hf_weights_gives_the_adapted_policys_logits(use_dora):
    policy = _trained_adapter(use_dora)
    plain = _tiny()
    weights = dict(hf_weights(policy))
    assert not any("lora_" in k or "base_layer" in k for k in weights)
    missing, unexpected = plain.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # (untied: present; the check is of names)
    ids = torch.randint(0, 64, (3, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, got = policy(input_ids=ids).logits, plain(input_ids=ids).logits
        base = policy.get_base_model()
        with policy.disable_adapter():
            unadapted = base(input_ids=ids).logits
    assert (want - unadapted).abs().max() > 0.1  # the adapters change the logits a lot, so the check below can fail
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)  # before the DoRA fix: off by ~1 (magnitude left out)
