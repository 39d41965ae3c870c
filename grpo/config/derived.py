"""Facts a run derives from its config, each decided here once: the trainer's parts read these instead of
re-deriving them from the keys (so a new way to need a reference model, say, is one edit).

    needs_reference(cfg)   a reference policy is kept and scored: beta > 0 (the KL penalty needs its log-probs)
    corrects_sampling(cfg) the update weighs each token by pi_old / pi_sampler: the rollout engine is not the
                           policy of pi_old (vLLM's kernels, or the weights of k rollouts before with a lag) and the
                           correction is on (TRL's vllm_importance_sampling_correction)
    loss_settings(cfg)     the loss's fixed choices (grpo.core.LossSettings), built once at start
"""

from __future__ import annotations

from grpo.core.loss import LossSettings


def needs_reference(cfg) -> bool:
    return cfg.beta > 0


def corrects_sampling(cfg) -> bool:
    return (cfg.use_vllm or cfg.max_staleness > 0) and cfg.vllm_importance_sampling_correction


def loss_settings(cfg) -> LossSettings:
    """The config's keys in the loss's terms (TRL's names on the left: epsilon, importance_sampling_level, ...)."""
    return LossSettings(beta=cfg.beta, kl_estimator=cfg.kl_estimator, eps_low=cfg.epsilon, eps_high=cfg.epsilon_high,
                        ratio_level=cfg.importance_sampling_level, aggregation=cfg.loss_aggregation,
                        max_length=cfg.max_completion_length, surrogate=cfg.surrogate, delta=cfg.delta,
                        sapo_temperatures=(cfg.sapo_temperature_pos, cfg.sapo_temperature_neg),
                        vespo_params=(cfg.vespo_k_pos, cfg.vespo_lambda_pos, cfg.vespo_k_neg, cfg.vespo_lambda_neg),
                        kl_ratio_correction=cfg.use_bias_correction_kl)
