"""The run's loss for one micro-batch: grpo.core's terms put together with the config's settings, in TRL 1.16's
order (trl/trainer/grpo_trainer.py, `_compute_loss`):

    surrogate (clip, cispo, sapo or vespo) x off-policy sequence mask x high-entropy token mask x the rollout
    engine's importance weights, + beta x KL (x the ratio with use_bias_correction_kl), aggregated with the
    normalizer of `aggregation_normalizer`; minus the entropy bonus (its coefficient adaptive or fixed).

The trainer gives each micro-batch its counts (`MicroInputs`); the adaptive entropy coefficient is this object's
state across optimizer steps (checkpointed with the trainer's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from grpo.config.derived import corrects_sampling, loss_settings
from grpo.core import (LossOutput, adaptive_entropy_coef, applied_entropy_coef, engine_importance_weights,
                       entropy_bonus, entropy_threshold, high_entropy_mask, off_policy_mask, policy_loss)


@dataclass
class MicroInputs:
    """One micro-batch's tensors besides its log-probs, (n, width) on the model's device, and its normalizers."""

    mask: torch.Tensor
    advantages: torch.Tensor  # (n,) or (n, width)
    old_logp: torch.Tensor | None  # None: the policy's own, detached (no optimizer step since sampling)
    sampling_logp: torch.Tensor | None  # the rollout engine's, where it gave them
    ref_logp: torch.Tensor | None
    normalizer: float  # policy_loss's, from aggregation_normalizer
    micro_batches: int  # per optimizer step on this process, for the entropy bonus's mean of means


@dataclass(frozen=True)
class EntropyControl:
    """The entropy bonus's settings: a fixed coefficient (TRL's entropy_coef) or one moved by adaptive control
    towards `target` by `delta` per optimizer step, kept in [low, high]."""

    coef: float
    adaptive: bool
    target: float
    delta: float
    low: float
    high: float

    @property
    def on(self) -> bool:
        return self.coef != 0.0 or self.adaptive


class Objective:
    """The run's loss, with every setting read from the config once, here (grpo.config.derived for the facts
    other parts share)."""

    def __init__(self, cfg, processes):
        self.procs = processes
        self.settings = loss_settings(cfg)
        # The engine's importance weights (the keyword arguments of engine_importance_weights), or None: no correction.
        self.importance = (dict(mode=cfg.vllm_importance_sampling_mode, clip_max=cfg.vllm_importance_sampling_clip_max,
                                clip_min=cfg.vllm_importance_sampling_clip_min) if corrects_sampling(cfg) else None)
        self.off_policy_threshold = cfg.off_policy_mask_threshold
        self.top_entropy_quantile = cfg.top_entropy_quantile
        self.control = EntropyControl(cfg.entropy_coef, cfg.use_adaptive_entropy, cfg.entropy_target,
                                      cfg.entropy_coef_delta, cfg.entropy_coef_min, cfg.entropy_coef_max)
        self.entropy_coef = cfg.entropy_coef
        self.last_entropy = math.inf  # the last optimizer step's mean token entropy (adaptive control)
        self._window: torch.Tensor | None = None  # (entropy sum, tokens) over this step's micro-batches
        self._bonus: torch.Tensor | None = None  # the entropy bonus terms added to this step's loss

    @property
    def entropy_in_loss(self) -> bool:
        """Whether the loss itself needs the token entropies (not only the metric)."""
        return self.control.on or self.top_entropy_quantile < 1.0

    def loss(self, logp: torch.Tensor, entropy: torch.Tensor | None, micro: MicroInputs,
             sub=slice(None)) -> LossOutput:
        """The loss of rows `sub` of the micro-batch (all of them unless the engine scores rows in chunks)."""
        mask = micro.mask[sub]
        old = logp.detach() if micro.old_logp is None else micro.old_logp[sub]
        sampling = None if micro.sampling_logp is None else micro.sampling_logp[sub]
        weights, engine_metrics = None, {}
        # The sampling engine's log-probs are the behaviour policy's: vLLM's kernels, or with max_staleness the
        # weights of k rollouts before. The ratio to pi_old (the proximal policy, the weights this rollout's update
        # starts from) is then a bounded importance weight, and the clip stays around pi_old: decoupled PPO
        # (Hilton et al. 2022; AReaL, arXiv:2505.24298, eq. 5).
        if self.importance is not None and sampling is not None:
            weights, engine_metrics = engine_importance_weights(old, sampling, mask, **self.importance)
        sequence_mask = None
        if self.off_policy_threshold is not None:  # vLLM's own log-probs where it gave them (TRL)
            sequence_mask = off_policy_mask(micro.advantages[sub], logp, sampling if sampling is not None else old,
                                            mask, self.off_policy_threshold)
        token_mask = None
        if self.top_entropy_quantile < 1.0:
            token_mask = high_entropy_mask(entropy.detach(), mask, self._threshold(entropy.detach(), mask))
        ref = None if micro.ref_logp is None else micro.ref_logp[sub]
        out = policy_loss(logp, old, micro.advantages[sub], mask, self.settings, ref_logp=ref,
                          normalizer=micro.normalizer, entropy=None if entropy is None else entropy.detach(),
                          sampling_weights=weights, sequence_mask=sequence_mask, token_mask=token_mask)
        out.metrics.update({f"sampling/importance_{k}": v for k, v in engine_metrics.items()})
        if self.control.on:
            out.loss = out.loss + self._bonus_term(entropy, mask, token_mask, micro.micro_batches, logp.dtype)
        return out

    def _bonus_term(self, entropy: torch.Tensor, mask: torch.Tensor, token_mask: torch.Tensor | None,
                    micro_batches: int, dtype: torch.dtype) -> torch.Tensor:
        """The entropy bonus of this micro-batch's tokens (those of the high-entropy mask where it is on)."""
        effective = mask.bool() if token_mask is None else mask.bool() & token_mask
        tokens = effective.sum().to(dtype)  # (the log-probs' dtype: a count in bf16 is exact only to 256)
        control = self.control
        coef = applied_entropy_coef(self.entropy_coef, self.last_entropy, control.target, control.adaptive)
        # TRL: the micro-batch's mean over its tokens, divided by the accumulation steps (and, through our
        # backward's x processes, averaged over processes).
        scale = tokens.clamp(min=1) * (micro_batches * self.procs.world)  # (a tensor: no host sync)
        bonus = entropy_bonus(entropy, effective, coef, scale)
        self._bonus = bonus.detach() + (self._bonus if self._bonus is not None else 0.0)
        stats = torch.stack([(entropy.detach() * effective).sum(), tokens]).double()
        self._window = stats if self._window is None else self._window + stats
        return bonus

    def _threshold(self, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The (1 - top_entropy_quantile) quantile of this micro-batch's token entropies on every process."""
        if self.procs.world == 1:  # NaN off the mask, which nanquantile skips: no boolean index (a host sync)
            values = entropy.float().masked_fill(~mask.bool(), math.nan).flatten()
            return torch.nanquantile(values, 1.0 - self.top_entropy_quantile).nan_to_num(math.inf)
        # (several processes: their token counts differ, and the ragged gather reads them, as TRL's does)
        local = entropy[mask.bool()]
        values = self.procs.gather_ragged(local.float())
        if values.numel() == 0:
            return torch.tensor(math.inf, device=local.device)
        return entropy_threshold(values, 1.0 - self.top_entropy_quantile).to(local.device)

    def end_step(self) -> dict[str, float]:
        """After an optimizer step: adaptive control moves the coefficient by the step's entropy on every process."""
        if not self.control.on:
            return {}
        control = self.control
        if control.adaptive and self._window is not None:
            total = self.procs.gather(self._window.cpu().reshape(1, 2)).sum(0)
            entropy = float(total[0] / total[1].clamp(min=1.0))
            self.entropy_coef = adaptive_entropy_coef(self.entropy_coef, entropy, control.target, control.delta,
                                                      control.low, control.high)
            self.last_entropy = entropy
        self._window = None
        # The bonus's share of the step's loss, every process's (TRL's policy_loss is the loss without it).
        bonus = 0.0 if self._bonus is None else float(self.procs.gather(self._bonus.cpu().reshape(1)).sum())
        self._bonus = None
        return {"policy/entropy_coef": self.entropy_coef, "train/entropy_bonus": bonus}

    def state_dict(self) -> dict:
        return {"entropy_coef": self.entropy_coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict) -> None:
        self.entropy_coef, self.last_entropy = state["entropy_coef"], state["last_entropy"]
