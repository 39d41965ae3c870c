"""Moving the reference policy towards the trained one (TR-DPO, arXiv:2404.09656; TRL's `sync_ref_model`)."""

from __future__ import annotations

import torch
from torch import Tensor


@torch.no_grad()
def sync_reference_(reference: dict[str, Tensor], policy: dict[str, Tensor], alpha: float) -> None:
    """In place, for every tensor of `reference`: ref = alpha * policy + (1 - alpha) * ref.

    Both map names to same-shape tensors; alpha in [0, 1] (1 copies the policy, 0 keeps the reference). A tensor
    listed under two names (tied embeddings) is mixed once."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"sync_reference_: alpha must be in [0, 1], got {alpha}")
    missing = sorted(set(reference) - set(policy))
    if missing:
        raise ValueError(f"sync_reference_: the policy has no tensor {missing[0]!r}")
    seen = set()
    for name, ref in reference.items():
        key = (ref.data_ptr(), tuple(ref.shape), ref.stride())
        if key in seen:
            continue
        seen.add(key)
        ref.lerp_(policy[name].to(ref.dtype), alpha)
