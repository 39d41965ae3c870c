"""Images in the prompt: TRL's vision-language data rendered for the model's processor, and the image features of
each row carried to every pass (generation, old/reference log-probs, the update).

Data as TRL 1.16 takes it: an `image` column (one image per row) or an `images` column (a list), each a PIL image, a
path or a `datasets.Image` value; the prompt (text or messages) gets one `{"type": "image"}` part per image before
the first user message's text (TRL's `prepare_multimodal_messages`); prompts whose messages already hold image parts
with their `image` payload keep them. The chat template renders each image part as the family's placeholder, which
becomes as many image tokens as the image has:
- with the model's processor (`ProcessorImages`: Gemma 3, LLaVA, Idefics3, ...), as the processor expands it;
- for Qwen2-VL / Qwen2.5-VL without one (`ImageProcessing`: their processor needs torchvision), each
  `<|image_pad|>` repeated `grid_t * grid_h * grid_w / merge_size**2` times, as `Qwen2VLProcessor` does.

Per-row features: `RowImages`, the processor's image outputs of the row by key (grpo.engines.images), made again
from the row's PIL images each time a rollout samples it (`row_features`). Image tokens sit in the prompt, which
never enters the loss; the sampler never draws them (`vision_token_ids`).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from grpo.config import ConfigError
from grpo.engines.images import QWEN_TOKEN_TYPES, RowImages, is_vision_config, split_rows

IMAGE_COLUMNS = ("image", "images")
IMAGE_PAD = "<|image_pad|>"


def vision_modules(model) -> list[str]:
    """The vision side of a vision-language model by module name: the children of its inner model other than the
    language model (Qwen2-VL's `model.visual`; Gemma 3's and LLaVA's `model.vision_tower` and
    `model.multi_modal_projector`; Idefics3's `model.vision_model` and `model.connector`); [] for a language model."""
    if not is_vision_config(getattr(model, "config", None)):
        return []
    decoder = model.get_decoder()
    for outer, inner in model.named_children():
        if any(child is decoder for child in inner.children()):
            return [f"{outer}.{name}" for name, child in inner.named_children()
                    if child is not decoder and next(child.parameters(), None) is not None]
    return []


class ImageProcessing:
    """Qwen2-VL's way without its processor: a tokenizer with a chat template and Qwen2-VL's image processor, saved
    side by side in a model directory (transformers 5.24 cannot build `Qwen2VLProcessor` without torchvision, for its
    video processor). Each image pad becomes as many pads as the image has merged patches."""

    def __init__(self, tokenizer, image_processor):
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.merge = int(getattr(image_processor, "merge_size", 2))
        self.pad_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        if self.pad_id is None or self.pad_id == tokenizer.unk_token_id:
            raise ConfigError(f"processing_class: the tokenizer has no {IMAGE_PAD} token; a Qwen2-VL tokenizer is "
                              "needed for image prompts without a processor.")

    @classmethod
    def of(cls, processing_class, tokenizer, path: str | None):
        """From a processor (TRL's processing_class), else the model directory's processor (`AutoProcessor`), else
        (Qwen2-VL without torchvision) the directory's tokenizer and image processor."""
        if processing_class is not None and hasattr(processing_class, "image_processor"):
            return ProcessorImages(processing_class)
        from transformers import AutoImageProcessor, AutoProcessor

        try:
            processor = AutoProcessor.from_pretrained(path)
            if hasattr(processor, "image_processor") and hasattr(processor, "tokenizer"):
                return ProcessorImages(processor)
            why = f"AutoProcessor gives a {type(processor).__name__}"
        except (ImportError, OSError, ValueError, TypeError, AttributeError) as err:
            why = " ".join(str(err).split()).split(". ")[0] or type(err).__name__  # (its first sentence)
        try:  # (Qwen2-VL's image processor, merge_size and all, beside a tokenizer with its image pad)
            image = AutoImageProcessor.from_pretrained(path)
        except (OSError, ValueError):
            image = None
        if image is None or not hasattr(image, "merge_size") or tokenizer.convert_tokens_to_ids(IMAGE_PAD) in (
                None, tokenizer.unk_token_id):
            raise ConfigError(f"model_name_or_path: {path!r} is a vision-language model whose processor does not "
                              f"load ({why}); pass processing_class=AutoProcessor.from_pretrained(...) or install "
                              "what it needs (docs/vision.md).") from None
        return cls(tokenizer, image)

    def save_pretrained(self, path) -> None:
        self.tokenizer.save_pretrained(path)
        self.image_processor.save_pretrained(path)

    def features(self, images: list) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values (patches, D), image_grid_thw (images, 3)) of a list of PIL images."""
        out = self.image_processor(images=images, return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]

    def row_features(self, rows: list[list]) -> list[RowImages]:
        """Each row's features (its list of PIL images), from one call of the image processor."""
        flat = [img for row in rows for img in row]
        if not flat:  # (rows without images only: the image processor refuses an empty list)
            return [RowImages({}, QWEN_TOKEN_TYPES) for _ in rows]
        return split_rows(*self.features(flat), [len(row) for row in rows])

    def encode(self, texts: list[str], images: list[list], chunk: int = 256) -> list[list[int]]:
        """Token ids of rendered prompts, each image pad expanded to its image's token count (the grids come from
        the image processor, a chunk of rows at a time)."""
        ids = []
        for start in range(0, len(texts), chunk):
            part = range(start, min(start + chunk, len(texts)))
            flat = [img for i in part for img in images[i]]
            grids = self.features(flat)[1] if flat else torch.zeros((0, 3), dtype=torch.long)
            first = 0
            for i in part:
                row = self.tokenizer(texts[i], add_special_tokens=False)["input_ids"]
                ids.append(self.expand(row, grids[first:first + len(images[i])]))
                first += len(images[i])
        return ids

    def expand(self, ids: list[int], grids: torch.Tensor) -> list[int]:
        """`ids` with the k-th image pad repeated as many times as image k has tokens."""
        counts = (grids.prod(-1) // self.merge**2).tolist()
        if ids.count(self.pad_id) != len(counts):
            raise ConfigError(f"chat template: the prompt renders {ids.count(self.pad_id)} image placeholders for "
                              f"{len(counts)} images; each image needs one {{'type': 'image'}} part.")
        out, k = [], 0
        for t in ids:
            if t == self.pad_id:
                out += [t] * counts[k]
                k += 1
            else:
                out.append(t)
        return out


class ProcessorImages:
    """A transformers processor (`Gemma3Processor`, `LlavaProcessor`, `Idefics3Processor`, `Qwen2VLProcessor`
    where torchvision is installed, ...): it expands each image placeholder itself, and every key of its output
    but the text's is carried per row (`RowImages`), whatever the family calls it."""

    def __init__(self, processor):
        self.processor, self.tokenizer, self.image_processor = processor, processor.tokenizer, processor.image_processor

    def save_pretrained(self, path) -> None:
        self.processor.save_pretrained(path)

    def encode(self, texts: list[str], images: list[list]) -> list[list[int]]:
        """Token ids of rendered prompts, the processor's expansion of each image placeholder included."""
        return [self.processor(text=[t], images=[row] if row else None, add_special_tokens=False)["input_ids"][0]
                for t, row in zip(texts, images)]

    def row_features(self, rows: list[list]) -> list[RowImages]:
        """Each row's image outputs of the processor (one call per row: each keeps its own batch layout); the keys
        it gives per token (the shape of its input_ids) are named, to be made again on padded rows."""
        out = []
        for row in rows:
            if not row:  # (a row without images: nothing to carry)
                out.append(RowImages({}))
                continue
            got = self.processor(images=[row], return_tensors="pt")
            ids = got.get("input_ids")
            per_token = tuple(k for k, v in got.items() if ids is not None and k not in TEXT_KEYS
                              and getattr(v, "shape", None) == ids.shape)
            # Qwen2-VL's processor gives mm_token_type_ids only with text; transformers 5.17's M-RoPE requires it
            # (5.24 makes it from the ids), so where the processor names it as a model input it is made per row too.
            declared = getattr(self.processor, "model_input_names", ())
            per_token += tuple(k for k in QWEN_TOKEN_TYPES if k in declared and k not in per_token)
            out.append(RowImages({k: v for k, v in got.items() if k not in TEXT_KEYS and k not in per_token},
                                 per_token))
        return out


TEXT_KEYS = ("input_ids", "attention_mask")


def image_column(columns: list[str]) -> str | None:
    """The dataset's image column (TRL's names), or None."""
    return next((c for c in IMAGE_COLUMNS if c in columns), None)


def load_image(value: Any, row: int):
    """A PIL RGB image from a PIL image, a path, or a `datasets.Image` dict ({"bytes"} or {"path"})."""
    from PIL import Image

    if isinstance(value, dict):
        value = io.BytesIO(value["bytes"]) if value.get("bytes") else value.get("path")
    if isinstance(value, (str, Path, io.BytesIO)):
        value = Image.open(value)
    if not hasattr(value, "convert"):
        raise ConfigError(f"dataset row {row}: the image is a {type(value).__name__}, not a PIL image, a path or a "
                          "datasets.Image value.")
    return value.convert("RGB")


def with_image_parts(prompt: Any, n_images: int) -> list[dict]:
    """The prompt as messages with `n_images` image parts before the first user message's text (TRL's
    prepare_multimodal_messages); messages that already hold image parts are kept as they are."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if any(isinstance(m["content"], list) for m in messages):
        return messages
    for m in messages:
        if m["role"] == "user":
            m["content"] = [{"type": "image"}] * n_images + [{"type": "text", "text": m["content"]}]
            return messages
    raise ConfigError("dataset: an image row's prompt has no user message to put its images in.")


def row_images(prompt: Any, value: Any, row: int) -> list:
    """A row's images: its image column's value (one or a list), or the payloads of its messages' image parts."""
    if value is not None:
        values = value if isinstance(value, list) else [value]
        return [load_image(v, row) for v in values]
    parts = [p for m in prompt if isinstance(m["content"], list) for p in m["content"] if p.get("type") == "image"]
    return [load_image(p.get("image"), row) for p in parts]


def sample_images(prompts: list, columns: dict[str, list], row: int) -> dict[str, list]:
    """{"images": the row's PIL images} for the samples log (it writes them as thumbnails beside the completions)."""
    column = image_column(list(columns))
    return {"images": row_images(prompts[row], columns[column][row] if column else None, row)}


def check_image_tokens_masked(input_ids: torch.Tensor, completion_mask: torch.Tensor, image_token_id: int) -> None:
    """Image tokens belong to prompts: none may sit under the loss mask (N, T) of the completion columns."""
    completion = input_ids[:, -completion_mask.shape[1]:]
    if bool(((completion == image_token_id) & (completion_mask > 0)).any()):
        raise RuntimeError("an image token entered the loss mask: a completion holds an image token (it should be "
                           "suppressed in sampling)")


def vision_prompts(prompts: list, table: dict[str, list], processing, render,
                   limit: int | None) -> tuple[list[list[int]], list[list]]:
    """(token ids, images) per row: each prompt with its image parts, rendered to text by `render(messages)` (the
    chat template: grpo.training.data.prompts.render_prompt), each image placeholder expanded to the image's tokens by
    `processing` (ImageProcessing or ProcessorImages). A prompt over `limit` tokens is an error."""
    column = image_column(list(table))
    images = [row_images(p, table[column][i] if column else None, i) for i, p in enumerate(prompts)]
    ids = processing.encode([render(with_image_parts(p, len(images[i]))) for i, p in enumerate(prompts)], images)
    long = [i for i, x in enumerate(ids) if limit is not None and len(x) > limit]
    if long:  # (cutting a prompt would cut its image tokens from their features)
        raise ConfigError(f"max_prompt_length: row {long[0]}'s prompt is {len(ids[long[0]])} tokens with its image "
                          f"tokens, over {limit}; image prompts are not truncated: raise max_prompt_length or set it "
                          "to null.")
    return ids, images


def has_images(columns: list[str], prompts: list) -> bool:
    """Whether a dataset carries images: an image column, or image parts in its first prompt's messages."""
    first = prompts[0] if prompts else None
    parts = isinstance(first, list) and any(isinstance(m.get("content"), list) and any(
        isinstance(p, dict) and p.get("type") == "image" for p in m["content"]) for m in first)
    return image_column(columns) is not None or parts


def image_processing_for(cfg, processing_class, tokenizer,
                         model=None) -> ImageProcessing | ProcessorImages | None:
    """The run's ImageProcessing or ProcessorImages when the model (loaded, or at model_name_or_path) is a
    vision-language one, else None; the engines that cannot take images yet are refused by name."""
    config = getattr(model, "config", None)
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(cfg.model_name_or_path, revision=cfg.model_revision,
                                            trust_remote_code=cfg.trust_remote_code)
    if not is_vision_config(config):
        return None
    if cfg.use_vllm:
        raise ConfigError("use_vllm: vLLM's multimodal inputs are not wired yet (vLLM's CPU build cannot load "
                          "Qwen2-VL, LLaVA or Gemma 3 without torchvision: tests/test_vllm_vision.py); a "
                          "vision-language model trains on the transformers engine (use_vllm: false; docs/vision.md).")
    path = getattr(model, "name_or_path", None) or cfg.model_name_or_path
    return ImageProcessing.of(processing_class, tokenizer, path)
