"""The compiled decode step (grpo/csrc/lean_step.c) gives what the torch lean step gives, and falls back cleanly."""

from __future__ import annotations

import ctypes
import shutil

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from grpo import native
from grpo.decoding import LeanDecoder, _CompiledHead, _CompiledStep, packed_head, preallocated_cache
from grpo.generation import SamplingParams, TransformersGenerator

needs_compiler = pytest.mark.skipif(native.library() is None, reason="no C compiler: the compiled step is not built")


def tiny(kind: str, hidden: int = 48, inter: int = 72):
    """Sizes that are not multiples of the C kernel's blocks (8 rows, 32 columns), grouped-query attention."""
    torch.manual_seed(0)
    common = dict(vocab_size=61, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if kind == "qwen2":  # q/k/v biases
        return Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True)).eval()
    return LlamaForCausalLM(LlamaConfig(**common, attention_bias=True, mlp_bias=True,  # biases everywhere
                                        rope_scaling={"rope_type": "linear", "factor": 2.0})).eval()


def prefilled(model, ids, mask, extra):
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = preallocated_cache(model, ids.shape[1] + extra)
    model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, past_key_values=cache)
    return cache, positions[:, -1:]


@needs_compiler
@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("rows", [5, 9])  # not multiples of the kernel's 8 rows
@torch.no_grad()
def test_compiled_step_matches_the_torch_step(kind, rows):
    model = tiny(kind)
    torch.manual_seed(1)
    ids = torch.randint(1, 61, (rows, 6))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: masked keys
    mask[rows - 1, :1] = 0
    extra = 5
    torch_cache, pos = prefilled(model, ids, mask, extra)
    c_cache, _ = prefilled(model, ids, mask, extra)
    decoder = LeanDecoder(model)
    step = decoder.compiled(c_cache, rows)
    assert isinstance(step, _CompiledStep)
    key_mask = torch.cat([mask.bool(), torch.ones(rows, extra, dtype=torch.bool)], dim=1)
    tokens = torch.randint(1, 61, (rows, 1))
    for t in range(extra):
        pos = pos + 1
        visible = key_mask[:, :ids.shape[1] + t + 1]
        expected = decoder.hidden(tokens, pos, torch_cache, visible)
        got = step(tokens, pos, c_cache, visible)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
        for a, b in zip(torch_cache.layers, c_cache.layers):  # the keys and values it wrote
            assert a.length == b.length
            torch.testing.assert_close(b.key_buffer[:, :, :b.length], a.key_buffer[:, :, :a.length])
            torch.testing.assert_close(b.value_buffer[:, :, :b.length], a.value_buffer[:, :, :a.length])
        tokens = (tokens * 7 + t) % 61
    with pytest.raises(RuntimeError, match="capacity"):
        step(tokens, pos + 1, c_cache, None)


@needs_compiler
def test_generation_is_the_same_with_the_compiled_and_the_torch_step(monkeypatch):
    model = tiny("qwen2")
    ids = [[5, 6, 7], [1, 2, 3, 4, 5], [9, 8, 7, 6]]
    params = SamplingParams(12, temperature=1.0)
    used = []
    compiled = LeanDecoder.compiled
    monkeypatch.setattr(LeanDecoder, "compiled", lambda self, c, n: used.append(1) or compiled(self, c, n))
    fast = TransformersGenerator(model, pad_id=0, eos_ids=[60]).generate(ids, params, seeds=[1, 2, 3])
    assert used
    monkeypatch.setattr(LeanDecoder, "compiled", lambda self, c, n: None)
    plain = TransformersGenerator(model, pad_id=0, eos_ids=[60]).generate(ids, params, seeds=[1, 2, 3])
    assert fast.ids == plain.ids
    for a, b in zip(fast.logprobs, plain.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-5)


@needs_compiler
@torch.no_grad()
def test_compiled_step_is_not_used_where_it_does_not_apply(monkeypatch):
    ids, mask = torch.tensor([[1, 2, 3]]), torch.ones(1, 3, dtype=torch.long)
    model = tiny("qwen2")
    cache, _ = prefilled(model, ids, mask, 2)
    assert LeanDecoder(model).compiled(cache, 1) is not None
    assert LeanDecoder(model).compiled(preallocated_cache(model, 5), 1) is None  # not prefilled
    model.config.hidden_act = "gelu"
    assert LeanDecoder(model).compiled(cache, 1) is None
    model.config.hidden_act = "silu"
    from peft import LoraConfig, get_peft_model  # LoRA-wrapped projections run as modules: the torch step

    lora = get_peft_model(tiny("qwen2"), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    lora_cache, _ = prefilled(lora, ids, mask, 2)
    assert LeanDecoder(lora).compiled(lora_cache, 1) is None
    big = tiny("qwen2").double()
    big_cache, _ = prefilled(big, ids, mask, 2)
    assert LeanDecoder(big).compiled(big_cache, 1) is None  # float64
    monkeypatch.setattr("grpo.decoding._COMPILED_ANY_THREADS_BYTES", 0)  # "large" layers: one thread only
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert LeanDecoder(model).compiled(cache, 1) is None
        torch.set_num_threads(1)
        assert LeanDecoder(model).compiled(cache, 1) is not None
    finally:
        torch.set_num_threads(threads)


def test_library_is_built_atomically_once_and_falls_back_without_a_compiler(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("GRPO_CACHE_DIR", str(tmp_path))
    native.library.cache_clear()
    try:
        monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
        assert native.library() is None  # the build fails: a warning, and the torch step
        assert "could not build" in caplog.text
        assert not list((tmp_path / "native").glob("*"))  # no half-written file left behind
        native.library.cache_clear()
        monkeypatch.setenv("GRPO_NATIVE", "0")
        assert native.library() is None
        native.library.cache_clear()
        monkeypatch.delenv("GRPO_NATIVE")
        compiler = shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            pytest.skip("no C compiler")
        monkeypatch.setenv("CC", compiler)
        assert native.library() is not None
        built = list((tmp_path / "native").glob("*"))
        assert len(built) == 1 and built[0].suffix == ".so"
    finally:
        native.library.cache_clear()


@needs_compiler
@pytest.mark.parametrize("rows", [5, 20])  # one partial block of 16 rows; a full block and a partial one
@pytest.mark.parametrize("with_bias", [True, False])
def test_compiled_head_equals_linear(rows, with_bias, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # the compiled head is for one intra-op thread
    torch.manual_seed(0)
    weight, h = torch.randn(37, 24), torch.randn(rows, 24)  # 37: the last panel of 16 entries is partial
    bias = torch.randn(37) if with_bias else None
    head = packed_head(weight, bias, rows)
    assert isinstance(head, _CompiledHead)
    torch.testing.assert_close(head(h), F.linear(h, weight, bias), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head(h[:3]), F.linear(h[:3], weight, bias), atol=1e-5, rtol=1e-5)  # other rows


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_portable_build_without_avx512_gives_the_same_products(tmp_path):
    # The plain C paths (what a CPU without AVX-512 compiles) against the product they replace.
    compiler = shutil.which("cc") or shutil.which("gcc")
    target = tmp_path / "portable.so"
    native._build(compiler, target, [*native.FLAGS, "-mno-avx512f"] if native._x86() else native.FLAGS)
    lib = native._declare(ctypes.CDLL(str(target)))
    torch.manual_seed(0)
    weight, h, bias = torch.randn(37, 24), torch.randn(20, 24), torch.randn(37)
    head = _CompiledHead(lib, weight, bias, 20)
    torch.testing.assert_close(head(h), F.linear(h, weight, bias), atol=1e-5, rtol=1e-5)
