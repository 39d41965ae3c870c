"""The vLLM rollout engine (grpo/engines/vllm.py) against the project's own sampler, on the shipped tiny model: the
same greedy completions before and after a weight update (full and LoRA), the log-probs of the distribution
sampled from, seeded repeatability, and EOS/truncation.

These need vLLM, which the main environment does not have: `bash scripts/vllm_env.sh` builds an environment with
vLLM's CPU build, then `.venv-vllm/bin/python -m pytest -q tests/test_vllm.py`. Elsewhere they are skipped.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest
import torch

from grpo.engines.base import SamplingParams
from grpo.engines.sampling import TransformersSampler, process_logits

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before vLLM is imported: the engine in this process
try:
    import vllm  # noqa: F401

    VLLM_MISSING = None
except Exception as err:  # not installed, or a broken install (e.g. a torchvision that fails beside the CPU torch)
    VLLM_MISSING = f"{type(err).__name__}: {err}"

needs_vllm = pytest.mark.skipif(
    VLLM_MISSING is not None,
    reason=f"vLLM is not importable here ({VLLM_MISSING}); to run these: `bash scripts/vllm_env.sh`, then "
           "`.venv-vllm/bin/python -m pytest -q tests/test_vllm.py`")

ASSET = str(Path(__file__).resolve().parents[1] / "grpo" / "assets" / "tiny-arith")
GREEDY = SamplingParams(max_new_tokens=40, top_k=1)  # temperature must be > 0 here; top_k=1 is greedy on both sides


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ASSET, local_files_only=True)


@pytest.fixture(scope="module")
def base_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ASSET, local_files_only=True, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    from grpo.tasks import get_task

    rows = get_task("arithmetic").dataset("test", n=6, seed=0)
    return [tokenizer(p + "<think>")["input_ids"] for p in rows["prompt"]]


@pytest.fixture(scope="module")
def engine(tokenizer):
    from grpo.engines.vllm import VLLMEngine

    # Eager and a fixed 32 MiB KV cache: starts in ~2 s instead of ~30 s of torch.compile warm-up. On the CPU build
    # gpu_memory_utilization is a fraction of the machine's RAM that must be free at start.
    return VLLMEngine(ASSET, eos_ids=[tokenizer.eos_token_id], dtype=torch.float32, max_model_len=256,
                      gpu_memory_utilization=0.1, enforce_eager=True, kv_cache_memory_bytes=32 << 20)


def ours(model, tokenizer, prompts, params, seeds, eos_ids=None):
    gen = TransformersSampler(model, tokenizer.pad_token_id, eos_ids or [tokenizer.eos_token_id])
    return gen.generate(prompts, params, seeds)


def assert_follows(engine, base_model, policy, tokenizer, prompts, seeds):
    """Given the base weights and then the policy's, the engine's greedy completions change and equal our sampler's
    on the policy. Returns the base weights' completions."""
    policy.eval()
    engine.update_weights(base_model)
    before = engine.generate(prompts, GREEDY, seeds)
    engine.update_weights(policy)
    after = engine.generate(prompts, GREEDY, seeds)
    assert after.ids != before.ids
    assert after.ids == ours(policy, tokenizer, prompts, GREEDY, seeds).ids
    return before


