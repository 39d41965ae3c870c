"""The lean decode step and the preallocated cache give what transformers' own forward gives, token for token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import grpo.engines.cpu.decoding as decoding
import grpo.engines.cpu.sampler as generation
import grpo.engines.sampling as sampling
from grpo.engines.base import SamplingParams
from grpo.engines.cpu.decoding import LeanDecoder, packed_head
from grpo.engines.cpu.sampler import CPUSampler
from grpo.engines.kv_cache import preallocated_cache


def tiny(kind: str):
    torch.manual_seed(0)
    common = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)  # 2 query heads per key/value head
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True)).eval()
    return LlamaForCausalLM(LlamaConfig(**common, attention_bias=True,
                                        rope_scaling={"rope_type": "linear", "factor": 2.0})).eval()


def prompts():
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5], [0, 9, 8, 7, 6]])  # rows 0 and 2 left-padded
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    return ids, mask


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("fuse", [True, False], ids=["fused-weights", "module-weights"])
@torch.no_grad()
def test_lean_steps_match_the_stock_forward(kind, fuse, monkeypatch):
    if not fuse:  # as for a model too big to copy its projections into fused matrices
        monkeypatch.setattr(decoding, "_FUSE_BYTES", 0)
    model = tiny(kind)
    assert LeanDecoder.supports(model)
    ids, mask = prompts()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    stock = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    cache = preallocated_cache(model, ids.shape[1] + 6)
    ours = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, past_key_values=cache)
    torch.testing.assert_close(ours.logits, stock.logits)
    decoder, head = LeanDecoder(model), model.get_output_embeddings()
    assert (decoder.fused[0] is not None) == fuse
    key_mask = torch.cat([mask.bool(), torch.ones(3, 6, dtype=torch.bool)], dim=1)
    pos, kv = positions[:, -1:], stock.past_key_values
    for t, token in enumerate([[3], [4], [5], [6]]):
        token = torch.tensor(token).repeat(3, 1) + torch.arange(3)[:, None]
        mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], dim=1)
        pos = pos + 1
        step = model(input_ids=token, attention_mask=mask, position_ids=pos, past_key_values=kv, use_cache=True)
        kv = step.past_key_values
        hidden = decoder.hidden(token, pos, cache, key_mask[:, :ids.shape[1] + t + 1])
        torch.testing.assert_close(F.linear(hidden, head.weight), step.logits[:, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_generation_is_the_same_with_and_without_the_lean_path(kind, monkeypatch):
    model = tiny(kind)
    ids = [[5, 6, 7], [1, 2, 3, 4, 5], [9, 8, 7, 6]]
    params = SamplingParams(12, temperature=1.0)
    fast = CPUSampler(model, pad_id=0, eos_ids=[49]).generate(ids, params, seeds=[1, 2, 3])
    monkeypatch.setattr(generation.LeanDecoder, "supports", staticmethod(lambda m: False))
    monkeypatch.setattr(sampling, "preallocated_cache", lambda m, c: None)
    slow = CPUSampler(model, pad_id=0, eos_ids=[49]).generate(ids, params, seeds=[1, 2, 3])
    assert fast.ids == slow.ids
    for a, b in zip(fast.logprobs, slow.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-5)


def test_lora_adapters_are_applied_in_the_lean_steps(monkeypatch):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny("qwen2"), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    for name, param in model.named_parameters():
        if "lora_B" in name:  # B starts at zero; make the adapters change the outputs
            torch.nn.init.normal_(param, std=0.5)
    model.eval()
    ids, params = [[5, 6, 7], [1, 2, 3, 4, 5]], SamplingParams(10)
    fast = CPUSampler(model, pad_id=0, eos_ids=[49]).generate(ids, params, seeds=[1, 2])
    monkeypatch.setattr(generation.LeanDecoder, "supports", staticmethod(lambda m: False))
    slow = CPUSampler(model, pad_id=0, eos_ids=[49]).generate(ids, params, seeds=[1, 2])
    assert fast.ids == slow.ids
    with model.disable_adapter():
        plain = CPUSampler(model, pad_id=0, eos_ids=[49]).generate(ids, params, seeds=[1, 2])
    assert plain.ids != fast.ids  # the adapters matter, so the equality above means they were applied


def test_unsupported_models_keep_the_stock_forward():
    sliding = Qwen2ForCausalLM(Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                                           sliding_window=4, max_window_layers=0))
    assert not LeanDecoder.supports(sliding)
    assert not LeanDecoder.supports(torch.nn.Linear(2, 2))


def test_packed_head_equals_linear_and_cache_capacity_is_enforced():
    torch.manual_seed(0)
    weight, bias, h = torch.randn(300, 16), torch.randn(300), torch.randn(4, 16)
    torch.testing.assert_close(packed_head(weight, bias, 4)(h), F.linear(h, weight, bias), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed_head(weight, None, 4)(h), F.linear(h, weight), atol=1e-5, rtol=1e-5)
    model = tiny("qwen2")
    cache = preallocated_cache(model, 4)
    with pytest.raises(RuntimeError, match="exceed the capacity 4"):
        model(input_ids=torch.ones(1, 5, dtype=torch.long), past_key_values=cache, use_cache=True)


def test_norm_and_rotary_are_bit_identical_to_transformers():
    """The lean step's RMSNorm and its joint q/k rotation compute exactly what transformers' Llama-family modules
    compute (same operations in the same order), so the lean and stock steps differ only in matmul rounding."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm, apply_rotary_pos_emb

    from grpo.engines.cpu.decoding import _rms_norm, _rotate

    torch.manual_seed(0)
    norm = Qwen2RMSNorm(64, eps=1e-6)
    norm.weight.data.normal_()
    x = torch.randn(16, 1, 64)
    assert torch.equal(_rms_norm(norm, x), norm(x))
    qk = torch.randn(16, 1, 6, 32)  # 4 query heads then 2 key heads, as they leave the fused q/k/v product
    cos, sin = torch.randn(16, 1, 32), torch.randn(16, 1, 32)
    q, k = apply_rotary_pos_emb(qk[:, :, :4].transpose(1, 2), qk[:, :, 4:].transpose(1, 2), cos, sin)
    ours = _rotate(qk, cos, sin)
    assert torch.equal(ours[:, :, :4].transpose(1, 2), q) and torch.equal(ours[:, :, 4:].transpose(1, 2), k)
