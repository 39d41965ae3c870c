"""The engine seam: one rule chooses the engine (and says why), a forced choice is honoured or refused with a clear
message, both engines train to the same weights, and the model and the process are as they were after train()."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.config import ConfigError
from grpo.engines.base import ScriptedGenerator
from grpo.engines.select import choose_engine
from rewards_for_tests import count_a


def tiny(dtype=torch.float32):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, architectures=["Qwen2ForCausalLM"])
    return Qwen2ForCausalLM(config).to(dtype)


CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_a_float32_model_on_the_cpu_in_one_process_takes_the_cpu_engine():
    choice = choose_engine("auto", tiny(), CPU, 1, "NO")
    assert (choice.name, choice.reason) == ("cpu", "float32 Qwen2 on CPU, 1 process")


@pytest.mark.parametrize("dtype, device, processes, distributed, reason", [
    (torch.float32, CUDA, 1, "NO", "cuda, float32 Qwen2, 1 process"),
    (torch.bfloat16, CPU, 1, "NO", "cpu, bfloat16 Qwen2, 1 process"),
    (torch.bfloat16, CUDA, 8, "MULTI_GPU", "cuda, bfloat16 Qwen2, 8 processes"),
    (torch.float32, CPU, 2, "MULTI_CPU", "cpu, float32 Qwen2, 2 processes"),
    (torch.float32, CPU, 1, "DEEPSPEED", "cpu, float32 Qwen2, 1 process"),
])
def test_a_gpu_another_dtype_or_a_wrapped_model_takes_the_transformers_engine(dtype, device, processes,
                                                                              distributed, reason):
    choice = choose_engine("auto", tiny(dtype), device, processes, distributed)
    assert (choice.name, choice.reason) == ("transformers", reason)


def test_a_forced_engine_is_honoured_and_an_impossible_one_refused():
    assert choose_engine("transformers", tiny(), CPU, 1, "NO").name == "transformers"
    assert choose_engine("cpu", tiny(), CPU, 1, "NO").name == "cpu"
    with pytest.raises(ConfigError, match=r"engine: 'cpu' runs a float32 model on the CPU in one process, but here "
                                          r"the model trains on cuda, its weights are bfloat16; set engine to auto"):
        choose_engine("cpu", tiny(torch.bfloat16), CUDA, 1, "NO")
    with pytest.raises(ConfigError, match="engine: 'cpu' .* but here 2 processes"):
        choose_engine("cpu", tiny(), CPU, 2, "MULTI_CPU")


def config(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path / "run"), task=None, num_generations=4, prompts_per_step=2,
                  max_completion_length=6, learning_rate=1e-2, beta=0.04, max_steps=2, save_steps=0, report_to=[],
                  log_completions_steps=0, seed=0, per_device_train_batch_size=4, num_iterations=2)
    values.update(overrides)
    return GRPOConfig(**values)


def length(completions, **kwargs):
    return [len(c) / 6 for c in completions]


def scripted(tokenizer):
    """Completions of 1-6 tokens drawn from the row's seed: both engines train on the same rows."""
    def complete(prompt_ids, rng):
        n = int(torch.randint(1, 6, (1,), generator=rng))
        return torch.randint(2, 60, (n,), generator=rng).tolist() + [tokenizer.eos_token_id]
    return ScriptedGenerator(complete, [tokenizer.eos_token_id])


def test_both_engines_train_to_the_same_weights(tiny_model_dir, tmp_path):
    """The transformers engine (plain passes) and the cpu engine (one-pass loss, fused ops, disk reference) compute
    the same update: same completions in, the same weights out up to float32 rounding, and learning happened."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    weights = {}
    for engine in ("cpu", "transformers"):
        t = GRPOTrainer(model=tiny_model_dir, reward_funcs=[length], args=config(tmp_path / engine, engine=engine),
                        train_dataset=Dataset.from_dict({"prompt": [f"q{i}\n" for i in range(8)]}),
                        generator=scripted(tok))
        assert (t.engine.name, type(t.backend).__name__) == (
            engine, {"cpu": "CPUBackend", "transformers": "TransformersBackend"}[engine])
        t.train()
        weights[engine] = {k: v.clone() for k, v in t.policy.state_dict().items()}
    moved = max((weights["cpu"][k] - start[k]).abs().max().item() for k in start)
    diff = max((weights["cpu"][k] - weights["transformers"][k]).abs().max().item() for k in start)
    assert moved > 1e-2 and diff < 1e-4, (moved, diff)  # rounding order only: Adam at lr 1e-2 moves ~1e-2 a step


def test_train_hands_back_the_model_and_the_process_as_they_were(tiny_model_dir, tmp_path, monkeypatch):
    """While training, the cpu engine switches the policy's and the reference's MLPs and RMSNorms to fused passes, their
    attention to its grouped one, and makes the tied embedding's gradient sparse; when train() returns every module
    has its own forward back, the attention is sdpa again, the embedding is dense again, and nothing process-wide
    (glibc's malloc) was changed by the library."""
    from grpo.engines.cpu import native

    if native.library() is None:
        pytest.skip("no C compiler: nothing is fused")
    tuned = []
    monkeypatch.setattr(native, "keep_freed_memory", lambda: tuned.append(1))
    t = GRPOTrainer(model=tiny_model_dir, reward_funcs=[count_a], args=config(tmp_path, max_steps=1),
                    train_dataset=Dataset.from_dict({"prompt": [f"q{i}\n" for i in range(8)]}))
    modules = [*t.policy.modules(), *t.reference.module.modules()]
    switched = [m for m in modules if "forward" in vars(m)]
    assert t.engine.name == "cpu" and len(switched) == 2 * (2 * 2 + 1 + 2)  # two models, as fuse_decoder_ops counts
    assert t.policy.get_input_embeddings().sparse
    configs = [t.policy.config, t.reference.module.config]
    assert [c._attn_implementation for c in configs] == ["grpo_prefix_sdpa"] * 2  # the packed passes' attention
    t.train()
    assert [m for m in modules if "forward" in vars(m) or "_grpo_unfused_forward" in vars(m)] == []
    assert not t.policy.get_input_embeddings().sparse
    assert [c._attn_implementation for c in configs] == ["sdpa"] * 2
    assert tuned == []
    t.train()  # a second train() switches them on again, and off at its end
    assert [m for m in modules if "forward" in vars(m)] == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU tier: needs a CUDA GPU")
def test_on_a_gpu_the_transformers_engine_learns(tiny_model_dir, tmp_path):
    """GPU tier: on CUDA the run takes the transformers engine, every pass runs on the device, and the reward of a
    learnable task rises as on the CPU (tests/test_trainer.py's first test)."""
    cfg = config(tmp_path, beta=0.04, num_iterations=1, max_steps=20, num_generations=8, prompts_per_step=4,
                 max_completion_length=8, learning_rate=2e-2, per_device_train_batch_size=8)
    t = GRPOTrainer(model=tiny_model_dir, reward_funcs=[count_a], args=cfg,
                    train_dataset=Dataset.from_dict({"prompt": [f"q{i % 10}\n" for i in range(16)]}))
    assert (t.engine.name, t.accel.device.type, next(t.policy.parameters()).device.type) == (
        "transformers", "cuda", "cuda")
    rewards = []
    while t.step < 20:
        rewards.append(t.train_step()["reward/total"])
        t.step += 1
    assert sum(rewards[:3]) / 3 < 0.15 and sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.3, rewards
