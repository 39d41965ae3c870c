"""Shared fixtures: a tiny randomly initialized causal LM with a character tokenizer, built on the spot."""

from __future__ import annotations

import string

import pytest

CHARS = list(string.ascii_lowercase + string.digits + " +-*=\n<>/")


def build_char_tokenizer(path):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for c in CHARS:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.save_pretrained(path)
    return fast


def build_tiny_model(path, hidden: int = 32, layers: int = 2, seed: int = 0):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_char_tokenizer(path)
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=True,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer, 32-wide Qwen2 model and a character tokenizer (about 40 tokens), saved to a temp directory."""
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-model")))
