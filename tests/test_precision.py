"""Precision on the training side (issue 29): what AdamW does to bf16 weights at a GPU recipe's learning rate, and
the start-up warning about it."""

from __future__ import annotations

import warnings

import pytest
import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer


def _length(completions, **kwargs):
    """Varies between a random model's completions, so every group has advantages and the step a gradient."""
    return [float(len(c)) for c in completions]


def _one_step(model_dir, out, **overrides):
    """(share of the trainable weights one optimizer step changed, the warnings the trainer's start gave)."""
    values = dict(output_dir=str(out), task=None, num_generations=4, prompts_per_step=2, max_completion_length=8,
                  learning_rate=1e-6, beta=0.0, max_steps=1, save_steps=0, report_to=[], log_completions_steps=0,
                  seed=0, per_device_train_batch_size=8, temperature=1.5, disable_tqdm=True)
    values.update(overrides)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = GRPOTrainer(model=model_dir, reward_funcs=[_length], args=GRPOConfig(**values),
                              train_dataset=Dataset.from_dict({"prompt": [f"q{i}\n" for i in range(8)]}))
    before = {k: p.detach().clone() for k, p in trainer.policy.named_parameters()}
    trainer.train()
    after = dict(trainer.policy.named_parameters())
    changed = sum(int((after[k].detach() != v).sum()) for k, v in before.items())
    return changed / sum(v.numel() for v in before.values()), [str(w.message) for w in caught]


def test_adamw_on_bf16_weights_at_lr_1e_6_rounds_the_step_away_and_float32_weights_under_autocast_take_it(
        tiny_model_dir, tmp_path):
    """The GPU recipe's learning rate on the tiny model's std-0.02 weights: half a bf16 ulp at |w| = 0.02 is 6e-5,
    far above Adam's first step of about lr = 1e-6, so bf16 weights stay almost all as they were; float32 weights
    under bf16 autocast (the recipe now) take the step nearly everywhere (E1 of the GPU review: 0.43% against
    98.6% on a larger model)."""
    bf16_weights, said = _one_step(tiny_model_dir, tmp_path / "bf16", torch_dtype="bfloat16")
    fp32_weights, quiet = _one_step(tiny_model_dir, tmp_path / "fp32", torch_dtype="float32", bf16=True)
    assert bf16_weights < 0.05 and fp32_weights > 0.9, (bf16_weights, fp32_weights)
    warning = [m for m in said if m.startswith("torch_dtype: bfloat16 trainable weights")]
    assert len(warning) == 1 and "learning_rate 1e-06" in warning[0] and "bf16: true" in warning[0]
    share = float(warning[0].split("leaves ")[1].split("%")[0]) / 100  # the warning's estimate of what rounds away
    assert share > 0.95 and not any("master copy" in m for m in quiet)


def test_the_rounded_away_share_is_of_low_precision_weights_only():
    from grpo.training.setup.optimizer import rounded_away

    # bf16 keeps 8 significant bits: at 1.0 the ulp is 2^-7, so +1e-3 rounds back and +1e-2 does not (2^-7 / 2 is
    # 3.9e-3); at 2^-10 the ulp is 2^-17 = 7.6e-6, so +1e-3 changes it.
    w = torch.tensor([1.0, 1.0, 2.0 ** -10, -1.0], dtype=torch.bfloat16)
    assert rounded_away([w], 1e-3) == pytest.approx(3 / 4)
    assert rounded_away([w], 1e-2) == 0.0
    assert rounded_away([torch.ones(4)], 1e-9) == 0.0  # float32: nothing to warn about


def _head_case(dtype=torch.bfloat16):
    """Hidden states and an LM head whose logits have a std of about 4 (a trained model's range), and the float64
    log-probs of exactly those (rounded) values."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 24, 64).to(dtype), (0.5 * torch.randn(500, 64)).to(dtype)
    tokens = torch.randint(0, 500, (2, 24))
    exact = torch.log_softmax(hidden.double() @ weight.double().T, -1).gather(-1, tokens[..., None])[..., 0]
    return hidden, weight, tokens, exact


def test_cast_lm_head_to_fp32_gives_log_probs_closer_to_the_exact_ones():
    """bf16 logits are rounded to 8 significant bits before the softmax (about 0.016 at a logit of 4); the float32
    head's product is exact to float32, for bf16 weights and for float32 weights under bf16 autocast alike."""
    from grpo.engines.head import hidden_logprobs

    hidden, weight, tokens, exact = _head_case()
    off, _ = hidden_logprobs(hidden, weight, tokens)
    on, _ = hidden_logprobs(hidden, weight, tokens, float32_head=True)
    hidden32, weight32 = hidden.float().requires_grad_(), weight.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast_off, _ = hidden_logprobs(hidden32, weight32, tokens)
        autocast_on, _ = hidden_logprobs(hidden32, weight32, tokens, float32_head=True)
    errors = [float((x.double() - exact).abs().max()) for x in (off, on, autocast_off, autocast_on)]
    assert errors[1] < 1e-4 and errors[3] < 1e-4 and min(errors[0], errors[2]) > 1e-2, errors
    autocast_on.sum().backward()  # the gradient is taken in float32 too: d logp / d h = W_y - sum_v p_v W_v
    p = torch.softmax(hidden.double() @ weight.double().T, -1)
    want = weight.double()[tokens] - p @ weight.double()
    torch.testing.assert_close(hidden32.grad.double(), want, atol=1e-5, rtol=0)


