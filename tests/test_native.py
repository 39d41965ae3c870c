"""The compiled decode step (engines/cpu/csrc/lean_step.c) gives what the torch lean step gives, and falls back cleanly."""

from __future__ import annotations

import ctypes
import gc
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

import grpo.engines.cpu.sampler as generation
from grpo.engines.head import hidden_logprobs, hidden_loss
from grpo.engines.base import SamplingParams
from grpo.engines.cpu import decoding, native
from grpo.engines.cpu.decoding import LeanDecoder, packed_head
from grpo.engines.cpu.native import CompiledHead, CompiledStep
from grpo.engines.cpu.sampler import CPUSampler
from grpo.engines.kv_cache import preallocated_cache
import tests.test_core_logprobs as core_tests

# With a compiler on the machine the build must succeed (a failure fails these tests instead of skipping them).
needs_compiler = pytest.mark.skipif(
    os.environ.get("GRPO_NATIVE") == "0" or not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")),
    reason="no C compiler (or GRPO_NATIVE=0): the compiled step is not built")


@needs_compiler
def test_the_library_builds_where_there_is_a_compiler():
    assert native.library() is not None


def tiny(kind: str, hidden: int = 48, inter: int = 72, heads: int = 4, kv_heads: int = 2, rope=None):
    """Sizes that are not multiples of the C kernel's blocks (8 rows, 32 columns), grouped-query attention."""
    torch.manual_seed(0)
    common = dict(vocab_size=61, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64)
    if kind == "qwen2":  # q/k/v biases
        return Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True, rope_scaling=rope)).eval()
    if kind == "mistral":
        return MistralForCausalLM(MistralConfig(**common, sliding_window=None)).eval()
    return LlamaForCausalLM(LlamaConfig(**common, attention_bias=True, mlp_bias=True,  # biases everywhere
                                        rope_scaling=rope or {"rope_type": "linear", "factor": 2.0})).eval()


def prefilled(model, ids, mask, extra):
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = preallocated_cache(model, ids.shape[1] + extra)
    model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, past_key_values=cache)
    return cache, positions[:, -1:]


@needs_compiler
@pytest.mark.parametrize("kind,sizes", [("qwen2", {}), ("llama", {}), ("mistral", {}),
                                        ("qwen2", dict(hidden=160, inter=100, heads=2, kv_heads=1))],
                         ids=["qwen2", "llama", "mistral", "qwen2-head_dim-80"])  # head_dim 12, or 80 (> 64)
@pytest.mark.parametrize("rows", [5, 9])  # not multiples of the kernel's 8 rows
@torch.no_grad()
def test_compiled_step_matches_the_torch_step(kind, sizes, rows, lib=None):
    model = tiny(kind, **sizes)
    with torch.no_grad():  # large weights: the softmax and SiLU exponentials see a wide range of arguments
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.mlp.gate_proj.weight.mul_(8)
    torch.manual_seed(1)
    ids = torch.randint(1, 61, (rows, 6))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: masked keys
    mask[rows - 1, :1] = 0
    extra = 5
    torch_cache, pos = prefilled(model, ids, mask, extra)
    c_cache, _ = prefilled(model, ids, mask, extra)
    decoder = LeanDecoder(model)
    step = decoder.compiled(c_cache, rows) if lib is None else CompiledStep(lib, decoder, c_cache, rows)
    assert isinstance(step, CompiledStep)
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
    fast = CPUSampler(model, pad_id=0, eos_ids=[60]).generate(ids, params, seeds=[1, 2, 3])
    assert used
    monkeypatch.setattr(LeanDecoder, "compiled", lambda self, c, n: None)
    plain = CPUSampler(model, pad_id=0, eos_ids=[60]).generate(ids, params, seeds=[1, 2, 3])
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
    from peft import LoraConfig, get_peft_model  # DoRA does not fold into one matrix: its modules, the torch step

    dora = get_peft_model(tiny("qwen2"), LoraConfig(r=2, target_modules=["q_proj", "v_proj"], use_dora=True)).eval()
    dora_cache, _ = prefilled(dora, ids, mask, 2)
    assert LeanDecoder(dora).fused[0] is None and LeanDecoder(dora).compiled(dora_cache, 1) is None
    big = tiny("qwen2").double()
    big_cache, _ = prefilled(big, ids, mask, 2)
    assert LeanDecoder(big).compiled(big_cache, 1) is None  # float64
    monkeypatch.setattr("grpo.engines.cpu.native._ANY_THREADS_BYTES", 0)  # "large" layers: one thread only
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
    # Sampling takes it for a head larger than _SMALL_HEAD where the build has the AVX-512 kernel (without it,
    # oneDNN's product is far faster; a small head is multiplied as it is).
    assert not isinstance(packed_head(weight, bias, rows), CompiledHead)
    monkeypatch.setattr(decoding, "_SMALL_HEAD", 0)
    assert isinstance(packed_head(weight, bias, rows), CompiledHead) == bool(native.library().lean_wide_vectors())
    head = CompiledHead(native.library(), weight, bias, rows)
    torch.testing.assert_close(head(h), F.linear(h, weight, bias), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head(h[:3]), F.linear(h[:3], weight, bias), atol=1e-5, rtol=1e-5)  # other rows


