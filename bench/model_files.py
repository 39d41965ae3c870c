"""The benchmark's model files: a randomly initialized Qwen2 model and a character tokenizer, built on the spot.

How every completion gets exactly T tokens on both sides, with generation still measured: the tokenizer has V + 1
tokens and its EOS is the last one, id V, while the model's output layer has V rows (ids 0 .. V-1). No sampler can
draw a token the model has no logit for, so no completion ends early and both trainers run the full
`max_completion_length`, through their ordinary generation code, with their ordinary EOS handling switched on.
Padding uses the same id V: every prompt has the same length and every completion the same length, so nothing is
ever padded, and should a trainer try to feed a pad token the embedding lookup fails loudly instead of quietly
changing the work. (Alternatives ruled out: `min_new_tokens` exists only on TRL's side; a very negative EOS logit
needs an output-layer bias, which Qwen2 does not have.)

Tokens 0 .. 95 are newline and the 95 printable ASCII characters; ids 96 .. V-1 are placeholders `<|tNNN|>` (they
decode to that text), so a 151,000-token vocabulary has a real embedding table and output layer of that size.
"""

from __future__ import annotations

from pathlib import Path

import torch

from bench.workloads import Workload

EOS = "<|endoftext|>"
# GPT-2's byte-level alphabet writes newline as "Ċ" and space as "Ġ"; "!" .. "~" stand for themselves.
CHARS = ["Ċ", "Ġ", *(chr(c) for c in range(0x21, 0x7F))]


def vocabulary(size: int) -> dict[str, int]:
    """token -> id for ids 0 .. size-1: the characters first, then placeholders."""
    if size < len(CHARS):
        raise ValueError(f"vocabulary: size {size} is smaller than the {len(CHARS)} characters; use >= {len(CHARS)}.")
    tokens = CHARS + [f"<|t{i}|>" for i in range(len(CHARS), size)]
    return {t: i for i, t in enumerate(tokens)}


def build_tokenizer(size: int):
    """One token per character of newline and printable ASCII, EOS = id `size`.

    Byte-level BPE with no merges: transformers 5 loads a Qwen2 model's tokenizer as its Qwen2 class, which
    re-applies byte-level splitting; on a byte-level vocabulary that changes nothing (tests/conftest.py does the
    same). A character outside newline and printable ASCII has no token.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(vocab=vocabulary(size), merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(EOS, special=True, normalized=False)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, pad_token=EOS,
                                   model_input_names=["input_ids", "attention_mask"],
                                   clean_up_tokenization_spaces=False)


def build_model(w: Workload):
    """A Qwen2ForCausalLM of workload w's size with tied embeddings, float32, seeded.

    Its config names no EOS or pad id (an id outside the vocabulary would be an embedding's padding_idx); the
    generation config and the tokenizer carry EOS = pad = V.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=w.vocab, hidden_size=w.hidden, intermediate_size=w.intermediate,
                         num_hidden_layers=w.layers, num_attention_heads=w.heads, num_key_value_heads=w.kv_heads,
                         max_position_embeddings=max(256, w.prompt_length + w.completion_length),
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                         dtype="float32")
    torch.manual_seed(w.seed)
    return Qwen2ForCausalLM(config)


def write_model_dir(w: Workload, path: Path) -> int:
    """Save the model, its generation config and the tokenizer into `path`; returns the parameter count (tied
    embeddings counted once).

    A ragged workload's EOS is the model's last token, id V-1 (the tokenizer's placeholders end one earlier). At
    initialization a token's final hidden state is mostly its own (tied) embedding, normalized, so every embedding
    row gets a shared component 0.1 u (u a seeded unit vector) and the EOS row is `eos_weight` u: the EOS logit
    after any token is then about eos_weight x 0.1 / rms, above the others by a margin that varies from token to
    token, so completions end at ragged, long-tailed lengths (measured in bench/workloads.py). The shift common to
    all other logits leaves their softmax as it was.
    """
    from transformers import GenerationConfig

    path.mkdir(parents=True, exist_ok=True)
    eos = w.vocab - 1 if w.ragged else w.vocab
    tokenizer = build_tokenizer(eos)
    if tokenizer.eos_token_id != eos:
        raise RuntimeError(f"write_model_dir: EOS got id {tokenizer.eos_token_id}, expected {eos}.")
    model = build_model(w)
    if w.ragged:
        u = torch.randn(w.hidden, generator=torch.Generator().manual_seed(1))
        u /= u.norm()
        with torch.no_grad():
            embedding = model.get_input_embeddings().weight
            embedding += 0.1 * u
            embedding[eos] = w.eos_weight * u
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())
