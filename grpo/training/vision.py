"""Images in the prompt: TRL's vision-language data rendered for a Qwen2-VL-shaped model, and the pixel features of
each row carried to every pass (generation, old/reference log-probs, the update).

Data as TRL 1.16 takes it: an `image` column (one image per row) or an `images` column (a list), each a PIL image, a
path or a `datasets.Image` value; the prompt (text or messages) gets one `{"type": "image"}` part per image before
the first user message's text (TRL's `prepare_multimodal_messages`); prompts whose messages already hold image parts
with their `image` payload keep them. The chat template renders each image part as Qwen2-VL's
`<|vision_start|><|image_pad|><|vision_end|>`, and the one pad becomes as many as the image has tokens
(`grid_t * grid_h * grid_w / merge_size**2`), as `Qwen2VLProcessor` does.

Per-row features: `RowImages(pixel_values (patches, D), image_grid_thw (images, 3))`. The image processor returns
the patches of a whole batch concatenated; `split_rows` cuts them back into rows from the per-image patch counts
(`image_grid_thw.prod(-1)`), so a micro-batch's rows take exactly their own patches (`model_inputs`). Image tokens
sit in the prompt, which never enters the loss; the sampler never draws them (`vision_token_ids`).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from grpo.config import ConfigError
from grpo.engines.images import RowImages, split_rows  # noqa: F401 (one import place for both)

IMAGE_COLUMNS = ("image", "images")
IMAGE_PAD = "<|image_pad|>"
VISION_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


def is_vision_config(config) -> bool:
    """Whether a model config is a vision-language one (it has a vision tower's config)."""
    return getattr(config, "vision_config", None) is not None


def check_vision_model(config) -> None:
    """Only the Qwen2-VL family is wired today; other vision-language models are refused by name."""
    kind = getattr(config, "model_type", None)
    if kind not in VISION_MODEL_TYPES:
        raise ConfigError(f"model_name_or_path: vision-language model type {kind!r} is not supported yet (grpo "
                          f"trains {', '.join(VISION_MODEL_TYPES)}; docs/vision.md).")


class ImageProcessing:
    """A tokenizer with a chat template and Qwen2-VL's image processor, saved side by side in a model directory (a
    `Qwen2VLProcessor` works too: its `tokenizer` and `image_processor` are used)."""

    def __init__(self, tokenizer, image_processor):
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.merge = int(getattr(image_processor, "merge_size", 2))
        self.pad_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        if self.pad_id is None or self.pad_id == tokenizer.unk_token_id:
            raise ConfigError(f"processing_class: the tokenizer has no {IMAGE_PAD} token; a Qwen2-VL tokenizer is "
                              "needed for image prompts.")

    @classmethod
    def of(cls, processing_class, tokenizer, path: str | None) -> "ImageProcessing":
        """From a processor (TRL's processing_class), else from the model directory's image processor files."""
        if processing_class is not None and hasattr(processing_class, "image_processor"):
            return cls(tokenizer, processing_class.image_processor)
        from transformers import AutoImageProcessor

        try:
            return cls(tokenizer, AutoImageProcessor.from_pretrained(path))
        except (OSError, ValueError) as err:
            raise ConfigError(f"model_name_or_path: {path!r} is a vision-language model but its image processor "
                              f"does not load ({err}); save it beside the model (preprocessor_config.json).") from None

    def save_pretrained(self, path) -> None:
        self.tokenizer.save_pretrained(path)
        self.image_processor.save_pretrained(path)

    def features(self, images: list) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values (patches, D), image_grid_thw (images, 3)) of a list of PIL images."""
        out = self.image_processor(images=images, return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]

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


def vision_prompts(prompts: list, table: dict[str, list], processing: ImageProcessing, render,
                   limit: int | None, chunk: int = 256) -> tuple[list[list[int]], list[list]]:
    """(token ids, images) per row: each prompt with its image parts, rendered to text by `render(messages)` (the
    chat template: grpo.training.data.render_prompt), each image pad expanded to the image's token count (the grids
    come from the image processor, a chunk of rows at a time). A prompt over `limit` tokens is an error."""
    column = image_column(list(table))
    images = [row_images(p, table[column][i] if column else None, i) for i, p in enumerate(prompts)]
    ids = []
    for start in range(0, len(prompts), chunk):
        part = range(start, min(start + chunk, len(prompts)))
        flat = [img for i in part for img in images[i]]
        grids = processing.features(flat)[1] if flat else torch.zeros((0, 3), dtype=torch.long)
        first = 0
        for i in part:
            text = render(with_image_parts(prompts[i], len(images[i])))
            row = processing.tokenizer(text, add_special_tokens=False)["input_ids"]
            ids.append(processing.expand(row, grids[first:first + len(images[i])]))
            first += len(images[i])
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


def image_processing_for(cfg, processing_class, tokenizer, model=None) -> ImageProcessing | None:
    """The run's ImageProcessing when the model (loaded, or at model_name_or_path) is a vision-language one, else
    None; the engines that cannot take images yet are refused by name."""
    config = getattr(model, "config", None)
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(cfg.model_name_or_path, revision=cfg.model_revision,
                                            trust_remote_code=cfg.trust_remote_code)
    if not is_vision_config(config):
        return None
    check_vision_model(config)
    if cfg.use_vllm:
        raise ConfigError("use_vllm: vLLM's multimodal inputs are not wired yet; a vision-language model trains on "
                          "the transformers engine (use_vllm: false; docs/vision.md).")
    path = getattr(model, "name_or_path", None) or cfg.model_name_or_path
    return ImageProcessing.of(processing_class, tokenizer, path)
