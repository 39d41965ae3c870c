"""Build `grpo/assets/tiny-vision`: a tiny Qwen2-VL-shaped model and its processor, for the `shapes` task.

    python scripts/build_tiny_vision_model.py --out grpo/assets/tiny-vision            # the shipped checkpoint, ~10 min
    python scripts/build_tiny_vision_model.py --out /tmp/v --steps 0                   # untrained, seconds

1. Tokenizer: tiny-arith's byte-level tokenizer (grpo/assets/tiny-arith) plus Qwen2-VL's four vision tokens
   (<|vision_start|>, <|vision_end|>, <|image_pad|>, <|video_pad|>) as special tokens, and a chat template that
   renders image parts as <|vision_start|><|image_pad|><|vision_end|> (the processor expands the pad to the
   image's tokens), a user turn as its text and a newline, and nothing for the generation prompt.
2. Processor: `Qwen2VLProcessor` with a PIL image processor fixed to 64x64 pixels (min = max pixels), patches of 8
   pixels, 2x2 merge: 64 patches, 16 image tokens per picture.
3. Model: `Qwen2VLForConditionalGeneration`: text 4 layers, hidden 128, 4 heads (head dim 32, M-RoPE sections
   4/6/6), tied embeddings; vision 2 blocks of width 64 projecting to 128.
4. Pre-training (`--steps`, default 900 of 32 rows, AdamW at `--lr` 3e-4, constant): supervised on the `shapes`
   train split, the loss on the answer and EOS. The answer is written two ways: "<answer>N</answer>" for a share
   `--tagged` (default 0.4) of the rows, drawn per row, and the bare count "N" for the others. The task's reward
   (math_accuracy) reads only the tagged form, so the checkpoint counts better than it scores: the latent ability a
   short GRPO run unlocks (recipes/vision_shapes.yaml; docs/vision.md has the numbers). The shipped checkpoint is
   this script's defaults (seed 0, one thread: 550 s on the 2-core machine shared with other jobs, 179 s of CPU):
   loss 5.63 at step 0, 0.37 at step 899; held-out accuracy 0.300 sampled at temperature 1.0 (the count right in
   either form 0.776, tagged 0.406 of the time; PROVENANCE.md).
   Measured on the way: with every answer tagged, 400 steps gave 0.478 sampled (0.755 greedy, 200 problems), and
   GRPO on it gained 2 points at lr 1e-4 in 60 steps and lost at 3e-4 and up; label smoothing 0.75 on the count
   instead of two forms gave a near-uniform 0.255 sampled (0.51 greedy, 200 problems) after 700 steps.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpo.engines.images import model_inputs, split_rows  # noqa: E402
from grpo.training.data.vision import ImageProcessing, with_image_parts  # noqa: E402

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n' }}"
    "{% endfor %}"
)
PIXELS = 64 * 64


def build_processor() -> ImageProcessing:
    """The tokenizer (with the chat template) and the image processor, as grpo's vision path uses them. (Not a
    `Qwen2VLProcessor`: transformers 5.24 cannot build one without torchvision, which the CPU env lacks.)"""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = AutoTokenizer.from_pretrained(ROOT / "grpo/assets/tiny-arith")
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = CHAT_TEMPLATE
    images = Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2,
                                      size={"shortest_edge": PIXELS, "longest_edge": PIXELS})
    return ImageProcessing(tok, images)


def build_model(processor, seed: int) -> Qwen2VLForConditionalGeneration:
    tok = processor.tokenizer
    torch.manual_seed(seed)
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         tie_word_embeddings=True),
        vision_config=dict(depth=2, embed_dim=64, hidden_size=128, num_heads=4, mlp_ratio=2, patch_size=8,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"),
        tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id)
    return Qwen2VLForConditionalGeneration(config).float()


def pretrain(model, processor, steps: int, batch: int, lr: float, seed: int, tagged: float = 1.0,
             log=print) -> None:
    """Supervised steps on the shapes train split: prompt + image -> the count + EOS, written "<answer>N</answer>"
    for a `tagged` share of the rows (drawn per row, seeded) and as the bare digit "N" for the others."""
    from grpo.tasks import get_task

    rows = get_task("shapes").make_rows("train", steps * batch, seed)
    tok = processor.tokenizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng, forms = random.Random(seed), random.Random(f"{seed}/forms")
    model.train()
    for step in range(steps):
        part = rng.sample(rows, batch)
        pixels, grids = processor.features([r["image"] for r in part])
        seqs, starts = [], []
        for r, grid in zip(part, grids):
            text = tok.apply_chat_template(with_image_parts(r["prompt"], 1), tokenize=False, add_generation_prompt=True)
            prompt = processor.expand(tok(text, add_special_tokens=False)["input_ids"], grid[None])
            text = f"<answer>{r['answer']}</answer>" if forms.random() < tagged else r["answer"]
            answer = tok(text, add_special_tokens=False)["input_ids"]
            seqs.append(prompt + answer + [tok.eos_token_id])
            starts.append(len(prompt))
        width = max(len(x) for x in seqs)
        ids = torch.full((batch, width), tok.pad_token_id)
        labels = torch.full((batch, width), -100)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for i, (x, start) in enumerate(zip(seqs, starts)):  # left-padded; the loss on the answer and EOS only
            ids[i, width - len(x):], mask[i, width - len(x):] = torch.tensor(x), 1
            labels[i, width - len(x) + start:] = torch.tensor(x[start:])
        images = split_rows(pixels, grids, [1] * batch)
        enc = {"input_ids": ids, "attention_mask": mask, **model_inputs(images, ids, model.config)}
        loss = model(**enc, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            log(f"step {step}: loss {loss.item():.3f}")
    model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "grpo/assets/tiny-vision"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=900)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--tagged", type=float, default=0.4)
    args = parser.parse_args()
    if not 0.0 <= args.tagged <= 1.0:
        parser.error(f"--tagged is the share of rows whose answer is tagged: 0..1, got {args.tagged}")
    torch.set_num_threads(1)
    started = time.time()
    processor = build_processor()
    model = build_model(processor, args.seed)
    if args.steps:
        pretrain(model, processor, args.steps, args.batch, args.lr, args.seed, args.tagged)
    out = Path(args.out)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {n:,} parameters, {args.steps} pre-training steps, {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
