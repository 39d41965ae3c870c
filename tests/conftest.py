"""Shared fixtures: a tiny randomly initialized causal LM with a character tokenizer, built on the spot."""

from __future__ import annotations

import os

import pytest

# The suite runs in parallel (pyproject's addopts: `-n auto`, pytest-xdist). Each worker gets an equal share of the
# cores for torch's threads (set before any test module imports torch), so two workers on two cores do not run four
# spinning OpenMP threads; processes a test starts inherit it unless the test sets its own.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0))
                                                     // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker per core this process may use, at most 4 (each imports torch and transformers, and many
    tests start processes of their own). `-n 0` runs the suite in one process, as `pytest tests/test_x.py -n 0`."""
    return max(1, min(len(os.sched_getaffinity(0)), 4))


def build_char_tokenizer(path):
    """One token per byte (a BPE with no merges over the byte-level alphabet), so decode(encode(s)) == s and
    transformers 5's Qwen2 tokenizer class, which re-applies byte-level splitting on load, keeps it intact."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(["<eos>", "<pad>", *alphabet])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<eos>", "<pad>")])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   clean_up_tokenization_spaces=False)
    fast.save_pretrained(path)
    return fast


def build_tiny_model(path, hidden: int = 32, layers: int = 2, seed: int = 0, context: int = 256):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_char_tokenizer(path)
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=context, tie_word_embeddings=True,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer, 32-wide Qwen2 model and a byte tokenizer (258 tokens), saved to a temp directory."""
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-model")))


def load_script(name: str):
    """A script of scripts/ (not a package), imported by path once."""
    import importlib.util
    import sys
    from pathlib import Path

    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


@pytest.fixture(scope="session")
def tools_model_dir(tmp_path_factory):
    """A 1-layer random Qwen2 with the tool-calling tokenizer and chat template of grpo/assets/tiny-tools."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("tools-model")
    script = load_script("build_tiny_tools_model")
    tok = script.build_tokenizer()
    tok.save_pretrained(path)
    script.without_unk(path)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory):
    """The tiny model with a chat template on its tokenizer (roles in <|...|>, one message a line), and a context of
    1024 tokens for the default max_completion_length."""
    from transformers import AutoTokenizer

    path = build_tiny_model(tmp_path_factory.mktemp("tiny-chat-model"), context=1024)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return str(path)
