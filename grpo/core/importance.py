"""Importance-sampling correction for the mismatch between the rollout engine's sampling distribution and the
trainer's policy (TRL 1.16's `vllm_importance_sampling_*`; Yao et al., "Your efficient RL framework secretly brings
you off-policy RL training", 2025).

A fast engine (vLLM: other kernels, another precision, a stale weight copy) samples from pi_engine, while the loss
assumes the tokens came from pi_old, the trainer's policy at sampling time. Weighting each token's surrogate by
pi_old / pi_engine makes the update unbiased again; the ratio is bounded (truncated or masked) to keep its variance
finite.

Modes (TRL's names and meanings):
    token_truncate      w_it = clip(r_it, c_min, c_max),   r_it = pi_old(o_it) / pi_engine(o_it)
    token_mask          w_it = r_it if c_min <= r_it <= c_max else 0
    sequence_truncate   w_i  = clip(R_i, c_min, c_max),    R_i = prod_t r_it over the row's tokens
    sequence_mask       w_i  = R_i if c_min <= R_i <= c_max else 0   (TRL's default, c_max = 3)
c_min = None: no lower bound; c_max = None: no upper bound. Tokens outside the mask, or whose engine log-prob is
NaN (not given), count as r = 1.
"""

from __future__ import annotations

import torch
from torch import Tensor

IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def engine_importance_weights(trainer_logp: Tensor, engine_logp: Tensor, mask: Tensor,
                              mode: str = "sequence_mask", clip_max: float | None = 3.0,
                              clip_min: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token weights of the surrogate, (N, T), that correct for sampling from the engine instead of the trainer.

    Args:
        trainer_logp: (N, T) log pi_old of the sampled tokens, recomputed by the trainer (detached here).
        engine_logp: (N, T) log pi_engine of the same tokens, as the engine sampled them.
        mask: (N, T) bool or 0/1, True on the completion tokens that enter the loss.
        mode, clip_max, clip_min: see the module docstring.

    Returns:
        (weights (N, T), detached, 0 outside the mask, a sequence mode's weight repeated on every token of its row;
        metrics: detached scalars over the mask's tokens (rows for sequence modes): ratio_mean, ratio_min,
        ratio_max of r before bounding, bounded_frac (the fraction clipped or masked), and engine_kl, the mean
        log pi_engine - log pi_old per token, a k1 estimate of KL(pi_engine || pi_old) on the engine's samples).
    """
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(f"engine_importance_weights: mode={mode!r} is not one of {IMPORTANCE_SAMPLING_MODES}")
    if trainer_logp.shape != engine_logp.shape or trainer_logp.shape != mask.shape or trainer_logp.dim() != 2:
        raise ValueError(f"engine_importance_weights: trainer_logp, engine_logp and mask must be one (N, T) shape, "
                         f"got {tuple(trainer_logp.shape)}, {tuple(engine_logp.shape)} and {tuple(mask.shape)}")
    mask = mask.bool()
    diff = torch.where(mask, trainer_logp.detach().float() - engine_logp.detach().float(), 0.0)  # (N, T)
    diff = torch.nan_to_num(diff, nan=0.0)
    sequence = mode.startswith("sequence")
    log_ratio = diff.sum(-1, keepdim=True) if sequence else diff  # (N, 1) or (N, T)
    ratio = torch.exp(log_ratio)
    low = torch.full_like(ratio, -torch.inf if clip_min is None else clip_min)
    high = torch.full_like(ratio, torch.inf if clip_max is None else clip_max)
    outside = (ratio < low) | (ratio > high)
    weights = torch.clamp(ratio, low, high) if mode.endswith("truncate") else ratio.masked_fill(outside, 0.0)
    weights = torch.where(mask, weights.expand_as(diff), 0.0)

    counted = (mask.any(-1, keepdim=True) if sequence else mask).float()  # rows (or tokens) the statistics cover
    n = counted.sum()
    some = n > 0  # (masked reductions, no indexing: the host never waits for the device here)
    metrics = {
        "ratio_mean": (ratio * counted).sum() / n.clamp(min=1),
        "ratio_min": torch.where(some, ratio.masked_fill(counted == 0, torch.inf).min(), 0.0),
        "ratio_max": torch.where(some, ratio.masked_fill(counted == 0, -torch.inf).max(), 0.0),
        "bounded_frac": (outside.float() * counted).sum() / n.clamp(min=1),
        "engine_kl": -diff.sum() / mask.sum().clamp(min=1),
    }
    return weights, metrics
