"""TRL 1.16's own loss code, called on tensors we choose (used by tests/test_core_trl_losses.py).

`GRPOTrainer._compute_loss` reads its settings from the trainer and its per-token log-probs from a model pass; here
the trainer is a namespace holding the settings and the pass returns the given tensors, so TRL computes its loss,
gradient and metrics on exactly our inputs (one process, the micro-batch `gradient_accumulation_steps` says).
"""

from __future__ import annotations

import types
from collections import defaultdict
from types import SimpleNamespace

import torch


class _OneProcess:
    num_processes = 1
    sync_gradients = True

    @staticmethod
    def gather(x):
        return x

    @staticmethod
    def reduce(x, reduction="sum"):
        return x

    @staticmethod
    def pad_across_processes(x, dim=0, pad_index=0):
        return x

    gather_for_metrics = gather


def trl_loss(logp, entropy, old_logp, ref_logp, advantages, mask, *, loss_type="dapo", beta=0.0,
             epsilon=0.2, epsilon_high=None, delta=None, importance_sampling_level="token",
             use_bias_correction_kl=True, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
             sampling_logp=None, entropy_coef=0.0, use_adaptive_entropy=False, last_world_entropy=float("inf"),
             entropy_target=0.2, gradient_accumulation_steps=1, steps_per_generation=1, num_items_in_batch=None,
             max_completion_length=None, sapo=(1.0, 1.05), vespo=(2.0, 3.0, 3.0, 2.0), aux=None):
    """(loss, metrics) of TRL's `_compute_loss` for one micro-batch whose log-probs are `logp` (N, T) and entropies
    `entropy` (N, T) (both may carry gradients), `advantages` (N,); `aux`: (an MoE model's aux loss as its pass
    returns it, router_aux_loss_coef)."""
    from trl import GRPOTrainer

    args = SimpleNamespace(use_bias_correction_kl=use_bias_correction_kl, delta=delta,
                           sapo_temperature_pos=sapo[0], sapo_temperature_neg=sapo[1], vespo_k_pos=vespo[0],
                           vespo_lambda_pos=vespo[1], vespo_k_neg=vespo[2], vespo_lambda_neg=vespo[3],
                           steps_per_generation=steps_per_generation, entropy_target=entropy_target,
                           entropy_coef_delta=0.005, entropy_coef_min=0.0, entropy_coef_max=1.0)
    trainer = SimpleNamespace(
        args=args, loss_type=loss_type, beta=beta, epsilon_low=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high,
        importance_sampling_level=importance_sampling_level,
        top_entropy_quantile=top_entropy_quantile, off_policy_mask_threshold=off_policy_mask_threshold,
        use_vllm=False, vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=gradient_accumulation_steps,
        max_completion_length=max_completion_length or logp.shape[1], accelerator=_OneProcess(),
        _entropy_bonus_enabled=entropy_coef != 0.0 or use_adaptive_entropy, entropy_coef=entropy_coef,
        use_adaptive_entropy=use_adaptive_entropy, _last_world_entropy=last_world_entropy,
        _entropy_window_stats=None, _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        aux_loss_enabled=aux is not None, router_aux_loss_coef=aux[1] if aux else 0.0,
        get_off_policy_mask=GRPOTrainer.get_off_policy_mask, get_gamma_weights=GRPOTrainer.get_gamma_weights,
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, entropy, aux[0] if aux else None))
    trainer.get_high_entropy_mask = types.MethodType(GRPOTrainer.get_high_entropy_mask, trainer)
    n, width = logp.shape
    inputs = {"prompt_ids": torch.zeros(n, 1, dtype=torch.long), "prompt_mask": torch.ones(n, 1, dtype=torch.long),
              "completion_ids": torch.zeros(n, width, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": advantages, "old_per_token_logps": old_logp,
              "num_items_in_batch": torch.tensor(float(num_items_in_batch if num_items_in_batch is not None
                                                       else mask.sum()))}
    if ref_logp is not None:
        inputs["ref_per_token_logps"] = ref_logp
    if sampling_logp is not None:
        inputs["sampling_per_token_logps"] = sampling_logp
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    metrics["entropy_coef_after"] = trainer.entropy_coef
    return loss, metrics
