"""TRL 1.16's names for our metrics, so a dashboard or callback written for TRL finds them (metric_names: both, the
default, logs each metric under both names; trl, under TRL's alone; grpo, under ours alone).

TRL's names are those of `GRPOTrainer._metrics` and `Trainer.log` (trl/trainer/grpo_trainer.py). Ours group by
topic (`reward/`, `policy/`, `completion/`, `train/`); every metric of ours that TRL has is in this one table."""

from __future__ import annotations

TRL_NAMES = {
    "reward/total": "reward",
    "reward/total/std": "reward_std",
    "groups/zero_std_frac": "frac_reward_zero_std",
    "completion/mean_length": "completions/mean_length",
    "completion/min_length": "completions/min_length",
    "completion/max_length": "completions/max_length",
    "completion/truncated_frac": "completions/clipped_ratio",
    "completion/mean_terminated_length": "completions/mean_terminated_length",
    "completion/min_terminated_length": "completions/min_terminated_length",
    "completion/max_terminated_length": "completions/max_terminated_length",
    "train/num_tokens": "num_tokens",
    "train/loss": "loss",
    "train/grad_norm": "grad_norm",
    "train/learning_rate": "learning_rate",
    "train/epoch": "epoch",
    "time/step": "step_time",
    "policy/kl_divergence": "kl",
    "policy/entropy": "entropy",
    "policy/clip_frac_low": "clip_ratio/low_mean",
    "policy/clip_frac_high": "clip_ratio/high_mean",
    "policy/clip_frac": "clip_ratio/region_mean",
    "policy/cispo_clip_frac": "cispo_clip_ratio",
    "policy/vespo_phi_mean": "vespo/phi_seq_mean",
    "policy/entropy_coef": "entropy_coef",
    "sampling/importance_ratio_mean": "sampling/importance_sampling_ratio/mean",
    "sampling/importance_ratio_min": "sampling/importance_sampling_ratio/min",
    "sampling/importance_ratio_max": "sampling/importance_sampling_ratio/max",
}


def trl_name(name: str, reward_names: list[str]) -> str | None:
    """TRL's name for one of our metrics, or None where TRL has none. Per-function rewards: reward/<f> is
    rewards/<f>/mean and reward/<f>/std rewards/<f>/std."""
    if name in TRL_NAMES:
        return TRL_NAMES[name]
    for func in reward_names:
        if name == f"reward/{func}":
            return f"rewards/{func}/mean"
        if name == f"reward/{func}/std":
            return f"rewards/{func}/std"
    return None


def is_trl_eval_name(name: str) -> bool:
    """evaluate()'s TRL names (eval_accuracy, eval_<set>_reward), beside ours (eval/accuracy)."""
    return name.startswith("eval_") and "/" not in name


def named(metrics: dict[str, float], mode: str, reward_names: list[str]) -> dict[str, float]:
    """The metrics under the names `mode` (both, grpo, trl) asks for; TRL's come after ours."""
    if mode == "grpo":
        return {k: v for k, v in metrics.items() if not is_trl_eval_name(k)}
    theirs = {}
    for name, value in metrics.items():
        other = name if is_trl_eval_name(name) else trl_name(name, reward_names)
        if other is not None:
            theirs[other] = value
    if "train/entropy_bonus" in metrics and "train/loss" in metrics:  # (TRL logs it with an entropy bonus only)
        theirs["policy_loss"] = metrics["train/loss"] - metrics["train/entropy_bonus"]
    if mode == "trl":
        return theirs
    return {**metrics, **{k: v for k, v in theirs.items() if k not in metrics}}
