"""Per-token surrogate objectives: what each token contributes to the loss before the KL term and aggregation.

Every function takes the importance ratio rho = pi_theta / pi_old (N, T) (per token, or one value per sequence
repeated over its tokens), the advantages (N, T) and, where the objective needs them, the log-probs, and returns the
per-token loss to minimise (N, T). The names are TRL 1.16's `loss_type` values that bring them (`grpo.config`):

  clip    PPO's clipped ratio (DeepSeekMath eq. 3; every loss_type but the three below):
              l = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A),
          with `delta` (INTELLECT-2, arXiv:2505.07291) the unclipped branch's ratio is capped too: min(rho, delta).
  cispo   CISPO (MiniMax-M1, arXiv:2506.13585): the ratio, capped at eps_high and detached, weighs the log-prob:
              l = -sg(min(rho, eps_high)) * A * log pi_theta       (its gradient: -w A grad log pi)
  sapo    SAPO (arXiv:2511.20347): a soft gate instead of the clip,
              l = -(4 / tau) * sigmoid(tau * (rho - 1)) * A,       tau = tau_pos if A > 0 else tau_neg
          (its gradient at rho = 1 is -A, the plain policy gradient; it fades smoothly as rho leaves 1).
  vespo   VESPO (arXiv:2602.10693): a gamma weight of the sequence's ratio w = prod_t rho_t, detached,
              phi(w) = exp(lambda + k log w - lambda w)  (= w^k e^{lambda (1 - w)}, so phi(1) = 1),
              l = -phi(w) * A * log pi_theta,
          k, lambda = k_pos, lambda_pos for A >= 0, else k_neg, lambda_neg; log-ratios are clamped to [-20, 20]
          per token and log w to [log 1e-8, 20], as TRL computes it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

SURROGATES = ("clip", "cispo", "sapo", "vespo")
"""Allowed values of `LossSettings.surrogate`."""


def clip_surrogate(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float,
                   delta: float | None = None) -> Tensor:
    """(N, T) -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A); with `delta` the first rho is min(rho, delta)."""
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    if delta is not None:
        ratio = torch.clamp(ratio, max=delta)
    return -torch.minimum(ratio * adv, clipped * adv)


def cispo_surrogate(ratio: Tensor, adv: Tensor, logp: Tensor, eps_high: float) -> Tensor:
    """(N, T) -sg(min(rho, eps_high)) A log pi: the capped ratio is a fixed weight on the log-prob's gradient."""
    return -torch.clamp(ratio, max=eps_high).detach() * adv * logp


def sapo_surrogate(ratio: Tensor, adv: Tensor, tau_pos: float = 1.0, tau_neg: float = 1.05) -> Tensor:
    """(N, T) -(4 / tau) sigmoid(tau (rho - 1)) A, tau by the advantage's sign (A > 0: tau_pos)."""
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv


@torch.no_grad()
def vespo_weights(adv: Tensor, log_ratio: Tensor, mask: Tensor, engine_weights: Tensor | None = None,
                  k_pos: float = 2.0, lambda_pos: float = 3.0, k_neg: float = 3.0,
                  lambda_neg: float = 2.0) -> Tensor:
    """(N, 1) detached gamma weights phi(w) of each sequence's ratio w (module docstring).

    adv (N, T) (every token of a row carries the row's advantage; its first column's sign picks k and lambda),
    log_ratio (N, T) log pi_theta - log pi_old, mask (N, T) bool. `engine_weights` (N, T): a rollout engine's
    per-token importance weights (pi_old / pi_engine), whose logs join the sequence's log-ratio.
    """
    floor = math.log(1e-8)
    seq_log = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)  # (N, 1)
    if engine_weights is not None:
        log_engine = torch.clamp(torch.log(engine_weights.clamp(min=0)), floor, 20.0)
        seq_log = seq_log + (log_engine * mask).sum(-1, keepdim=True)
    log_w = torch.clamp(seq_log, floor, 20.0)
    nonneg = adv[:, :1] >= 0
    k = torch.where(nonneg, torch.full_like(log_w, k_pos), torch.full_like(log_w, k_neg))
    lam = torch.where(nonneg, torch.full_like(log_w, lambda_pos), torch.full_like(log_w, lambda_neg)).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def vespo_surrogate(phi: Tensor, adv: Tensor, logp: Tensor) -> Tensor:
    """(N, T) -phi A log pi, phi (N, 1) from `vespo_weights`."""
    return -phi * adv * logp