@needs_compiler
def test_compiled_head_packs_into_the_space_it_is_given(monkeypatch):
    """With a space, the packed weight lives in it (whatever it held) and the products are the same as without;
    a space too small is refused, naming its need."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    torch.manual_seed(0)
    weight, h, bias = torch.randn(37, 24), torch.randn(5, 24), torch.randn(37)
    floats = native.packed_floats(native.library(), weight)
    assert floats == 48 * 24  # 37 entries rounded up to 3 panels of 16
    space = torch.full((floats + 7,), float("nan"))
    head = CompiledHead(native.library(), weight, bias, 5, space)
    assert head.packed.data_ptr() == space.data_ptr()
    assert torch.equal(head(h), CompiledHead(native.library(), weight, bias, 5)(h))
    with pytest.raises(ValueError, match=f"at least {floats} elements"):
        CompiledHead(native.library(), weight, bias, 5, space[:floats - 1])


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
@pytest.mark.parametrize("without", [["-mno-avx512f"], ["-mno-avx512f", "-mno-avx2", "-mno-fma"]],
                         ids=["avx2", "plain-c"])
def test_portable_builds_give_the_same_products(without, tmp_path, monkeypatch):
    # The 8-lane (AVX2 and FMA, no AVX-512) and the plain C paths against the products they replace.
    compiler = shutil.which("cc") or shutil.which("gcc")
    target = tmp_path / "portable.so"
    native._build([compiler], target, [*native.FLAGS, *without] if native._x86() else native.FLAGS)
    lib = native._declare(ctypes.CDLL(str(target)))
    torch.manual_seed(0)
    weight, h, bias = torch.randn(37, 24), torch.randn(20, 24), torch.randn(37)
    head = CompiledHead(lib, weight, bias, 20)
    torch.testing.assert_close(head(h), F.linear(h, weight, bias), atol=1e-5, rtol=1e-5)
    # The packing transposed 16 x 16 blocks in registers (AVX-512) places every entry where the plain loop does.
    for width in (24, 48):
        wide = torch.randn(37, width)
        assert torch.equal(CompiledHead(native.library(), wide, None, 4).packed, CompiledHead(lib, wide, None, 4).packed)
    from test_fused import check_rms_norm, check_swiglu  # training's fused passes, through grpo.engines.cpu.fused

    with monkeypatch.context() as patch:
        patch.setattr(native, "library", lambda: lib)
        check_swiglu()
        check_rms_norm()
    test_compiled_step_matches_the_torch_step("llama", {}, 9, lib=lib)
    check_sampler(lib)
    for vocab_block in (3, 11):
        core_tests.test_hidden_logprobs_match_naive_full_logits(4, vocab_block, True, kernels=native.TileKernels(lib))
        core_tests.test_hidden_loss_matches_autograd_through_the_naive_logits(3, vocab_block, True,
                                                                               kernels=native.TileKernels(lib),
                                                                               atol=3e-5)
    for estimate, corrected in (("close", False), ("off", True), ("too_high", True)):
        core_tests.test_seeded_hidden_loss_matches_autograd_through_the_naive_logits(
            estimate, corrected, 3, True, monkeypatch, kernels=native.TileKernels(lib), atol=3e-5)


def check_sampler(lib):
    """lean_sample draws what a float64 inverse CDF over the whole vocabulary draws."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 3001, generator=gen) * 3  # blocks of 1,024, 1,024 and 953
    logits[:, ::5] = float("-inf")
    u = torch.rand(16, generator=gen, dtype=torch.float64)
    cdf = logits.double().softmax(-1).cumsum(-1)
    bad, tokens, logprobs = native.sample(lib, logits, u)
    assert bad == -1 and tokens.tolist() == (cdf <= u[:, None] * cdf[:, -1:]).sum(-1).tolist()
    torch.testing.assert_close(logprobs, logits.log_softmax(-1).gather(1, tokens[:, None])[:, 0])


