"""Tiny random-weight vision-language models of several families, built from config objects (no download), each
saved with its processor in a directory `GRPOTrainer` loads as it loads a hub model (used by
test_vision_families.py; `microbatched_logprobs`, the update pass over micro-batched rows, by test_vision.py too).

The tokenizer is tiny-vision's byte tokenizer with each family's image tokens added and a chat template that writes
the family's image placeholder for each image part. Sizes: text models of 2 layers, 64 wide; vision towers of 1-2
layers, 32 wide, on 32x32 or 64x64 pictures (16 image tokens each, 4 for Idefics3).
"""

from __future__ import annotations

from pathlib import Path

import torch

ASSET = Path(__file__).resolve().parents[1] / "grpo" / "assets" / "tiny-vision"
TEMPLATE = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
            "{% for part in m['content'] %}{% if part['type'] == 'image' %}PLACEHOLDER"
            "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{{ '\\n' }}"
            "{% endfor %}")
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, pad_token_id=1, eos_token_id=0, bos_token_id=2)
FAMILIES = ("qwen2_5_vl", "gemma3", "llava", "idefics3")


def _tokenizer(placeholder: str, **special):
    """tiny-vision's tokenizer with `special` tokens added (name -> token: extra_special_tokens, so the processor
    finds `tokenizer.image_token` and the like) and a template writing `placeholder` for each image part."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ASSET, extra_special_tokens=special) if special else \
        AutoTokenizer.from_pretrained(ASSET)
    tok.chat_template = TEMPLATE.replace("PLACEHOLDER", placeholder)
    return tok


def qwen2_5_vl():
    """Qwen2.5-VL: tiny-vision's tokens and image processor (no processor object: Qwen2_5_VLProcessor needs
    torchvision for its video processor), a 2-block windowed vision tower."""
    from transformers import (AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                              Qwen2VLImageProcessorPil)

    tok = AutoTokenizer.from_pretrained(ASSET)
    config = Qwen2_5_VLConfig(
        text_config=dict(**TEXT, vocab_size=len(tok), rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                     "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, window_size=32,
                           fullatt_block_indexes=[1]),
        image_token_id=265, video_token_id=266, vision_start_token_id=263, vision_end_token_id=264,
        tie_word_embeddings=True)
    image = Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2, min_pixels=64 * 64,
                                     max_pixels=64 * 64)
    return Qwen2_5_VLForConditionalGeneration(config), (tok, image)


def gemma3():
    """Gemma 3: a SigLIP tower on 64x64 pictures in 8-pixel patches, pooled to 16 soft tokens between
    <start_of_image> and <end_of_image>."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil, Gemma3Processor

    tok = _tokenizer("<start_of_image>", image_token="<image_soft_token>", boi_token="<start_of_image>",
                     eoi_token="<end_of_image>")
    config = Gemma3Config(
        text_config=dict(TEXT, vocab_size=len(tok), head_dim=16, query_pre_attn_scalar=16, sliding_window=512),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, image_size=64, patch_size=8),
        mm_tokens_per_image=16, image_token_index=tok.image_token_id, boi_token_index=tok.boi_token_id,
        eoi_token_index=tok.eoi_token_id)
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 64, "width": 64}),
                                tokenizer=tok, image_seq_length=16, chat_template=tok.chat_template)
    return Gemma3ForConditionalGeneration(config), processor


