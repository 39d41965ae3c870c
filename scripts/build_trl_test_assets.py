"""Build local stand-ins for the hub models and datasets TRL's GRPO tests load, so the adapted suite runs offline.

    python scripts/build_trl_test_assets.py --out /tmp/trl-assets     # about 20 s on one core

Each `trl-internal-testing/<name>` the tests name becomes `<out>/<name>`: a randomly initialised model of the same
architecture and head (causal LM or one-label sequence classifier), a few layers 16 wide, with a byte-level
tokenizer (one token per byte, so any text round-trips) and a ChatML chat template, as TRL's tiny models carry a
chat template. The vocabulary is small (259 tokens), so a test that fakes `generate` with Qwen's token ids
(151643...) fails on both targets. The Llama tokenizers have no `<|finetune_right_pad_id|>` token, which TRL's
`test_train_different_reward_model` sets as the reward tokenizer's pad token: a pad token outside the vocabulary,
the case a trainer must survive. `zen` becomes `<out>/zen/<config>/{train,test}.jsonl` with TRL's configs'
columns: `standard_prompt_only` (`prompt`: text) and `conversational_prompt_only` (`prompt`: a list of messages),
17 training rows and 2 test rows as the hub's have. Vision models and datasets are not built (those tests are
skipped). `--only NAME` builds one model (the script's tests use it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# ChatML, with Qwen2.5's rendering of tools, tool calls and tool answers (as the hub's tiny Qwen models have)
CHATML = ("{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>"
          "<|im_end|>\n{% endif %}{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>"
          "\n{{ m['content'] }}\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n"
          "{{ m['content'] or '' }}{% for c in m.get('tool_calls') or [] %}\n<tool_call>\n{\"name\": "
          "\"{{ c['function']['name'] }}\", \"arguments\": {{ c['function']['arguments'] | tojson }}}\n</tool_call>"
          "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
          "{% endif %}")

# (name, transformers config class, model class, config overrides): 2 layers, hidden 16, 4 heads of 4 unless set
SMALL = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=32768)  # (the hub's tiny models keep their originals' context; Qwen2.5: 32768)
MODELS = [
    ("tiny-Qwen2ForCausalLM-2.5", "Qwen2Config", "Qwen2ForCausalLM", {}),
    ("tiny-Qwen2ForSequenceClassification-2.5", "Qwen2Config", "Qwen2ForSequenceClassification", {"num_labels": 1}),
    ("tiny-Qwen3ForCausalLM", "Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 4}),
    ("tiny-Qwen3ForSequenceClassification", "Qwen3Config", "Qwen3ForSequenceClassification",
     {"head_dim": 4, "num_labels": 1}),
    ("tiny-LlamaForCausalLM-3.2", "LlamaConfig", "LlamaForCausalLM", {}),
    ("tiny-LlamaForSequenceClassification-3.2", "LlamaConfig", "LlamaForSequenceClassification", {"num_labels": 1}),
    ("tiny-MistralForCausalLM-0.2", "MistralConfig", "MistralForCausalLM", {}),
    ("tiny-Gemma2ForCausalLM", "Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 4}),
    ("tiny-Cohere2ForCausalLM", "Cohere2Config", "Cohere2ForCausalLM", {}),
    ("tiny-Qwen3MoeForCausalLM", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
     {"head_dim": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}),
    ("tiny-GptOssForCausalLM", "GptOssConfig", "GptOssForCausalLM",
     {"head_dim": 4, "num_local_experts": 4, "num_experts_per_tok": 2}),
    ("tiny-Glm4MoeForCausalLM", "Glm4MoeConfig", "Glm4MoeForCausalLM",
     {"head_dim": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
      "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}),
]

ZEN_TRAIN = ["The sky is", "The sun is", "Water is", "The moon is", "Fire is", "The grass is", "A cat is",
             "The ocean is", "Snow is", "The wind is", "A tree is", "The night is", "Music is", "The city is",
             "A river is", "The earth is", "Time is"]
ZEN_TEST = ["A mountain is", "The rain is"]


def byte_tokenizer(llama: bool = False):
    """One token per byte, ChatML's markers as special tokens; eos `<|im_end|>`, pad `<|endoftext|>` (none for
    Llama)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token=None if llama else "<|endoftext|>", clean_up_tokenization_spaces=False)
    fast.chat_template = CHATML
    return fast


def build_model(out: Path, name: str, config_cls: str, model_cls: str, overrides: dict) -> None:
    import torch
    import transformers

    tok = byte_tokenizer(llama="Llama" in name)
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**SMALL, "vocab_size": len(tok), "pad_token_id": tok.pad_token_id,
                                                  "eos_token_id": tok.eos_token_id, "bos_token_id": None,
                                                  **overrides})
    model = getattr(transformers, model_cls)(config)
    path = out / name
    model.save_pretrained(path)
    tok.save_pretrained(path)


def build_zen(out: Path) -> None:
    for config, row in (("standard_prompt_only", lambda p: {"prompt": p}),
                        ("conversational_prompt_only", lambda p: {"prompt": [{"role": "user", "content": p}]})):
        folder = out / "zen" / config
        folder.mkdir(parents=True, exist_ok=True)
        for split, prompts in (("train", ZEN_TRAIN), ("test", ZEN_TEST)):
            (folder / f"{split}.jsonl").write_text("".join(json.dumps(row(p)) + "\n" for p in prompts))


def build(out: Path, only: str | None = None) -> list[str]:
    """Build every asset (or `only` that model) under `out`; the names of the models built."""
    out.mkdir(parents=True, exist_ok=True)
    build_zen(out)
    built = []
    for name, config_cls, model_cls, overrides in MODELS:
        if only is None or name == only:
            build_model(out, name, config_cls, model_cls, overrides)
            built.append(name)
    return built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", default=None, help="build one model (its name), and the datasets")
    args = parser.parse_args()
    print("\n".join(build(args.out, args.only)))


if __name__ == "__main__":
    main()
