"""Image features on the engine side: each row's image features (`RowImages`), cut from a processor's batch output
(`split_rows`) and put together for the rows of one forward (`model_inputs`).

A row keeps what the processor returned for its images, by the processor's own key names (`pixel_values`, and
`image_grid_thw` for Qwen2-VL, `pixel_attention_mask` for Idefics3, ...), each tensor with the row's images (or, for
processors that batch by row, the row itself) along dim 0. The rows of a forward get each key concatenated along
dim 0 in their order, as the model expects them, whatever cut of rows into micro-batches made them. The keys the
processor gives per token (`mm_token_type_ids`, Gemma 3's `token_type_ids`: 1 on image tokens) are made again on
the padded rows from the image token id.

Qwen2-VL's image processor returns the patches of all its images concatenated, (patches, D), with one (t, h, w)
patch grid per image; image k has t*h*w patches (`split_rows`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch


@dataclass
class RowImages:
    """One row's image features: the processor's outputs for its images by key, images (or the row) along dim 0,
    and the names of the processor's per-token keys (made from the ids: `model_inputs`)."""

    features: dict[str, torch.Tensor]
    token_types: tuple[str, ...] = ()
    # A row without images: a blank image's features, run through the vision side (not the model) when no row of a
    # forward has pixels, so that its parameters get (zero) gradients on every process (`vision_zero`).
    stand_in: dict[str, torch.Tensor] | None = None

    @property
    def pixel_values(self) -> torch.Tensor:
        return self.features["pixel_values"]

    @property
    def image_grid_thw(self) -> torch.Tensor:  # (images, 3): Qwen2-VL's (t, h, w) patch grid of each image
        return self.features["image_grid_thw"]


QWEN_TOKEN_TYPES = ("mm_token_type_ids",)  # (what Qwen2VLProcessor returns per token: M-RoPE reads it)


def split_rows(pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, images_per_row: list[int]) -> list[RowImages]:
    """Qwen2-VL's batch features cut into rows: image k has image_grid_thw[k].prod() patches, in order."""
    patches = image_grid_thw.prod(-1).tolist()  # (images,)
    if sum(patches) != pixel_values.shape[0]:
        raise ValueError(f"split_rows: the grids name {sum(patches)} patches, pixel_values has {pixel_values.shape[0]}")
    out, image, patch = [], 0, 0
    for n in images_per_row:
        count = sum(patches[image:image + n])
        out.append(RowImages({"pixel_values": pixel_values[patch:patch + count],
                              "image_grid_thw": image_grid_thw[image:image + n]}, QWEN_TOKEN_TYPES))
        image, patch = image + n, patch + count
    return out


def model_inputs(images: list[RowImages], input_ids: torch.Tensor, config, device=None) -> dict[str, torch.Tensor]:
    """The model's image arguments for rows (in the order of input_ids's rows): each feature concatenated over the
    rows that have it, and the per-token keys (1 on image tokens)."""
    device = device or input_ids.device
    out = {}
    for key in dict.fromkeys(k for r in images for k in r.features):
        parts = [r.features[key] for r in images if key in r.features]
        if len({tuple(p.shape[1:]) for p in parts}) > 1:
            raise ValueError(f"model_inputs: the rows' {key!r} have shapes {sorted({tuple(p.shape) for p in parts})}; "
                             "rows whose images the processor cuts into different numbers of crops or sizes cannot "
                             "share a forward (give images of one size, or per_device_train_batch_size: 1)")
        out[key] = torch.cat(parts).to(device)
    types = (input_ids == config.image_token_id).int().to(device)
    return {**out, **{key: types for r in images[:1] for key in r.token_types}}


def has_pixels(row: RowImages) -> bool:
    """Whether a row carries image features (a row without images has none, or Qwen2-VL's zero patches)."""
    pixels = row.features.get("pixel_values")
    return pixels is not None and pixels.numel() > 0


def vision_zero(model, images: list[RowImages], device) -> torch.Tensor | None:
    """0 x the vision side's output on a stand-in image when no row of a forward has pixels (else None): added to
    the loss, every vision parameter gets a zero gradient. Without it a process whose micro-batch has no image
    leaves a trainable vision tower without gradients, and DDP (find_unused_parameters off, accelerate's default)
    raises at the next step while the other processes' all-reduce waits (verl and TRL feed such a pass too)."""
    stand_in = next((r.stand_in for r in images if r.stand_in is not None), None)
    get = getattr(model, "get_image_features", None)
    if stand_in is None or get is None or any(has_pixels(r) for r in images):
        return None
    takes = inspect.signature(get).parameters
    out = get(**{k: v.to(device) for k, v in stand_in.items() if k in takes})
    return 0.0 * sum(t.float().sum() for t in _tensors(out))


def _tensors(out) -> list[torch.Tensor]:
    """The tensors in a model output (a tensor, a tuple or list of them, or a ModelOutput's values)."""
    if isinstance(out, torch.Tensor):
        return [out]
    values = out.values() if hasattr(out, "values") else out if isinstance(out, (list, tuple)) else []
    return [t for v in values for t in _tensors(v)]


def is_vision_config(config) -> bool:
    """Whether a model config is a vision-language one (it has a vision tower's config)."""
    return getattr(config, "vision_config", None) is not None


_VISION_TOKENS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id", "boi_token_id",
                  "eoi_token_id")


def vision_token_ids(config) -> list[int]:
    """Tokens a completion must never hold: a sampled image token would have no features (TRL suppresses it), and
    the tokens that open or close an image (Qwen2-VL's vision start/end, Gemma 3's begin/end of image)."""
    return [int(getattr(config, n)) for n in _VISION_TOKENS if getattr(config, n, None) is not None]


def own_positions(model) -> bool:
    """Whether the model computes its positions from the images itself (M-RoPE: Qwen2-VL, Qwen2.5-VL and the
    families with a `get_rope_index`); the others take the text positions of the padded rows, as any LM."""
    return any(callable(getattr(m, "get_rope_index", None)) for m in model.modules())
