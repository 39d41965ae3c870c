"""The GRPO policy loss: clipped surrogate, KL penalty to a reference policy, and loss aggregation.

Notation: N = B*G completions (rows), T completion tokens; every per-token tensor is (N, T) and `mask` marks the
completion tokens. The objective maximised by DeepSeekMath (arXiv:2402.03300, eq. 3) is

    J = 1/G sum_i 1/|o_i| sum_t { min(rho_it * A_it, clip(rho_it, 1-eps, 1+eps) * A_it) - beta * KL_it },
    rho_it = pi_theta(o_it) / pi_old(o_it) = exp(logp - old_logp),

and `policy_loss` returns its negation. Three ideas that other libraries fuse into one `loss_type` string are kept
apart here, each a field of its own in `LossSettings` (the run's fixed choices, checked once when built):
  * the importance ratio: per token (the paper) or per sequence (`ratio_level="sequence"`, GSPO);
  * the clip range: `eps_low` and `eps_high` may differ (DAPO's "clip-higher", arXiv:2503.14476);
  * the aggregation over tokens and sequences: `AGGREGATIONS` below.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from grpo.core.surrogates import (SURROGATES, cispo_surrogate, clip_surrogate, sapo_surrogate, vespo_surrogate,
                                  vespo_weights)

RATIO_LEVELS = ("token", "sequence")
"""Allowed values of `LossSettings.ratio_level`."""

AGGREGATIONS = ("sequence_mean", "token_mean", "constant", "sequence_sum", "micro_batch_token_mean",
                "rollout_token_mean")
"""Allowed values of `LossSettings.aggregation`. Over one optimizer step of N sequences (all micro-batches and
processes):
  sequence_mean           1/N sum_i 1/|o_i| sum_t l_it        the paper (every completion weighs the same)
  token_mean              1/(sum_i |o_i|) sum_i sum_t l_it    DAPO (every token of the step weighs the same)
  constant                1/(N * max_length) sum_i sum_t l_it Dr. GRPO, arXiv:2503.20783 (no length normalisation)
  sequence_sum            1/N sum_i sum_t l_it                LUSPO (TRL's luspo: each sequence scaled by its length)
  micro_batch_token_mean  each micro-batch's token mean, averaged over micro-batches and processes (TRL's bnpo)
  rollout_token_mean      the token sum over the rollout's tokens / optimizer steps per rollout (TRL's dapo, cispo,
                          vespo: their normalizer counts the whole generation batch)
