"""Which tokens' surrogate enters the loss: the off-policy sequence mask and the high-entropy token mask.

Both multiply the per-token surrogate (never the KL term), as TRL 1.16 applies them.

  off-policy mask (DeepSeek-V3.2, arXiv:2512.02556, eq. 9): a sequence with a negative advantage whose mean
      per-token KL from the sampling policy, mean_t (log pi_sampling - log pi_theta), exceeds `threshold` is left
      out; every other sequence is kept.
  high-entropy mask ("Beyond the 80/20 rule", arXiv:2506.01939): only tokens whose entropy is at least the
      (1 - rho) quantile of the step's token entropies are kept (rho = top_entropy_quantile; 0.2 in the paper).
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.no_grad()
def off_policy_mask(advantages: Tensor, logp: Tensor, sampling_logp: Tensor, mask: Tensor,
                    threshold: float) -> Tensor:
    """(N, 1) float: 1 keeps the sequence, 0 drops it (negative advantage and mean KL > threshold).

    advantages (N,) or (N, T) (a row's first column decides), logp (N, T) of pi_theta, sampling_logp (N, T) of the
    policy that sampled (NaN where unknown: no evidence, counted as 0), mask (N, T) bool."""
    mask = mask.to(logp.dtype)
    kl = torch.nan_to_num(sampling_logp - logp.detach(), nan=0.0)  # (N, T)
    mean_kl = (kl * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)  # (N, 1)
    adv = advantages[:, None] if advantages.dim() == 1 else advantages[:, :1]
    return ((adv >= 0) | (mean_kl <= threshold)).to(logp.dtype)


@torch.no_grad()
def entropy_threshold(entropies: Tensor, quantile: float) -> Tensor:
    """The `quantile` quantile of a 1-D tensor of token entropies (torch.quantile's linear interpolation)."""
    return torch.quantile(entropies.float(), quantile)


@torch.no_grad()
def high_entropy_mask(entropy: Tensor, mask: Tensor, threshold: Tensor | float) -> Tensor:
    """(N, T) bool: completion tokens whose entropy is >= threshold (from `entropy_threshold` over the step's
    tokens on every process, at 1 - top_entropy_quantile)."""
    return (entropy * mask >= threshold) & mask.bool()
