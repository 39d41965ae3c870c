"""The GRPO math, pure: tensors in, tensors and metric tensors out. Imports torch and the standard library only.

No model, no config object, no IO, no torch.distributed: the trainer owns those and passes plain tensors and
numbers in (for exact gradient accumulation across micro-batches and processes it passes `normalizer`, see
`policy_loss`). Notation: B prompts, G completions per prompt, T completion tokens, V vocabulary; rewards and
outcome advantages are (B, G), per-token tensors (B*G, T).

Where our defaults depart from the DeepSeekMath paper (arXiv:2402.03300, sections 4.1.2-4.1.3, eq. 3):
  1. `LossSettings`'s KL coefficient `beta` defaults to 0.0, so `policy_loss` needs no reference log-probs unless
     asked; the trainer's config passes the paper's 0.04 by default (`GRPOConfig.beta`; TRL's default and DAPO's
     are 0.0). The estimator, when on, is the paper's k3.
  2. Advantages divide by `std + eps` with eps = 1e-4 (TRL's value); the paper divides by std alone.
  3. The std is Bessel-corrected (n - 1) by default, as in TRL; the paper does not say which std it uses.
     With 8 rewards, 4 of them 1, that gives std 0.5345 and advantages +-0.935 (population std: 0.5 and +-1).
  4. A group with fewer than two usable rewards, or with all rewards equal, gets advantage 0 (the paper's formula
     is 0/0 there).
  5. A NaN reward means "does not apply" (TRL's convention): it is left out of the group statistics and gets
     advantage 0. The paper has no such case.
  6. Process supervision: a step that ends past the last completion token counts as ending on it; step rewards
     are normalized with the same eps/std conventions as items 2-5.

Options the paper does not have, all off by default so the default loss is the paper's: asymmetric clipping
(`eps_high`, DAPO), sequence-level ratios (`ratio_level="sequence"`, GSPO), batch or no std scaling
(`scale="batch"/"none"`, Dr. GRPO), token-mean, constant and TRL's other aggregations, k1/k2 KL estimators and the
ratio-corrected KL (DeepSeek-V3.2), other surrogates (CISPO, SAPO, VESPO: `surrogates.py`), off-policy and
high-entropy masks (`masks.py`), the entropy bonus (`entropy.py`), GDPO's decoupled normalization
(`decoupled_advantages`), reference syncing (`reference.py`), and a weighted mix of outcome and process advantages
(`mix_advantages`).

The LM head's memory-saving kernels (log-probs from hidden states in tiles, the loss's gradient in the same pass)
are engine code and live in `grpo.engines.head`.
"""

from grpo.core.advantages import (ADVANTAGE_SCALES, decoupled_advantages, group_advantages, mix_advantages,
                                   process_advantages)
from grpo.core.entropy import adaptive_entropy_coef, applied_entropy_coef, entropy_bonus
from grpo.core.importance import IMPORTANCE_SAMPLING_MODES, engine_importance_weights
from grpo.core.loss import (AGGREGATIONS, KL_ESTIMATORS, RATIO_LEVELS, LossOutput, LossSettings,
                            aggregation_normalizer, kl_penalty, policy_loss)
from grpo.core.masks import entropy_threshold, high_entropy_mask, off_policy_mask
from grpo.core.reference import sync_reference_
from grpo.core.surrogates import SURROGATES, cispo_surrogate, clip_surrogate, sapo_surrogate, vespo_weights

__all__ = [
    "ADVANTAGE_SCALES",
    "AGGREGATIONS",
    "IMPORTANCE_SAMPLING_MODES",
    "KL_ESTIMATORS",
    "RATIO_LEVELS",
    "SURROGATES",
    "LossOutput",
    "LossSettings",
    "adaptive_entropy_coef",
    "aggregation_normalizer",
    "applied_entropy_coef",
    "cispo_surrogate",
    "clip_surrogate",
    "decoupled_advantages",
    "engine_importance_weights",
    "entropy_bonus",
    "entropy_threshold",
    "group_advantages",
    "high_entropy_mask",
    "off_policy_mask",
    "sapo_surrogate",
    "sync_reference_",
    "vespo_weights",
    "kl_penalty",
    "mix_advantages",
    "policy_loss",
    "process_advantages",
]
