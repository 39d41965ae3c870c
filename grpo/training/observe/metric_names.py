"""TRL 1.16's names for our metrics, so a dashboard or callback written for TRL finds them (metric_names: both, the
default, logs each metric under both names; trl, under TRL's alone; grpo, under ours alone).

TRL's names are those of `GRPOTrainer._metrics` and `Trainer.log` (trl/trainer/grpo_trainer.py). Ours group by
topic (`reward/`, `policy/`, `completion/`, `train/`); every metric of ours that TRL has is in this one table.
The dashboards (TensorBoard, W&B, trackio) get TRL's names as transformers' Trainer prefixes them
(`dashboard_names`), and TensorBoard's events go where transformers puts them (`tensorboard_dir`)."""

from __future__ import annotations

from pathlib import Path

TENSORBOARD_DIR = "runs"  # (transformers' default_logdir: runs/<date>_<host>)

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
    "tools/calls_per_completion": "tools/call_frequency",
    "tools/failure_frac": "tools/failure_frequency",
    "moe/aux_loss": "aux_loss",
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


def dashboard_key(name: str) -> str:
    """transformers' `rewrite_logs` (what its TensorBoard, W&B and trackio callbacks log under): `eval_<k>` is
    `eval/<k>`, any other key `train/<k>`; a name of ours that already starts with train/ or eval/ stays."""
    if name.startswith(("train/", "eval/")):
        return name
    if name.startswith("eval_"):
        return "eval/" + name[len("eval_"):]
    return "train/" + name


def dashboard_names(logs: dict[str, float], mode: str, reward_names: list[str]) -> dict[str, float]:
    """The keys TensorBoard, W&B and trackio get for one logged step (`logs` as `named` made them): TRL's names
    where TRL has the metric, ours where it has none, each as transformers' Trainer prefixes them, so a dashboard
    keyed on TRL's run (train/reward, train/rewards/<f>/mean, train/entropy, eval/reward) finds them. With
    metric_names grpo, ours alone, prefixed the same way."""
    out = {}
    for name, value in logs.items():
        if mode != "grpo" and trl_name(name, reward_names) is not None:
            continue  # its TRL name is in `logs` too
        out[dashboard_key(name)] = value
    return out


def tensorboard_dir(output_dir: Path, resuming: bool) -> Path:
    """Where TensorBoard's events go without logging_dir: a new output_dir/runs/<date>_<host>/ (transformers'
    default_logdir), or on resume the newest one there, so purge_step hides the steps after the checkpoint."""
    import socket
    from datetime import datetime

    runs = sorted((p for p in (output_dir / TENSORBOARD_DIR).glob("*") if p.is_dir()), key=lambda p: p.stat().st_mtime)
    if resuming and runs:
        return runs[-1]
    return output_dir / TENSORBOARD_DIR / f"{datetime.now().strftime('%b%d_%H-%M-%S')}_{socket.gethostname()}"
