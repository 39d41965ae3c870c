"""Image features on the engine side: each row's pixel features (`RowImages`), cut from a processor's batch output
(`split_rows`) and put together for the rows of one forward (`model_inputs`), for a Qwen2-VL-shaped model.

The image processor returns the patches of all its images concatenated, (patches, D), with one (t, h, w) patch grid
per image; image k has t*h*w patches. Rows keep their own patches, so any cut of rows into micro-batches gives
each forward exactly its rows' images, in its rows' order, as the model expects them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowImages:
    """One row's image features: its images' patches (patches, D) and their (t, h, w) patch grids (images, 3)."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor


def split_rows(pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, images_per_row: list[int]) -> list[RowImages]:
    """The processor's batch features cut into rows: image k has image_grid_thw[k].prod() patches, in order."""
    patches = image_grid_thw.prod(-1).tolist()  # (images,)
    if sum(patches) != pixel_values.shape[0]:
        raise ValueError(f"split_rows: the grids name {sum(patches)} patches, pixel_values has {pixel_values.shape[0]}")
    out, image, patch = [], 0, 0
    for n in images_per_row:
        count = sum(patches[image:image + n])
        out.append(RowImages(pixel_values[patch:patch + count], image_grid_thw[image:image + n]))
        image, patch = image + n, patch + count
    return out


def model_inputs(images: list[RowImages], input_ids: torch.Tensor, config, device=None) -> dict[str, torch.Tensor]:
    """The model's image arguments for rows (in the order of input_ids's rows): their patches and grids
    concatenated, and the token types M-RoPE reads (1 on image tokens)."""
    device = device or input_ids.device
    return {"pixel_values": torch.cat([r.pixel_values for r in images]).to(device),
            "image_grid_thw": torch.cat([r.image_grid_thw for r in images]).to(device),
            "mm_token_type_ids": (input_ids == config.image_token_id).int().to(device)}


def vision_token_ids(config) -> list[int]:
    """Tokens a completion must never hold: a sampled image token would have no features (TRL suppresses it)."""
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return [int(getattr(config, n)) for n in names if getattr(config, n, None) is not None]


