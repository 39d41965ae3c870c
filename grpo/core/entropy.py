"""The entropy bonus and Skywork-OR1's adaptive coefficient (arXiv:2505.22312), as TRL 1.16 defines them.

The bonus is the mean token entropy over the tokens the surrogate acts on, with the loss L = L_policy - c * H; it is
not rescaled by the surrogate's aggregation, so c means the same for every loss. Adaptive control moves c by a fixed
step after every optimizer step: up while the step's entropy is at or below the target, down otherwise, within
[c_min, c_max]; the bonus applies only while the last measured entropy is at or below the target.
"""

from __future__ import annotations

from torch import Tensor


def entropy_bonus(entropy: Tensor, mask: Tensor, coef: float, normalizer: float | Tensor | None = None) -> Tensor:
    """Scalar -coef * sum(entropy * mask) / normalizer (default: the mask's token count, the micro-batch mean).

    entropy (N, T) with its gradient, mask (N, T) bool or 0/1. A caller that accumulates micro-batches passes
    normalizer = tokens x micro-batches (x processes) so their sum is the mean of the micro-batches' means."""
    mask = mask.to(entropy.dtype)
    count = normalizer if normalizer is not None else mask.sum().clamp(min=1.0)
    return -coef * (entropy * mask).sum() / count


def adaptive_entropy_coef(coef: float, entropy: float, target: float, delta: float, low: float,
                          high: float) -> float:
    """The coefficient after an optimizer step whose mean token entropy was `entropy`."""
    return min(coef + delta, high) if entropy <= target else max(coef - delta, low)


def applied_entropy_coef(coef: float, last_entropy: float, target: float, adaptive: bool) -> float:
    """The coefficient this step's bonus uses: adaptive control applies it only at or below the target (the last
    step's entropy; +inf before any was measured), a fixed coefficient always."""
    if not adaptive:
        return coef
    return coef if last_entropy <= target else 0.0