def test_cast_lm_head_to_fp32_is_taken_and_gives_policy_and_reference_a_float32_head(tiny_model_dir, tmp_path):
    """The key (TRL's, from a trl.GRPOConfig too) casts the head of the policy and of the reference to float32 and
    leaves the tied embedding's outputs in the weights' dtype; a step trains."""
    trl = pytest.importorskip("trl")
    from grpo.config import from_trl

    assert from_trl(trl.GRPOConfig(output_dir="x", use_cpu=True, cast_lm_head_to_fp32=True,
                                   report_to="none")).cast_lm_head_to_fp32
    cfg = GRPOConfig(output_dir=str(tmp_path / "run"), task=None, num_generations=2, per_device_train_batch_size=2,
                     max_completion_length=4, max_steps=1, report_to=[], beta=0.04, torch_dtype="bfloat16",
                     cast_lm_head_to_fp32=True, disable_tqdm=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (bf16 weights with AdamW: the warning of the test above)
        t = GRPOTrainer(model=tiny_model_dir, reward_funcs=[_length], args=cfg,
                        train_dataset=Dataset.from_dict({"prompt": [f"q{i}\n" for i in range(4)]}))
        for model in (t.policy, t.reference):
            assert model.get_output_embeddings().weight.dtype == torch.float32
            assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
            assert model.get_input_embeddings()(torch.tensor([[1, 2]])).dtype == torch.bfloat16
        assert t.policy.get_output_embeddings().weight is not t.reference.get_output_embeddings().weight
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # the model's own forward (the path of
            assert t.policy(input_ids=torch.tensor([[1, 2]])).logits.dtype == torch.float32  # a wrapped model)
        t.train()
    assert t.step == 1 and all(torch.isfinite(p).all() for p in t.policy.parameters())


def test_the_heads_backward_recomputes_the_logits_the_forward_normalised_outside_autocast():
    """Backward runs outside autocast (torch's advice); the tiled head's backward recomputes its logit tiles under
    the forward's autocast state, so they are the bf16 logits whose log-sum-exp the forward saved. The softmax's
    gradient then sums to zero over the vocabulary (d logp_y / d b = onehot(y) - p): recomputed in float32 instead,
    p would sum to exp(lse32 - lse16), about 1e-3 off, and so would the bias gradient's sum."""
    from grpo.engines.head import hidden_logprobs

    hidden, weight, tokens, _ = _head_case(torch.float32)
    hidden = (2 * hidden).requires_grad_()
    weight = weight.requires_grad_()
    bias = torch.zeros(500, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, _ = hidden_logprobs(hidden, weight, tokens, bias=bias)
        reference = torch.log_softmax(torch.nn.functional.linear(hidden, weight, bias).float(), -1)
        reference = reference.gather(-1, tokens[..., None])[..., 0]
    (logp.sum()).backward()  # outside autocast, as the update now calls it
    assert abs(float(bias.grad.sum())) < 1e-4 * tokens.numel()
    got = (hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    reference.sum().backward()  # plain autograd under the same autocast
    for mine, plain in zip(got, (hidden.grad, weight.grad)):
        assert float((mine - plain).norm() / plain.norm()) < 1e-2  # (plain autograd rounds its products to bf16)


def test_the_update_runs_its_backward_outside_autocast_and_its_forward_inside(tiny_model_dir, tmp_path, monkeypatch):
    from grpo.engines.policy import TransformersBackend

    seen = {}
    backward = TransformersBackend.backward

    def recording(self, loss):
        seen["backward"] = torch.is_autocast_enabled("cpu")
        seen["loss_dtype"] = loss.dtype
        return backward(self, loss)

    monkeypatch.setattr(TransformersBackend, "backward", recording)
    changed, _ = _one_step(tiny_model_dir, tmp_path, torch_dtype="float32", bf16=True, learning_rate=1e-3)
    assert seen == {"backward": False, "loss_dtype": torch.float32} and changed > 0.9


def test_full_determinism_runs_the_update_and_repeats_it_bit_for_bit(tiny_model_dir, tmp_path, monkeypatch):
    """full_determinism turns on torch's strict deterministic mode (an op without a deterministic kernel raises):
    the transformers engine's update under bf16 autocast (the tiled head's index_add_ and scatter_add_ backward,
    sdpa's backward) runs under it, and two runs end at the same weights. (On CUDA, torch's docs list index_add_,
    scatter_add_ and sdpa's flash and mem-efficient backward as switching to deterministic kernels: untested here.)"""
    import os

    from safetensors.torch import load_file

    for key in ("CUBLAS_WORKSPACE_CONFIG", "FLASH_ATTENTION_DETERMINISTIC"):
        monkeypatch.delenv(key, raising=False)  # (monkeypatch puts back what was there when the test ends)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", torch.backends.cudnn.deterministic)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
    try:
        weights = []
        for run in ("a", "b"):
            _one_step(tiny_model_dir, tmp_path / run, bf16=True, learning_rate=1e-3, full_determinism=True,
                      engine="transformers")
            assert torch.are_deterministic_algorithms_enabled()
            assert not torch.is_deterministic_algorithms_warn_only_enabled() and os.environ["CUBLAS_WORKSPACE_CONFIG"]
            weights.append(load_file(str(tmp_path / run / "final" / "model.safetensors")))
    finally:
        torch.use_deterministic_algorithms(False)
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_cast_lm_head_to_fp32_refuses_an_adapted_head():
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo.config import ConfigError
    from grpo.training.setup.model import cast_lm_head_to_fp32

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False))
    adapted = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ConfigError, match=r"cast_lm_head_to_fp32: the LM head is a peft\.tuners\.lora\.layer\.Linear, "
                                          r"not a torch\.nn\.Linear"):
        cast_lm_head_to_fp32(adapted)