The trainer passes the `normalizer` that makes the micro-batches' losses add up to these (`aggregation_normalizer`).
"""

TOKEN_AGGREGATIONS = ("token_mean", "micro_batch_token_mean", "rollout_token_mean")


def aggregation_normalizer(aggregation: str, *, step_tokens: float, step_rows: float, micro_tokens: float,
                           micro_batches: int, processes: int, rollout_tokens: float,
                           steps_per_rollout: int) -> float:
    """The `policy_loss(normalizer=...)` of one micro-batch, so that the micro-batches' losses, summed over the
    optimizer step and every process, give the aggregation of AGGREGATIONS.

    step_tokens / step_rows: completion tokens / sequences of the optimizer step, every process; micro_tokens: this
    micro-batch's tokens; micro_batches: micro-batches per optimizer step on each process; rollout_tokens: tokens of
    the whole rollout, every process; steps_per_rollout: optimizer steps each pass over the rollout takes."""
    if aggregation == "token_mean":
        return max(step_tokens, 1.0)
    if aggregation == "micro_batch_token_mean":
        return max(micro_tokens, 1.0) * micro_batches * processes
    if aggregation == "rollout_token_mean":
        return max(rollout_tokens, 1.0) / steps_per_rollout
    return float(step_rows)


# KL estimators from John Schulman, "Approximating KL divergence" (http://joschu.net/blog/kl-approx.html).
# With samples from pi_theta and r = pi_ref / pi_theta, each estimates KL(pi_theta || pi_ref) per token:
#   k1 = -log r                   unbiased, high variance, can be negative
#   k2 = (log r)^2 / 2            biased, low variance, always >= 0
#   k3 = (r - 1) - log r          unbiased, low variance, always >= 0; the estimator DeepSeekMath uses (eq. 4)
def _kl_k1(log_r: Tensor) -> Tensor:
    return -log_r


def _kl_k2(log_r: Tensor) -> Tensor:
    return 0.5 * log_r * log_r


def _kl_k3(log_r: Tensor) -> Tensor:
    return torch.exp(log_r) - log_r - 1


KL_ESTIMATORS = {"k1": _kl_k1, "k2": _kl_k2, "k3": _kl_k3}
"""Name -> function of `log r = ref_logp - logp`; the names `kl_penalty(estimator=...)` accepts."""


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from the log-probs of the sampled tokens.

    Args:
        logp: log pi_theta of each sampled token, any shape, e.g. (B*G, T).
        ref_logp: log pi_ref of the same tokens, same shape.
        estimator: "k1" (`logp - ref_logp`), "k2" (`(logp - ref_logp)^2 / 2`) or "k3" (default,
            `exp(ref_logp - logp) - (ref_logp - logp) - 1`); see KL_ESTIMATORS.

    Returns:
        Tensor of the inputs' shape. No clamping: k3 overflows only for log-ratios above ~88 in float32.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_penalty: estimator={estimator!r} is not one of {tuple(KL_ESTIMATORS)}")
    if logp.shape != ref_logp.shape:
        raise ValueError(f"kl_penalty: logp {tuple(logp.shape)} and ref_logp {tuple(ref_logp.shape)} differ in shape")
    return KL_ESTIMATORS[estimator](ref_logp - logp)


@dataclass
class LossOutput:
    """What `policy_loss` returns: the scalar to call `.backward()` on and detached metric tensors."""

    loss: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of `values` over the True entries of `mask` (same shape); 0 when the mask is empty."""
    return torch.where(mask, values, torch.zeros_like(values)).sum() / mask.sum().clamp(min=1)


def _check_loss_tensors(logp, old_logp, advantages, mask, ref_logp, entropy) -> None:
    """Raise ValueError naming the tensor argument of `policy_loss` whose shape does not fit."""
    if logp.dim() != 2:
        raise ValueError(f"policy_loss: logp must be (B*G, T), got {tuple(logp.shape)}")
    for name, tensor in (("old_logp", old_logp), ("mask", mask), ("ref_logp", ref_logp), ("entropy", entropy)):
        if tensor is not None and tensor.shape != logp.shape:
            raise ValueError(f"policy_loss: {name} has shape {tuple(tensor.shape)}, logp has {tuple(logp.shape)}")
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(
            f"policy_loss: advantages must be (B*G,) or (B*G, T) = {tuple(logp.shape)}, got {tuple(advantages.shape)}"
        )