@needs_compiler
def test_compiled_sampler_draws_like_the_float64_inverse_cdf_and_checks_its_inputs():
    check_sampler(native.library())
    with pytest.raises(ValueError, match="compiled sampler: expected"):
        native.sample(native.library(), torch.zeros(4, 10, dtype=torch.float64), torch.rand(4))
    with pytest.raises(ValueError, match="compiled sampler: expected"):
        native.sample(native.library(), torch.zeros(4, 10), torch.rand(3))


@needs_compiler
@torch.no_grad()
def test_compiled_step_keeps_what_it_points_into_and_checks_its_inputs():
    model = tiny("llama")  # biases: tensors made by the decoder, not parameters
    ids, mask = torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.ones(2, 3, dtype=torch.long)
    torch_cache, pos = prefilled(model, ids, mask, 3)
    c_cache, _ = prefilled(model, ids, mask, 3)
    expected = LeanDecoder(model).hidden(torch.tensor([[7], [8]]), pos + 1, torch_cache, None).clone()
    step = LeanDecoder(model).compiled(c_cache, 2)  # the decoder is dropped here
    gc.collect()
    litter = [torch.randn(1000) for _ in range(100)]  # reuse of freed memory would show up in the result
    torch.testing.assert_close(step(torch.tensor([[7], [8]]), pos + 1, c_cache, None), expected, atol=2e-5, rtol=1e-5)
    del litter
    with pytest.raises(IndexError, match="token ids"):
        step(torch.tensor([[7], [61]]), pos + 2, c_cache, None)  # past the embedding: an error, not a crash
    with pytest.raises(ValueError, match="2 rows"):
        step(torch.tensor([[7]]), pos[:1] + 2, c_cache, None)
    with pytest.raises(ValueError, match="key_mask"):
        step(torch.tensor([[7], [8]]), pos + 2, c_cache, torch.ones(2, 9, dtype=torch.bool))
    with pytest.raises(TypeError, match="int64"):
        step(torch.tensor([[7], [8]], dtype=torch.int32), pos + 2, c_cache, None)


@needs_compiler
@torch.no_grad()
def test_compiled_step_is_refused_where_c_would_read_the_wrong_weights_or_buffers():
    ids, mask = torch.tensor([[1, 2, 3]]), torch.ones(1, 3, dtype=torch.long)
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(tiny("qwen2"), LoraConfig(r=2, target_modules=["embed_tokens"]))  # C reads the weight
    cache, _ = prefilled(lora, ids, mask, 2)
    assert LeanDecoder.supports(lora) and LeanDecoder(lora).compiled(cache, 1) is None
    dynamic = tiny("qwen2", rope={"rope_type": "dynamic", "factor": 2.0})  # frequencies change with length
    cache, _ = prefilled(dynamic, ids, mask, 2)
    assert LeanDecoder(dynamic).compiled(cache, 1) is None
    model = tiny("qwen2")
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a bfloat16 cache: C writes float32
        cache, _ = prefilled(model, ids, mask, 2)
    assert LeanDecoder(model).compiled(cache, 1) is None
    cache, _ = prefilled(model, ids, mask, 2)
    assert LeanDecoder(model).compiled(cache, 2) is None  # a cache of other rows


