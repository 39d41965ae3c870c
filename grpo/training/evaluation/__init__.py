"""Evaluation in one place: held-out scoring (`held_out`, the `grpo eval` command and the run's eval set) and TRL's eval loss (`eval_loss`)."""