@dataclass(frozen=True)
class LossSettings:
    """The loss's fixed choices: what a run decides once (from its config) and every micro-batch's `policy_loss`
    reads. Checked when built: an unknown name or a value out of range is a ValueError naming the field.

    beta: KL coefficient (DeepSeekMath used 0.04; 0 disables the penalty, as in DAPO and TRL's default).
    kl_estimator: "k1", "k2" or "k3" (default); see `kl_penalty`.
    eps_low, eps_high: clip range [1 - eps_low, 1 + eps_high]; eps_high=None means eps_high = eps_low.
    ratio_level: "token" (the paper) or "sequence" (GSPO: per-sequence geometric mean of token ratios).
    aggregation: "sequence_mean" (the paper), "token_mean" (DAPO), "constant" (Dr. GRPO), ...; see AGGREGATIONS.
    max_length: the constant of aggregation="constant" (the maximum completion length); required there.
    surrogate: "clip" (the paper), "cispo", "sapo" or "vespo"; see grpo.core.surrogates.
    delta: clip only: cap of the unclipped branch's ratio (two-sided clipping, INTELLECT-2). None: no cap.
    sapo_temperatures: (tau_pos, tau_neg) of surrogate="sapo".
    vespo_params: (k_pos, lambda_pos, k_neg, lambda_neg) of surrogate="vespo".
    kl_ratio_correction: multiply the KL term by the importance ratio rho (with its gradient): the unbiased
        reverse-KL gradient of DeepSeek-V3.2 (TRL's use_bias_correction_kl). The reported kl is this product.
    """

    beta: float = 0.0
    kl_estimator: str = "k3"
    eps_low: float = 0.2
    eps_high: float | None = None
    ratio_level: str = "token"
    aggregation: str = "sequence_mean"
    max_length: int | None = None
    surrogate: str = "clip"
    delta: float | None = None
    sapo_temperatures: tuple[float, float] = (1.0, 1.05)
    vespo_params: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0)
    kl_ratio_correction: bool = False

    def __post_init__(self) -> None:
        if self.eps_high is None:
            object.__setattr__(self, "eps_high", self.eps_low)
        for key, allowed in (("ratio_level", RATIO_LEVELS), ("aggregation", AGGREGATIONS),
                             ("kl_estimator", tuple(KL_ESTIMATORS)), ("surrogate", SURROGATES)):
            if getattr(self, key) not in allowed:
                raise ValueError(f"LossSettings: {key}={getattr(self, key)!r} is not one of {allowed}")
        if self.eps_low < 0 or self.eps_high < 0:  # (eps_low >= 1: no lower clip, as ratios are > 0; TRL accepts it)
            raise ValueError(f"LossSettings: need eps_low >= 0 and eps_high >= 0, got {self.eps_low} and "
                             f"{self.eps_high}")
        if self.aggregation == "constant" and not (self.max_length or 0) > 0:
            raise ValueError("LossSettings: aggregation='constant' needs max_length > 0 (the maximum completion "
                             "length)")


def _importance_ratio(log_ratio: Tensor, mask: Tensor, ratio_level: str) -> Tensor:
    """(N, T) ratio pi_theta / pi_old from (N, T) per-token log-ratios (0 on masked-out tokens).

    "token": exp(log_ratio) per token. "sequence" (GSPO, arXiv:2507.18071): the geometric mean of the sequence's
    token ratios, exp(mean_t log_ratio), the same value on every token of the row; it is built from all tokens'
    log-ratios, so the gradient flows through every token.
    """
    if ratio_level == "token":
        return torch.exp(log_ratio)
    lengths = mask.sum(-1, keepdim=True).clamp(min=1)  # (N, 1)
    return torch.exp(log_ratio.sum(-1, keepdim=True) / lengths).expand_as(log_ratio)  # (N, T)


def _aggregate(per_token: Tensor, mask: Tensor, aggregation: str, max_length, normalizer) -> Tensor:
    """Reduce the (N, T) per-token loss to a scalar; see AGGREGATIONS and `policy_loss` for `normalizer`."""
    masked = torch.where(mask, per_token, torch.zeros_like(per_token))  # (N, T)
    if aggregation in TOKEN_AGGREGATIONS:
        return masked.sum() / (normalizer if normalizer is not None else mask.sum().clamp(min=1))
    sequences = normalizer if normalizer is not None else max(mask.shape[0], 1)
    if aggregation == "sequence_mean":
        per_sequence = masked.sum(-1) / mask.sum(-1).clamp(min=1)  # (N,)
        return per_sequence.sum() / sequences
    if aggregation == "sequence_sum":
        return masked.sum() / sequences
    return masked.sum() / (sequences * max_length)  # "constant"


