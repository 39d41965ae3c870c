"""The sampler: inverse-CDF draws follow the probabilities, filters match hand-derived cases, and a row's
completion depends only on its own seed, not on which rows share its batch."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.engines.cpu import native
from grpo.engines.cpu.sampler import CPUSampler, sample_rows
from grpo.engines.sampling import SamplingParams, left_pad, process_logits, uniform_streams


@pytest.fixture(params=["compiled", "torch"])
def sampler(request, monkeypatch):
    """Runs a sampling test on the compiled sampler (grpo/engines/cpu/csrc/softmax.c) and on the torch one."""
    if request.param == "torch":
        monkeypatch.setattr(native, "library", lambda: None)
    elif native.library() is None:
        pytest.skip("no C compiler: the compiled sampler is not built")
    return request.param


def test_inverse_cdf_frequencies_and_zero_mass(sampler):
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]]).repeat(20000, 1)
    u = uniform_streams([torch.Generator().manual_seed(i) for i in range(20000)], 1)[:, 0]
    tokens, logprobs = sample_rows(probs.log(), u)
    freq = torch.bincount(tokens, minlength=4) / 20000
    # 20,000 draws: the std of a frequency is at most sqrt(0.25 / 20000) = 0.0035; 0.02 is over 5 sigma.
    assert torch.allclose(freq, torch.tensor([0.1, 0.0, 0.6, 0.3]), atol=0.02) and freq[1] == 0
    torch.testing.assert_close(logprobs, probs.log()[0, tokens])


def test_boundaries_of_the_inverse_cdf(sampler):
    logits = torch.tensor([[0.25, 0.25, 0.5]] * 3).log() + 7.0  # a constant shift changes nothing
    # cdf = [0.25, 0.5, 1.0]: u = 0 -> token 0; u = 0.25 -> token 1 (cdf[0] <= u); u = 0.999 -> token 2.
    tokens, logprobs = sample_rows(logits, torch.tensor([0.0, 0.25, 0.999], dtype=torch.float64))
    assert tokens.tolist() == [0, 1, 2]
    torch.testing.assert_close(logprobs, torch.tensor([0.25, 0.25, 0.5]).log())


def test_two_level_search_across_blocks_of_a_large_vocabulary(sampler):
    # 3,000 entries = blocks of 1,024, 1,024 and 952 (a short last block). Mass only on tokens 5, 1500 and 2999
    # (probabilities 0.2, 0.5, 0.3); the middle of every block is filtered (-inf) and must never be drawn.
    logits = torch.full((1, 3000), float("-inf"))
    logits[0, [5, 1500, 2999]] = torch.tensor([0.2, 0.5, 0.3]).log()
    u = torch.tensor([0.0, 0.1999, 0.2001, 0.6999, 0.7001, 0.999999], dtype=torch.float64)
    tokens, logprobs = sample_rows(logits.repeat(6, 1), u)
    assert tokens.tolist() == [5, 5, 1500, 1500, 2999, 2999]
    torch.testing.assert_close(logprobs, torch.tensor([0.2, 0.2, 0.5, 0.5, 0.3, 0.3]).log())
    # Against a plain float64 inverse CDF over the full vocabulary, on random logits and uniforms.
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 5000, generator=gen) * 3
    u = torch.rand(64, generator=gen, dtype=torch.float64)
    cdf = logits.double().softmax(-1).cumsum(-1)
    expected = (cdf <= u[:, None] * cdf[:, -1:]).sum(-1)
    assert sample_rows(logits, u)[0].tolist() == expected.tolist()


@pytest.mark.parametrize("vocab", [100, 1024])
def test_one_block_vocabulary_samples_like_the_two_level_search(vocab, sampler):
    # Up to 1,024 entries take a shorter path (_sample_one_block); it must draw what the float64 inverse CDF draws.
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(256, vocab, generator=gen) * 3
    logits[:, ::7] = float("-inf")  # filtered entries are never drawn
    u = torch.rand(256, generator=gen, dtype=torch.float64)
    cdf = logits.double().softmax(-1).cumsum(-1)
    expected = (cdf <= u[:, None] * cdf[:, -1:]).sum(-1)
    tokens, logprobs = sample_rows(logits.clone(), u)
    assert tokens.tolist() == expected.tolist()
    torch.testing.assert_close(logprobs, logits.log_softmax(-1).gather(1, tokens[:, None])[:, 0])
    # A target at the row's total (u = 1, past every cumulative sum): the last token with mass, on both paths.
    for width in (3, 3000):
        row = torch.full((1, width), float("-inf"))
        row[0, :2] = 0.0
        assert sample_rows(row, torch.tensor([1.0], dtype=torch.float64))[0].tolist() == [1]


def test_filters_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    keep = lambda p: torch.isfinite(process_logits(logits, None, p))[0].tolist()  # noqa: E731
    assert keep(SamplingParams(8, top_k=2)) == [True, True, False, False]
    # top_p 0.7: cumulative 0.5, 0.8 -> the first two reach 0.7, the rest are dropped.
    assert keep(SamplingParams(8, top_p=0.7)) == [True, True, False, False]
    # min_p 0.4: threshold 0.4 * 0.5 = 0.2 -> keeps 0.5 and 0.3.
    assert keep(SamplingParams(8, min_p=0.4)) == [True, True, False, False]
    scaled = process_logits(logits, None, SamplingParams(8, temperature=2.0))
    assert math.isclose(scaled[0, 0].item(), math.log(0.5) / 2, rel_tol=1e-6)
    # Repetition penalty 2 on a seen token with logit log(0.5) < 0: multiplied, log(0.5) * 2.
    seen = torch.tensor([[True, False, False, False]])
    penalized = process_logits(logits, seen, SamplingParams(8, repetition_penalty=2.0))
    assert math.isclose(penalized[0, 0].item(), 2 * math.log(0.5), rel_tol=1e-6)
    # Temperature 0 (grpo eval's greedy): only the most likely token stays, and any uniform draws it.
    greedy = SamplingParams(8, temperature=0.0)
    assert keep(greedy) == [True, False, False, False] and not greedy.unfiltered
    for u in (0.0, 0.5, 0.999):
        drawn = sample_rows(process_logits(logits, None, greedy), torch.tensor([u], dtype=torch.float64))[0]
        assert drawn.tolist() == [0]


def test_left_pad():
    ids, mask = left_pad([[1, 2, 3], [4]], pad_id=0)
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_a_rows_completion_depends_only_on_its_seed(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    gen = CPUSampler(model, tok.pad_token_id, [tok.eos_token_id])
    params = SamplingParams(10)
    a = tok("abc", add_special_tokens=False)["input_ids"]
    b = tok("a much longer prompt", add_special_tokens=False)["input_ids"]
    alone = gen.generate([a], params, seeds=[7]).ids[0]
    together = gen.generate([b, a, b], params, seeds=[1, 7, 2]).ids[1]
    assert alone == together
    assert gen.generate([a], params, seeds=[8]).ids[0] != alone or len(alone) == 0


@pytest.mark.parametrize("lean", [True, False])
def test_a_shared_prompt_is_encoded_once_with_the_same_completions(tiny_model_dir, monkeypatch, lean):
    """Rows with the same prompt (a group) share one prompt forward whose cache is copied to them: the completions
    and log-probs are those of encoding every row, with the lean step and with transformers' own forward."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import grpo.engines.cpu.sampler as cpu_sampler
    import grpo.engines.sampling as generation

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    if not lean:
        monkeypatch.setattr(cpu_sampler.LeanDecoder, "supports", staticmethod(lambda m: False))
    gen = CPUSampler(model, tok.pad_token_id, [tok.eos_token_id])
    a = tok("abc", add_special_tokens=False)["input_ids"]
    b = tok("a much longer prompt", add_special_tokens=False)["input_ids"]
    prompts, seeds = [a, a, b, a, b], [1, 2, 3, 4, 5]
    assert generation.distinct_rows(prompts) == ([0, 2], [0, 0, 1, 0, 1])
    prefills, forward = [], model.forward

    def counted(*args, **kwargs):
        prefills.append(kwargs["input_ids"].shape)
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", counted)
    shared = gen.generate(prompts, SamplingParams(12), seeds)
    assert prefills[0][0] == 2  # two distinct prompts encoded, not five rows
    monkeypatch.setattr(generation, "distinct_rows", lambda rows: (list(range(len(rows))), list(range(len(rows)))))
    each = gen.generate(prompts, SamplingParams(12), seeds)
    assert shared.ids == each.ids and shared.truncated == each.truncated
    for x, y in zip(shared.logprobs, each.logprobs):
        assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-5)