def recomputed_logprobs(model, prompt, completion, params):
    """Per completion token, its log-prob under `model` after our sampler's processing of that step's logits
    (grpo.engines.sampling.process_logits: repetition penalty, temperature, top-k, top-p, min-p)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].float()
    seen = torch.zeros(logits.shape, dtype=torch.bool)  # row t: the tokens before completion token t
    for t in range(len(completion)):
        seen[t, prompt + completion[:t]] = True
    processed = process_logits(logits, seen, params)
    return processed.log_softmax(-1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def noised(model, scale=0.02, seed=0):
    changed = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std())
    return changed


@needs_vllm
def test_greedy_matches_our_sampler(engine, base_model, tokenizer, prompts):
    engine.update_weights(base_model)
    got = engine.generate(prompts, GREEDY, seeds=list(range(len(prompts))))
    want = ours(base_model, tokenizer, prompts, GREEDY, list(range(len(prompts))))
    assert got.ids == want.ids and got.truncated == want.truncated
    assert any(not t for t in got.truncated)  # the tiny model answers and stops: EOS handling is exercised
    assert all(lp == pytest.approx(0.0, abs=1e-6) for row in got.logprobs for lp in row)  # one token kept: p = 1


@needs_vllm
def test_weight_update_changes_completions_to_the_new_weights(engine, base_model, tokenizer, prompts):
    policy = copy.deepcopy(base_model).train()
    # A few optimizer steps that push the policy towards one fixed (wrong) completion.
    target = tokenizer("9</think>\n<answer>9</answer>")["input_ids"] + [tokenizer.eos_token_id]
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    for _ in range(5):
        batch = torch.tensor([p + target for p in prompts[:2]])
        logits = policy(input_ids=batch).logits[:, -len(target) - 1:-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 torch.tensor([target] * 2).reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    seeds = list(range(len(prompts)))
    before = assert_follows(engine, base_model, policy, tokenizer, prompts, seeds)
    # And back: the engine holds exactly what it was last given.
    engine.update_weights(base_model)
    assert engine.generate(prompts, GREEDY, seeds).ids == before.ids


@needs_vllm
@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=24),
    SamplingParams(max_new_tokens=24, temperature=0.7),
    SamplingParams(max_new_tokens=24, temperature=1.3, top_k=20, top_p=0.9),
    SamplingParams(max_new_tokens=24, temperature=1.3, min_p=0.05),  # vLLM filters min-p before top-k/top-p: alone here
    SamplingParams(max_new_tokens=24, repetition_penalty=1.2),
], ids=["T1", "T0.7", "T1.3-topk-topp", "T1.3-minp", "rep-penalty"])
def test_logprobs_are_those_of_the_distribution_sampled_from(engine, base_model, tokenizer, prompts, params):
    from grpo.engines.policy import completion_logprobs

    policy = noised(base_model)  # weights the engine did not load from disk
    engine.update_weights(policy)
    got = engine.generate(prompts, params, seeds=[100 + i for i in range(len(prompts))])
    for prompt, completion, logprobs in zip(prompts, got.ids, got.logprobs):
        assert len(logprobs) == len(completion) > 0
        torch.testing.assert_close(torch.tensor(logprobs), recomputed_logprobs(policy, prompt, completion, params),
                                   atol=2e-5, rtol=1e-5)
    if (params.top_k, params.top_p, params.min_p, params.repetition_penalty) == (0, 1.0, 0.0, 1.0):  # no filter
        # The trainer's own scoring (prompts left-padded, completions right-padded) agrees at the same temperature.
        width, length = max(map(len, prompts)), max(map(len, got.ids))
        ids = torch.full((len(prompts), width + length), tokenizer.pad_token_id)
        mask = torch.zeros_like(ids)
        for i, (p, c) in enumerate(zip(prompts, got.ids)):
            ids[i, width - len(p):width + len(c)] = torch.tensor(p + c)
            mask[i, width - len(p):width + len(c)] = 1
        with torch.no_grad():
            scored = completion_logprobs(policy, ids, mask, length, params.temperature)
        for i, row in enumerate(got.logprobs):
            torch.testing.assert_close(torch.tensor(row), scored[i, :len(row)], atol=2e-5, rtol=1e-5)


@needs_vllm
def test_lora_policy_is_merged_into_the_engine(engine, base_model, tokenizer, prompts):
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(copy.deepcopy(base_model),
                            LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a trained adapter: B is zero at initialization
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    seeds = list(range(len(prompts)))
    assert_follows(engine, base_model, policy, tokenizer, prompts, seeds)
    sampled = engine.generate(prompts, SamplingParams(max_new_tokens=16), seeds)
    for prompt, completion, logprobs in zip(prompts, sampled.ids, sampled.logprobs):
        want = recomputed_logprobs(policy, prompt, completion, SamplingParams(max_new_tokens=16))
        torch.testing.assert_close(torch.tensor(logprobs), want, atol=2e-5, rtol=1e-5)
    # The policy itself is left as it was: adapters unmerged, still trainable.
    assert not any(m.merged for m in policy.modules() if hasattr(m, "merged"))
    assert any(p.requires_grad for n, p in policy.named_parameters() if "lora_" in n)


@needs_vllm
def test_seeds_make_a_run_repeatable(engine, base_model, prompts):
    engine.update_weights(base_model)
    params = SamplingParams(max_new_tokens=24, temperature=1.5)
    batch = [prompts[0]] * 4 + prompts[1:3]
    seeds = [7, 8, 9, 10, 11, 12]
    first = engine.generate(batch, params, seeds)
    again = engine.generate(batch, params, seeds)
    assert first.ids == again.ids and first.logprobs == again.logprobs
    assert len({tuple(r) for r in first.ids[:4]}) > 1  # one prompt, different seeds: different completions
    other = engine.generate(batch, params, [s + 1000 for s in seeds])
    assert other.ids != first.ids
    # A row's completion depends on its own seed, not on the rows beside it.
    alone = engine.generate([batch[2]], params, [seeds[2]])
    assert alone.ids[0] == first.ids[2]


@needs_vllm
def test_without_per_row_seeds_the_rows_share_the_batched_sampler(engine, base_model, prompts):
    """vllm_per_row_seeds false (the GPU default): no request carries a seed, so rows given one and the same seed
    still differ (with per-row seeds they would be equal), and the log-probs are still the sampled distribution's."""
    params = SamplingParams(max_new_tokens=24, temperature=1.5)
    engine.update_weights(base_model)
    assert len({tuple(r) for r in engine.generate([prompts[0]] * 4, params, [7] * 4).ids}) == 1
    engine.per_row_seeds = False
    try:
        out = engine.generate([prompts[0]] * 4, params, [7] * 4)
    finally:
        engine.per_row_seeds = True
    assert len({tuple(r) for r in out.ids}) > 1
    for completion, logprobs in zip(out.ids, out.logprobs):
        torch.testing.assert_close(torch.tensor(logprobs), recomputed_logprobs(base_model, prompts[0], completion,
                                                                               params), atol=2e-5, rtol=1e-5)


