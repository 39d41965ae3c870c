"""Named starting points (`preset`), our own aliases, and TRL's `loss_type` as a pair of our named settings."""

from __future__ import annotations

from typing import Any

# Names other tools use for the same setting: alias -> our key. A value for an alias is moved to the key.
# (TRL's and open-r1's names are rows of grpo.config.trl_keys; these are the rest.)
ALIASES = {
    "kl_penalty": "beta",  # seed tutorial 004
    "clip_range": "epsilon",  # seed tutorial 004
    "num_epochs": "num_train_epochs",
    "ppo_max_token_len_per_gpu": "max_tokens_per_micro_batch",  # verl (with use_dynamic_bsz: true)
    "max_async_level": "max_staleness",  # prime-rl: how many steps inference may run ahead of the trainer
    "max_trajectory_age_steps": "max_staleness",  # NeMo-RL's async_grpo
    "max_head_offpolicyness": "max_staleness",  # AReaL
    "ulysses_sequence_parallel_size": "sequence_parallel_size",  # verl (actor_rollout_ref.actor's)
    "expert_model_parallel_size": "expert_parallel_size",  # Megatron-LM (verl's, NeMo-RL's megatron_cfg)
    "ep_size": "expert_parallel_size",  # transformers' DistributedConfig
    "enable_activation_offload": "activation_offloading",  # verl (actor_rollout_ref.model's)
    "enable_activation_offloading": "activation_offloading",  # torchtune's recipes
}

# TRL 1.16's `loss_type` chooses two things we keep apart: how token losses are averaged (`loss_aggregation`) and
# the per-token surrogate (`surrogate`). Each value maps onto one of each, with TRL's normalizers
# (trl/trainer/grpo_trainer.py, `_compute_loss`): grpo and sapo average each sequence over its tokens; bnpo takes a
# token mean per micro-batch; dr_grpo divides by a constant; dapo, cispo and vespo divide by the rollout's tokens
# over the optimizer steps it feeds; luspo sums each sequence's tokens.
LOSS_TYPES: dict[str, tuple[str, str]] = {
    "grpo": ("sequence_mean", "clip"),
    "bnpo": ("micro_batch_token_mean", "clip"),
    "dr_grpo": ("constant", "clip"),
    "dapo": ("rollout_token_mean", "clip"),
    "cispo": ("rollout_token_mean", "cispo"),
    "sapo": ("sequence_mean", "sapo"),
    "luspo": ("sequence_sum", "clip"),
    "vespo": ("rollout_token_mean", "vespo"),
}

# Named starting points (`preset: dapo`); any key the recipe, the command line or the constructor sets wins.
PRESETS: dict[str, dict[str, Any]] = {
    # DeepSeekMath (2402.03300): group-normalized advantages, per-sequence mean, k3 KL at 0.04.
    "grpo": {"beta": 0.04, "kl_estimator": "k3", "epsilon": 0.2, "epsilon_high": 0.2, "scale_rewards": "group",
             "loss_aggregation": "sequence_mean", "importance_sampling_level": "token"},
    # Dr. GRPO (2503.20783): no std division, no 1/|o| length normalization (a constant instead), no KL.
    "dr_grpo": {"beta": 0.0, "scale_rewards": "none", "loss_aggregation": "constant"},
    # DAPO (2503.14476): clip-higher, token-level mean, no KL, dynamic sampling, soft overlong punishment
    # (their buffer is 4,096 of 20,480 tokens: a fifth of the length limit).
    "dapo": {"beta": 0.0, "epsilon": 0.2, "epsilon_high": 0.28, "loss_aggregation": "token_mean",
             "dynamic_sampling": True, "overlong_buffer_ratio": 0.2},
    # GSPO (2507.18071): sequence-level (geometric-mean) ratio with the paper's clip range, no KL.
    "gspo": {"beta": 0.0, "importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4,
             "loss_aggregation": "sequence_mean"},
    # TRL 1.16's GRPOConfig defaults wherever ours differ (README, "Coming from TRL"); what TRL has no key for
    # takes TRL's behaviour: no built-in task (pass a dataset), text prompts as they are, no prompt limit.
    "trl": {"beta": 0.0, "loss_type": "dapo", "use_bias_correction_kl": True, "max_completion_length": 512,
            "lr_scheduler_type": "linear", "num_train_epochs": 3.0, "logging_steps": 10, "save_steps": 500,
            "save_total_limit": None, "gradient_checkpointing": True, "bf16": True, "report_to": [],
            "output_dir": "trainer_output", "task": None, "use_chat_template": False, "max_prompt_length": None,
            "log_completions": False, "eval_strategy": "no", "eval_on_start": False, "eval_steps": None,
            "per_device_eval_batch_size": 8},
}