def llava():
    """LLaVA: a CLIP tower on 32x32 pictures in 8-pixel patches (16 patches and a CLS token, which the default
    feature strategy drops: 16 image tokens) and a Qwen2 language model."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaImageProcessorPil, LlavaProcessor

    tok = _tokenizer("<image>", image_token="<image>")
    config = LlavaConfig(
        text_config=dict(TEXT, model_type="qwen2", vocab_size=len(tok)),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=32, patch_size=8, projection_dim=32),
        image_token_index=tok.image_token_id, vision_feature_layer=-1, tie_word_embeddings=True)
    image = LlavaImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = LlavaProcessor(image_processor=image, tokenizer=tok, patch_size=8,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=tok.chat_template)
    return LlavaForConditionalGeneration(config), processor


def idefics3():
    """Idefics3 (SmolVLM's architecture): a 32x32 picture, not split, in 8-pixel patches, pixel-shuffled by 2 to 4
    image tokens between <fake_token_around_image> and <global-img> tags."""
    from transformers import (AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration,
                              Idefics3ImageProcessorPil, Idefics3Processor)

    tok = AutoTokenizer.from_pretrained(ASSET)
    tok.add_special_tokens({"additional_special_tokens": ["<fake_token_around_image>", "<image>",
                                                          "<end_of_utterance>", "<global-img>"]})
    tok.chat_template = TEMPLATE.replace("PLACEHOLDER", "<image>")
    config = Idefics3Config(
        text_config=dict(TEXT, model_type="llama", vocab_size=len(tok)),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=8),
        scale_factor=2, image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=True)
    image = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": 32},
                                      max_image_size={"longest_edge": 32})
    processor = Idefics3Processor(image_processor=image, tokenizer=tok, image_seq_len=4,
                                  chat_template=tok.chat_template)
    return Idefics3ForConditionalGeneration(config), processor


def build(family: str, path: Path) -> Path:
    """The family's tiny model with its processor (or tokenizer and image processor), saved in `path`."""
    torch.manual_seed(0)
    model, processing = globals()[family]()
    with torch.no_grad():  # (Gemma 3 starts its image projection at 0: images would not matter)
        for p in model.parameters():
            if p.dim() >= 2 and not p.any():
                p.normal_(0, 0.02)
    model.generation_config.pad_token_id = TEXT["pad_token_id"]
    model.save_pretrained(path)
    for part in processing if isinstance(processing, tuple) else (processing,):
        part.save_pretrained(path)
    return path


def smolvlm(path: Path) -> Path:
    """A SmolVLM directory as the hub has it (model, tokenizer, image processor, processor config), tiny: its
    processor (SmolVLMProcessor) needs a video processor, which needs torchvision."""
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration, SmolVLMImageProcessorPil

    tok = _tokenizer("<image>")
    config = SmolVLMConfig(text_config=dict(TEXT, model_type="llama", vocab_size=len(tok)),
                           vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=2, image_size=32, patch_size=8),
                           scale_factor=2, image_token_id=265)
    SmolVLMForConditionalGeneration(config).save_pretrained(path)
    tok.save_pretrained(path)
    SmolVLMImageProcessorPil().save_pretrained(path)
    (path / "processor_config.json").write_text('{"processor_class": "SmolVLMProcessor", "image_seq_len": 4}')
    return path


def microbatched_logprobs(model, pad_id: int, ids: list[list[int]], completions: list[list[int]], images: list):
    """(log-probs (N, T), the rows' input_ids, attention, completion mask) of prompt + completion rows cut into
    micro-batches of 2 in a shuffled order and scored by the update's backend, each with its own images."""
    from grpo.engines.policy import TransformersBackend
    from grpo.training.update.micro_batches import MicroBatches
    from grpo.training.rollout.batch import RolloutBatch, pack

    class OneProcess:
        world = 1

    input_ids, attention, mask = pack(ids, completions, pad_id, [True] * len(ids))
    batch = RolloutBatch(input_ids, attention, mask, torch.zeros(len(ids)), images=images)
    backend, got = TransformersBackend(model, None), torch.zeros(mask.shape)
    order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for plan in MicroBatches(2, None, None, OneProcess()).plan(batch, order):
            x = plan.inputs(batch, "cpu")
            got[plan.rows, :plan.width] = backend.logprobs(model, x.input_ids, x.attention_mask, plan.width, 1.0,
                                                           images=x.images)
    return got, input_ids, attention, mask