@needs_vllm
def test_truncation_and_eos(engine, base_model, tokenizer, prompts):
    engine.update_weights(base_model)
    eos = tokenizer.eos_token_id
    short = engine.generate(prompts, SamplingParams(max_new_tokens=3, top_k=1), list(range(len(prompts))))
    assert all(len(r) == 3 for r in short.ids) and all(short.truncated)
    full = engine.generate(prompts, GREEDY, list(range(len(prompts))))
    for row, truncated in zip(full.ids, full.truncated):
        assert eos not in row[:-1]  # nothing after EOS
        assert truncated == (row[-1] != eos) and (truncated or len(row) <= GREEDY.max_new_tokens)
    # Another stop token: completions end on it, EOS kept, exactly where our sampler stops with the same ids.
    stop = tokenizer.convert_tokens_to_ids("</think>")
    engine.eos_ids = [eos, stop]
    try:
        got = engine.generate(prompts, GREEDY, list(range(len(prompts))))
    finally:
        engine.eos_ids = [eos]
    want = ours(base_model, tokenizer, prompts, GREEDY, list(range(len(prompts))), eos_ids=[eos, stop])
    assert got.ids == want.ids and got.truncated == want.truncated
    assert any(r and r[-1] == stop for r in got.ids)


@needs_vllm
def test_sleep_mode_on_this_platform(engine, base_model, tokenizer, prompts):
    from vllm.platforms import current_platform

    from grpo.engines.vllm import VLLMEngine

    # Without sleep mode, sleep() and wake() do nothing and the engine keeps generating.
    engine.update_weights(base_model)
    engine.sleep()
    engine.wake()
    assert engine.generate(prompts[:2], GREEDY, [0, 1]).ids == ours(base_model, tokenizer, prompts[:2], GREEDY,
                                                                    [0, 1]).ids
    if not current_platform.is_sleep_mode_available():  # the CPU build: refused before an engine is built
        with pytest.raises(ValueError, match="sleep mode"):
            VLLMEngine(ASSET, eos_ids=[0], enable_sleep_mode=True)


def test_missing_vllm_says_how_to_install(monkeypatch):
    from grpo.engines import vllm as engine_module

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(ImportError, match=r'pip install "grpo\[vllm\]".*bash scripts/vllm_env.sh'):
        engine_module.VLLMEngine(ASSET, eos_ids=[0])



@needs_vllm
def test_tool_rollouts_through_vllm_sample_from_the_whole_conversation():
    """The multi-turn tool loop (grpo.agents) over the vLLM engine, on the shipped tool-calling model: rows call the
    calculator, and every model token's vLLM log-prob is the one our model gives it after the whole conversation
    so far (prompt, earlier turns and the calculator's answers): later turns were generated from that context."""
    from test_tiny_tools_model import ASSET as TOOLS, shipped_rollout
    from transformers import AutoModelForCausalLM

    from grpo.engines.vllm import VLLMEngine

    def vllm_engine(model, tokenizer):
        return VLLMEngine(str(TOOLS), eos_ids=[tokenizer.eos_token_id], dtype=torch.float32, max_model_len=256,
                          gpu_memory_utilization=0.1, enforce_eager=True, kv_cache_memory_bytes=32 << 20)

    params = SamplingParams(128, 1.0)
    t, _ = shipped_rollout(vllm_engine, n=16, params=params)
    assert any(s["calls"] for s in t.stats) and t.logprobs is not None
    model = AutoModelForCausalLM.from_pretrained(TOOLS, local_files_only=True, dtype=torch.float32).eval()
    checked = 0
    for prompt, ids, mask, logprobs, stats in zip(t.prompt_ids, t.ids, t.model_mask, t.logprobs, t.stats):
        ref = recomputed_logprobs(model, prompt, ids, params)
        for m, a, b in zip(mask, logprobs, ref.tolist()):
            if m:
                assert abs(a - b) < 1e-3
        checked += stats["calls"] > 0 and sum(mask) < len(mask)  # a turn after a tool answer was checked
    assert checked > 0