@torch.no_grad()
def _loss_metrics(surrogate, ratio, adv, mask, eps_low, eps_high, kl, entropy, clip=True,
                  per_sequence=False) -> dict[str, Tensor]:
    """Detached scalar metrics of `policy_loss`, each a masked mean over the (N, T) tokens of this micro-batch.

    A token counts as clipped when the clipped branch of the min is the active one, i.e. its gradient is cut:
    low = A < 0 and rho < 1 - eps_low, high = A > 0 and rho > 1 + eps_high (disjoint, so clip_frac = low + high).
    """
    low = (adv < 0) & (ratio < 1 - eps_low) & mask
    high = (adv > 0) & (ratio > 1 + eps_high) & mask
    adv_mean = _masked_mean(adv, mask)
    metrics = {
        "policy_loss": _masked_mean(surrogate, mask),
        "ratio_mean": _masked_mean(ratio, mask),
        "advantage_mean": adv_mean,
        "advantage_std": _masked_mean((adv - adv_mean) ** 2, mask).sqrt(),
    }
    if clip and per_sequence:  # one ratio per sequence: the fractions are of sequences (as TRL counts them)
        low_rows = ((adv[:, 0] < 0) & (ratio[:, 0] < 1 - eps_low)).to(ratio.dtype)  # (N,)
        high_rows = ((adv[:, 0] > 0) & (ratio[:, 0] > 1 + eps_high)).to(ratio.dtype)
        metrics.update({"clip_frac_low": low_rows.mean(), "clip_frac_high": high_rows.mean(),
                        "clip_frac": (low_rows + high_rows).mean()})
    elif clip:
        metrics.update({"clip_frac_low": _masked_mean(low.to(ratio.dtype), mask),
                        "clip_frac_high": _masked_mean(high.to(ratio.dtype), mask),
                        "clip_frac": _masked_mean((low | high).to(ratio.dtype), mask)})
    if kl is not None:
        metrics["kl"] = _masked_mean(kl, mask)
    if entropy is not None:
        metrics["entropy"] = _masked_mean(entropy.to(ratio.dtype), mask)
    return metrics


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    settings: LossSettings = LossSettings(),
    *,
    ref_logp: Tensor | None = None,
    normalizer: float | None = None,
    entropy: Tensor | None = None,
    sampling_weights: Tensor | None = None,
    sequence_mask: Tensor | None = None,
    token_mask: Tensor | None = None,
) -> LossOutput:
    """GRPO loss to minimise: -(clipped surrogate) + beta * KL per token, then aggregated.

    Per token: l_it = -min(rho*A, clip(rho, 1 - eps_low, 1 + eps_high)*A) + beta * KL_it.

    Args:
        logp: (B*G, T) log pi_theta of the sampled tokens; the only input gradients flow into.
        old_logp: (B*G, T) log pi_old of the same tokens, from the policy that sampled them (detached here).
        advantages: (B*G,) one advantage per completion, or (B*G, T) per token (process supervision). Detached.
        mask: (B*G, T) bool or 0/1, True on completion tokens. Masked-out entries of every input are replaced by 0
            before any exp(), so padding holding -inf or garbage cannot turn the loss or its gradient into NaN.
        settings: the run's fixed choices (clip range, KL, ratio level, aggregation, surrogate); see LossSettings.
            Default: the paper's loss without the KL penalty.
        ref_logp: (B*G, T) log pi_ref, needed when settings.beta != 0; when given, the KL is also reported as a
            metric.
        normalizer: replaces this micro-batch's own count in the denominator, so that summing the losses of all
            micro-batches (and processes) of one optimizer step gives exactly the loss of the whole step:
            for "token_mean" pass the total number of completion tokens of the step, for "sequence_mean" and
            "constant" the total number of sequences of the step. None uses this micro-batch's own count
            (tokens, or rows). Note: a data-parallel wrapper that *averages* gradients over P processes divides
            by P once more, so multiply the loss by P there (or give normalizer / P).
        entropy: (B*G, T) per-token entropy of pi_theta (e.g. from `token_entropy`); only reported as a metric.
        sampling_weights: (B*G, T) weights of each token's surrogate (not of its KL term, as in TRL), detached: the
            correction for a rollout engine that samples from another distribution than pi_old
            (`engine_importance_weights`). None: all 1. With surrogate="vespo" they join its sequence weight instead.
        sequence_mask: (B*G,) or (B*G, 1) 0/1 weights of each sequence's surrogate (`off_policy_mask`). None: all 1.
        token_mask: (B*G, T) bool, the tokens whose surrogate counts (`high_entropy_mask`). None: all of `mask`.

    Returns:
        LossOutput(loss, metrics). `loss` is a scalar. `metrics` holds detached scalars, each a plain masked mean
        over this micro-batch's tokens (not scaled by `normalizer`): policy_loss (the surrogate part of l_it),
        clip_frac_low (A < 0 and rho < 1 - eps_low), clip_frac_high (A > 0 and rho > 1 + eps_high), clip_frac
        (their sum), ratio_mean, advantage_mean, advantage_std, plus kl when ref_logp is given and entropy when
        entropy is given.
    """
    _check_loss_tensors(logp, old_logp, advantages, mask, ref_logp, entropy)
    if settings.beta != 0 and ref_logp is None:
        raise ValueError(f"policy_loss: beta={settings.beta} needs ref_logp (log-probs of the reference policy)")
    if normalizer is not None and not normalizer > 0:
        raise ValueError(f"policy_loss: normalizer must be > 0, got {normalizer}")
    s = settings
    mask = mask.bool()
    zeros = torch.zeros_like(logp)
    logp = torch.where(mask, logp, zeros)  # (N, T)
    old_logp = torch.where(mask, old_logp.detach().to(logp.dtype), zeros)
    adv = advantages.detach().to(logp.dtype)
    adv = (adv[:, None] if adv.dim() == 1 else adv).expand_as(logp)  # (N, T)

    log_ratio = logp - old_logp
    ratio = _importance_ratio(log_ratio, mask, s.ratio_level)  # (N, T)
    weights = None
    if sampling_weights is not None:
        if sampling_weights.shape != logp.shape:
            raise ValueError(f"policy_loss: sampling_weights has shape {tuple(sampling_weights.shape)}, logp has "
                             f"{tuple(logp.shape)}")
        weights = torch.where(mask, sampling_weights.detach().to(logp.dtype), zeros)
    extra = {}
    if s.surrogate == "clip":
        per_surrogate = clip_surrogate(ratio, adv, s.eps_low, s.eps_high, s.delta)  # (N, T); minus: we minimise
    elif s.surrogate == "cispo":
        per_surrogate = cispo_surrogate(ratio, adv, logp, s.eps_high)
        extra["cispo_clip_frac"] = _masked_mean(((ratio > s.eps_high) & (adv > 0)).to(logp.dtype), mask).detach()
    elif s.surrogate == "sapo":
        per_surrogate = sapo_surrogate(ratio, adv, *s.sapo_temperatures)
    else:  # vespo: the engine's weights go into the sequence weight
        phi = vespo_weights(adv, log_ratio, mask, weights, *s.vespo_params)  # (N, 1)
        per_surrogate = vespo_surrogate(phi, adv, logp)
        extra["vespo_phi_mean"] = phi.mean().detach()
        weights = None
    if sequence_mask is not None:
        per_surrogate = per_surrogate * sequence_mask.detach().reshape(-1, 1).to(logp.dtype)
    if token_mask is not None:
        per_surrogate = per_surrogate * token_mask.detach().to(logp.dtype)
    if weights is not None:
        per_surrogate = per_surrogate * weights
    per_token = per_surrogate
    kl = None
    if ref_logp is not None:
        ref_logp = torch.where(mask, ref_logp.detach().to(logp.dtype), zeros)
        kl = kl_penalty(logp, ref_logp, s.kl_estimator)  # (N, T)
        if s.kl_ratio_correction:
            kl = kl * ratio
        if s.beta != 0:
            per_token = per_surrogate + s.beta * kl
    loss = _aggregate(per_token, mask, s.aggregation, s.max_length, normalizer)

    shown = ratio if s.delta is None or s.surrogate != "clip" else torch.clamp(ratio, max=s.delta)  # (TRL's metrics)
    metrics = _loss_metrics(per_surrogate, shown, adv, mask, s.eps_low, s.eps_high, kl, entropy,
                            clip=s.surrogate == "clip", per_sequence=s.ratio_level == "sequence")
    metrics.update(extra)
    return LossOutput(loss=loss, metrics=metrics)