@needs_compiler
def test_compiled_head_from_a_non_contiguous_weight_and_inside_generation(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    torch.manual_seed(0)
    weight, h = torch.randn(24, 37).t(), torch.randn(5, 24)  # a transposed view: packed from a temporary copy
    head = CompiledHead(native.library(), weight, None, 5)
    torch.testing.assert_close(head(h), F.linear(h, weight), atol=1e-5, rtol=1e-5)
    heads = []
    monkeypatch.setattr(decoding, "_SMALL_HEAD", 0)  # (the tiny model's head would be multiplied as it is)
    monkeypatch.setattr(generation, "packed_head", lambda *a: heads.append(packed_head(*a)) or heads[-1])
    model = tiny("qwen2")
    ids, params = [[5, 6, 7], [1, 2, 3, 4, 5], [9, 8, 7, 6]], SamplingParams(12, temperature=1.0)
    fast = CPUSampler(model, pad_id=0, eos_ids=[60]).generate(ids, params, seeds=[1, 2, 3])
    # the compiled head where the build has its AVX-512 kernel, oneDNN's product otherwise
    assert heads and all(isinstance(head, CompiledHead) == bool(native.library().lean_wide_vectors())
                         for head in heads)
    monkeypatch.setattr(generation, "packed_head", lambda w, b, rows, space: (lambda x: F.linear(x, w, b)))
    monkeypatch.setattr(LeanDecoder, "compiled", lambda self, c, n: None)
    plain = CPUSampler(model, pad_id=0, eos_ids=[60]).generate(ids, params, seeds=[1, 2, 3])
    assert fast.ids == plain.ids


@needs_compiler
@torch.no_grad()
def test_lora_adapters_fold_into_the_compiled_step():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny("llama"), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    for name, param in model.named_parameters():
        if "lora_B" in name:  # B starts at zero; make the adapters change the outputs
            torch.nn.init.normal_(param, std=0.5)
    model.train()
    assert LeanDecoder(model).fused[0] is None  # training mode: adapter dropout would apply, so no folding
    model.eval()
    ids, mask = torch.tensor([[1, 2, 3], [0, 4, 5]]), torch.tensor([[1, 1, 1], [0, 1, 1]])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache, pos = prefilled(model, ids, mask, 2)
    step = LeanDecoder(model).compiled(cache, 2)
    assert isinstance(step, CompiledStep)
    token, full = torch.tensor([[7], [8]]), torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
    stock = model(input_ids=torch.cat([ids, token], 1), attention_mask=full,
                  position_ids=torch.cat([positions, pos + 1], 1)).logits[:, -1]
    hidden = step(token, pos + 1, cache, full.bool())
    torch.testing.assert_close(F.linear(hidden, model.get_output_embeddings().weight), stock, atol=2e-5, rtol=1e-5)
    folded = LeanDecoder(model).fused
    with model.disable_adapter():  # adapters off: the base weights
        assert not any(torch.allclose(a.qkv, b.qkv) for a, b in zip(LeanDecoder(model).fused, folded))


@needs_compiler
def test_an_unwritable_cache_folder_falls_back_to_the_temporary_directory(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # GRPO_CACHE_DIR/native cannot be made below a file
    monkeypatch.setenv("GRPO_CACHE_DIR", str(blocker))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    native.library.cache_clear()
    try:
        assert native.library() is not None
        built = list((tmp_path / "tmp").glob("grpo-native-*/lean_step-*.so"))
        assert built and built[0].parent.stat().st_mode & 0o077 == 0  # private to this user
        native.library.cache_clear()
        built[0].parent.chmod(0o777)  # a folder others can write to: not used
        assert native.library() is None
    finally:
        native.library.cache_clear()


@needs_compiler
@pytest.mark.parametrize("chunk_size", [1, 6, 1024])
@pytest.mark.parametrize("vocab_block", [None, 1, 3, 4, 11])
@pytest.mark.parametrize("use_bias", [False, True])
def test_compiled_logit_tiles_match_the_naive_full_logits(chunk_size, vocab_block, use_bias):
    # The core's own test (values and gradients of log-probs and entropies at temperature 0.8), with the C tiles.
    core_tests.test_hidden_logprobs_match_naive_full_logits(chunk_size, vocab_block, use_bias,
                                                 kernels=native.tile_kernels(torch.float32, torch.device("cpu")))


@needs_compiler
@pytest.mark.parametrize("rows_per_chunk", [1, 3, 4])
@pytest.mark.parametrize("vocab_block", [None, 1, 4])
@pytest.mark.parametrize("use_bias", [False, True])
def test_compiled_logit_tiles_in_the_one_pass_loss(rows_per_chunk, vocab_block, use_bias):
    core_tests.test_hidden_loss_matches_autograd_through_the_naive_logits(
        rows_per_chunk, vocab_block, use_bias, kernels=native.tile_kernels(torch.float32, torch.device("cpu")),
        atol=3e-5)


@needs_compiler
@pytest.mark.parametrize("estimate, corrected", [("close", False), ("off", True), ("too_high", True),
                                                 ("too_low", True)])
@pytest.mark.parametrize("use_bias", [False, True])
def test_compiled_logit_tiles_in_the_seeded_loss(estimate, corrected, use_bias, monkeypatch):
    core_tests.test_seeded_hidden_loss_matches_autograd_through_the_naive_logits(
        estimate, corrected, 3, use_bias, monkeypatch, kernels=native.tile_kernels(torch.float32, torch.device("cpu")),
        atol=3e-5)


@pytest.mark.parametrize("path", ["compiled", "torch"])
def test_logit_tiles_with_a_filtered_vocabulary(path):
    # -inf bias on whole tiles (entries 0-5 with blocks of 3, so the first tile is all -inf) and inside others:
    # exp(-inf) = 0 and 0 log 0 = 0 everywhere, on both paths; no NaN in log-probs, entropies or gradients.
    if path == "compiled" and native.library() is None:
        pytest.skip("no C compiler: the compiled tiles are not built")
    kernels = native.tile_kernels(torch.float32, torch.device("cpu")) if path == "compiled" else None
    torch.manual_seed(0)
    hidden, weight, bias = torch.randn(2, 5, 8), torch.randn(20, 8), torch.randn(20)
    bias[[0, 1, 2, 3, 4, 5, 9, 17]] = float("-inf")
    tokens = torch.tensor([[6, 7, 8, 10, 19]] * 2)
    leaf = hidden.clone().requires_grad_()
    logp, entropy = hidden_logprobs(leaf, weight, tokens, 0.7, 4, bias=bias, with_entropy=True, vocab_block=3,
                                    kernels=kernels)
    (logp.sum() + 0.3 * entropy.sum()).backward()
    # The reference drops the filtered entries (probability exactly 0), so its own autograd has no 0 * -inf.
    keep = torch.isfinite(bias)
    naive_leaf = hidden.clone().requires_grad_()
    logits = naive_leaf @ weight[keep].T + bias[keep]
    expected = core_tests.naive_logprobs(logits, keep.long().cumsum(0)[tokens] - 1, 0.7)
    p = torch.softmax(logits / 0.7, -1)
    expected_entropy = -(p * p.log()).sum(-1)
    (expected.sum() + 0.3 * expected_entropy.sum()).backward()
    torch.testing.assert_close(logp, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, expected_entropy.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(leaf.grad, naive_leaf.grad, atol=1e-5, rtol=1e-5)
    # The one-pass loss: its entropies too.
    _, logp, entropy = hidden_loss(hidden, weight, tokens, lambda lp, rows: lp.sum(), 0.7, bias=bias,
                                   with_entropy=True, rows_per_chunk=1, vocab_block=3, kernels=kernels)
    torch.testing.assert_close(logp, expected.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, expected_entropy.detach(), atol=1e-5, rtol=1e-5)


@needs_compiler
def test_a_nan_reaches_the_gradient_through_the_compiled_tiles():
    # A NaN hidden state must give NaN gradients, as on the torch path (the trainer skips steps on a non-finite
    # gradient norm); a floored log p must not turn it into 0.
    torch.manual_seed(0)
    hidden, weight, tokens = torch.randn(1, 3, 8), torch.randn(40, 8), torch.tensor([[1, 20, 39]])
    hidden[0, 1, 0] = float("nan")
    for with_entropy in (False, True):
        grads = []
        for kernels in (native.tile_kernels(torch.float32, torch.device("cpu")), None):
            leaf = hidden.clone().requires_grad_()
            logp, entropy = hidden_logprobs(leaf, weight, tokens, 1.0, 4, with_entropy=with_entropy, vocab_block=16,
                                            kernels=kernels)
            loss = logp[:, [0, 2]].sum()  # the NaN row's loss weight is 0: only a NaN p can carry it
            (loss + entropy[:, [0, 2]].sum() if with_entropy else loss).backward()
            grads.append(leaf.grad)
        assert torch.isnan(grads[0][0, 1]).all() and torch.isnan(grads[1][0, 1]).all()
        torch.testing.assert_close(grads[0][0, [0, 2]], grads[1][0, [0, 2]], atol=1e-5, rtol=1e-5)


@needs_compiler
def test_compiled_logit_tiles_on_a_large_vocabulary():
    kernels = native.tile_kernels(torch.float32, torch.device("cpu"))
    torch.manual_seed(0)
    # A 150k-entry vocabulary in 2,048-wide tiles (the benchmark's W2 size): log-probs, entropies and gradients
    # against torch's own tiles.
    hidden, weight = torch.randn(3, 16, 64), torch.randn(150_001, 64) * 0.3
    tokens = torch.randint(0, 150_001, (3, 16))
    results = []
    for k in (kernels, None):
        leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
        logp, entropy = hidden_logprobs(*leaves, tokens, 1.0, 32, with_entropy=True, vocab_block=2048, kernels=k)
        (logp.sum() + 0.5 * entropy.sum()).backward()
        results.append((logp, entropy, leaves[0].grad, leaves[1].grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@needs_compiler
def test_compiled_logit_tiles_check_their_inputs():
    kernels = native.tile_kernels(torch.float32, torch.device("cpu"))
    assert native.tile_kernels(torch.bfloat16, torch.device("cpu")) is None
    x, v = torch.zeros(4, 6), torch.zeros(4)
    with pytest.raises(ValueError, match="float32 CPU"):
        kernels.tile_grad(x.double(), 1.0, v, v, None, None)
    with pytest.raises(ValueError, match="per-row values"):
        kernels.tile_grad(x, 1.0, torch.zeros(3), v, None, None)
    with pytest.raises(ValueError, match="come together"):
        kernels.tile_grad(x, 1.0, v, v, v, None)
    with pytest.raises(ValueError, match="expected 4 targets"):
        kernels.tile_stats(x, 1.0, torch.zeros(3, dtype=torch.long), 0, v, v.clone(), v.clone(), None)


_HEAP_OR_MAPPED = """
import ctypes, sys, torch
from grpo.engines.cpu import native
applied = native.keep_freed_memory() if sys.argv[1] == "keep" else False
sbrk = ctypes.CDLL(None).sbrk
sbrk.argtypes, sbrk.restype = [ctypes.c_long], ctypes.c_void_p
block = torch.ones(4 * 2**20)  # 16 MiB: glibc maps blocks this large fresh by default (128 KiB and up, at first)
print(applied, block.data_ptr() < sbrk(0))  # below the program break: served from the heap, which keeps its pages
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_keep_freed_memory_serves_activation_sized_blocks_from_the_heap():
    """What spares a micro-batch's activations their page faults (measured on the benchmark's W1: 12-20k faults
    per update without it, none with it): blocks under 32 MiB come from malloc's heap, whose freed memory is kept."""
    runs = {}
    for mode in ("keep", "default"):
        out = subprocess.run([sys.executable, "-c", _HEAP_OR_MAPPED, mode], capture_output=True, text=True, check=True)
        applied, from_heap = out.stdout.split()
        runs[mode] = (applied == "True", from_heap == "True")
    if not runs["keep"][0]:
        pytest.skip("mallopt not available (not glibc)")
    assert runs == {"keep": (True, True), "default": (False, False)}, runs