def test_sampling_logprobs_match_a_full_forward(tiny_model_dir):
    """The kept per-token sampling log-probs equal the policy's log-probs of the same tokens (temperature 1, no
    filters), recomputed in one pass over prompt + completion as the trainer does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.engines.policy import completion_logprobs

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    prompt = tok("hello", add_special_tokens=False)["input_ids"]
    out = CPUSampler(model, tok.pad_token_id, [tok.eos_token_id]).generate([prompt], SamplingParams(6),
                                                                                       seeds=[3])
    ids = torch.tensor([prompt + out.ids[0]])
    with torch.no_grad():
        full = completion_logprobs(model, ids, torch.ones_like(ids), len(out.ids[0]), 1.0)[0]
    assert torch.allclose(full, torch.tensor(out.logprobs[0]), atol=1e-4)


def test_chunked_head_path_equals_the_logits_path(tiny_model_dir, monkeypatch):
    """completion_logprobs' fast path (decoder + chunked LM head) gives the logits path's log-probs, entropies and
    gradients: it is a memory optimization, not a different loss."""
    from transformers import AutoModelForCausalLM

    import grpo.engines.policy as model_module

    torch.manual_seed(0)
    ids = torch.randint(3, 200, (4, 20))
    attn = torch.ones_like(ids)
    attn[0, :5] = 0  # a left-padded row
    results = []
    for fast in (True, False):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        if not fast:
            monkeypatch.setattr(model_module, "plain_head", lambda m: None)
        assert (model_module.plain_head(model) is not None) == fast
        logp, entropy = model_module.completion_logprobs(model, ids, attn, 8, 0.7, with_entropy=True)
        logp.sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((logp.detach(), entropy, grads))
        monkeypatch.undo()
    (a, ea, ga), (b, eb, gb) = results
    assert torch.allclose(a, b, atol=1e-5) and torch.allclose(ea, eb, atol=1e-5) and torch.allclose(ga, gb, atol=1e-4)


@pytest.mark.parametrize("vocab", [50, 2000])  # one block, several blocks
def test_sampling_from_non_finite_logits_is_a_clear_error(sampler, vocab):
    for row, value in ((1, float("nan")), (2, float("inf"))):
        logits = torch.zeros(3, vocab)
        logits[row, 7] = value
        with pytest.raises(ValueError, match=f"sample_rows: row {row} has non-finite logits"):
            sample_rows(logits, torch.full((3,), 0.5, dtype=torch.float64))
    logits = torch.zeros(3, vocab)
    logits[2] = float("-inf")  # every token filtered
    with pytest.raises(ValueError, match="sample_rows: row 2 .* no token left"):
        sample_rows(logits, torch.full((3,), 0.5, dtype=torch.float64))


def test_a_shared_prompt_is_scored_once_with_the_same_logprobs(tiny_model_dir, monkeypatch):
    """Without gradients (the reference pass), rows with the same prompt share one prompt forward: the log-probs
    are those of the full forward, with left-padded prompts of two lengths and right-padded completions."""
    from transformers import AutoModelForCausalLM

    import grpo.engines.policy as model_module

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    short, long = torch.randint(3, 200, (3,)), torch.randint(3, 200, (6,))
    completions = torch.randint(3, 200, (5, 7))
    ids = torch.cat([torch.stack([torch.cat([torch.zeros(3, dtype=torch.long), short]), long, long,
                                  torch.cat([torch.zeros(3, dtype=torch.long), short]), long]), completions], dim=1)
    attn = torch.ones_like(ids)
    attn[[0, 3], :3] = 0  # the short prompt's left padding
    attn[1, -2:] = 0  # a completion that ended early
    calls = []
    shared_hidden = model_module._shared_prompt_hidden
    monkeypatch.setattr(model_module, "_shared_prompt_hidden", lambda *a: calls.append(1) or shared_hidden(*a))
    with torch.no_grad():
        shared = model_module.completion_logprobs(model, ids, attn, 7, 0.8)
        assert calls and shared_hidden(model, ids, attn, 7) is not None  # the shared path ran
        monkeypatch.setattr(model_module, "_shared_prompt_hidden", lambda *a: None)
        full = model_module.completion_logprobs(model, ids, attn, 7, 0.8)
        assert shared_hidden(model, ids[:2], attn[:2], 7) is None  # no prompt repeats: the full forward
        # One completion token: nothing runs after the prompt, which the full forward does by itself.
        assert shared_hidden(model, ids[:, :-6], attn[:, :-6], 1) is None
        one = model_module.completion_logprobs(model, ids[:, :-6], attn[:, :-6], 1, 0.8)
        torch.testing.assert_close(one, full[:, :1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shared, full, atol=1e-5, rtol=1e-5)



@pytest.mark.parametrize("path", ["compiled", "lean", "transformers"])
def test_rows_that_have_ended_leave_the_batch_with_the_same_completions(tiny_model_dir, monkeypatch, path):
    """With 40 end tokens the rows end at ragged lengths; once a quarter of the batch has ended those rows leave it
    (their cache rows dropped, the compiled step told). Completions, truncation flags and log-probs are those of a
    rollout that keeps every row to the end, on the compiled step, the lean torch step and transformers' forward."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import grpo.engines.cpu.sampler as cpu_sampler
    import grpo.engines.sampling as generation

    if path == "compiled" and native.library() is None:
        pytest.skip("no C compiler: no compiled step")
    if path == "lean":
        monkeypatch.setattr(native, "library", lambda: None)
    if path == "transformers":
        monkeypatch.setattr(cpu_sampler.LeanDecoder, "supports", staticmethod(lambda m: False))
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    gen = CPUSampler(model, tok.pad_token_id, list(range(100, 140)))
    prompts = [tok(f"prompt {i % 3}", add_special_tokens=False)["input_ids"] for i in range(12)]
    kept = []
    keep = generation.keep_cache_rows
    monkeypatch.setattr(generation, "keep_cache_rows", lambda cache, index: kept.append(len(index))
                        or keep(cache, index))
    leaving = gen.generate(prompts, SamplingParams(24), list(range(12)))
    monkeypatch.setattr(generation, "_LEAVE_FRACTION", 2.0)  # never
    staying = gen.generate(prompts, SamplingParams(24), list(range(12)))
    lengths = sorted(len(c) for c in leaving.ids)
    assert lengths[0] < lengths[-1] and kept and kept == sorted(kept, reverse=True) and kept[-1] < 12
    assert leaving.ids == staying.ids and leaving.truncated == staying.truncated
    for x, y in zip(leaving.logprobs, staying.logprobs):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=1e-5, rtol=1e-5)


def test_the_kv_cache_is_kept_in_the_compute_dtype(monkeypatch):
    """fp32 weights under bf16 autocast (the GPU recipe's precision): RoPE's fp32 cos/sin make the keys fp32 while the
    values are bf16; the cache keeps both in bf16 (before: an fp32 key cache, twice the memory, cast again by the
    attention at every token: gpu_review2 N9). Without autocast it keeps the weights' fp32."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import grpo.engines.sampling as sampling
    from grpo.engines.sampling import TransformersSampler

    caches = []
    made = sampling.preallocated_cache
    monkeypatch.setattr(sampling, "preallocated_cache", lambda m, c: caches.append(made(m, c)) or caches[-1])
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa"))
    for autocast, want in ((True, torch.bfloat16), (False, torch.float32)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            TransformersSampler(model, 0, [299]).generate([[5, 6, 7, 8]] * 2, SamplingParams(4), [1, 2])
        layer = caches[-1].layers[0]
        assert (layer.key_buffer.dtype, layer.value_buffer.dtype) == (want, want)
