"""Model and data options: chat templates for instruct models, and 4-bit loading refused on a CPU-only machine."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.config import ConfigError

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_chat_messages_go_through_the_template(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = TEMPLATE
    seen = {}

    def reward(prompts, completions, **kwargs):
        seen["prompt"], seen["completion"] = prompts[0], completions[0]
        return [float(len(c[0]["content"])) for c in completions]

    cfg = GRPOConfig(output_dir=str(tmp_path / "run"), task=None, num_generations=2, prompts_per_step=1,
                     max_completion_length=4, learning_rate=1e-3, beta=0.0, max_steps=1, save_steps=0, report_to=[],
                     log_completions_steps=0, system_prompt="be brief", prefill="<think>")
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": "2+2?"}]]})
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=[reward], args=cfg, train_dataset=data,
                          processing_class=tok)
    rendered = tok.decode(trainer.train_set.prompt_ids[0])
    assert rendered == "<|system|>be brief\n<|user|>2+2?\n<|assistant|><think>"
    trainer.train()
    # Conversational datasets get conversational completions, as in TRL.
    assert seen["prompt"] == [{"role": "user", "content": "2+2?"}]
    assert isinstance(seen["completion"], list) and seen["completion"][0]["role"] == "assistant"


def test_plain_text_needs_no_template_and_messages_need_one(tiny_model_dir, tmp_path):
    cfg = GRPOConfig(output_dir=str(tmp_path / "run"), task=None, report_to=[])
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]]})
    with pytest.raises(ConfigError, match="the tokenizer has no chat template"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=[lambda completions, **k: [0.0] * len(completions)],
                    args=cfg, train_dataset=data)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_4bit_on_cpu_is_a_clear_error(tiny_model_dir, tmp_path):
    cfg = GRPOConfig(output_dir=str(tmp_path / "run"), task=None, report_to=[], load_in_4bit=True, use_peft=True,
                     max_completion_length=16)
    with pytest.raises(ConfigError, match="load_in_4bit: 4-bit \\(QLoRA\\) loading needs a CUDA GPU"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=["think_format"], args=cfg,
                    train_dataset=Dataset.from_dict({"prompt": ["x"]}))


def test_4bit_with_vllm_is_refused_by_name():
    """QLoRA's base is packed 4-bit data: vLLM's copy cannot take it plus a LoRA delta (a shape error at the first
    weight push), so the config refuses the pair before anything loads."""
    with pytest.raises(ConfigError, match="load_in_4bit: 4-bit \\(QLoRA\\) weights cannot be handed to vLLM"):
        GRPOConfig(load_in_4bit=True, use_peft=True, use_vllm=True)
    GRPOConfig(load_in_4bit=True, use_peft=True)  # the transformers sampler runs it


def test_one_pass_loss_buffer_cap_is_larger_for_a_frozen_head(tiny_model_dir, monkeypatch):
    """completion_loss takes the one-pass path only when a row's (T, V) logits fit the cap: the small cap for a
    trained head, the large one for a frozen head (no weight gradient shares the memory). The loss it returns is
    the plain path's either way."""
    from transformers import AutoModelForCausalLM

    import grpo.engines.cpu.backend as gm
    import grpo.engines.policy as policy

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(2, vocab, (2, 9))
    mask = torch.ones_like(ids)
    T = 4
    monkeypatch.setattr(gm, "_FUSED_ELEMENTS", T * vocab - 1)  # one row does not fit the trained head's cap
    monkeypatch.setattr(gm, "_FUSED_ELEMENTS_FROZEN_HEAD", T * vocab)  # and fits the frozen head's

    def row_loss(logp, rows):
        return -logp.sum()

    assert gm.completion_loss(model, ids, mask, T, 1.0, row_loss) is None
    model.get_output_embeddings().weight.requires_grad_(False)
    loss, logp, _ = gm.completion_loss(model, ids, mask, T, 1.0, row_loss)
    want = policy.completion_logprobs(model, ids, mask, T, 1.0)
    torch.testing.assert_close(logp, want.detach())
    torch.testing.assert_close(loss.detach(), -want.sum().detach())
