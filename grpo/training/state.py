"""A trainer's state in a checkpoint, and back: what `train()` continues from, exactly.

Beside the model files (grpo.training.checkpoint): the optimizer, the schedule, the prompt sampler, every random
state, the counters, the adaptive entropy coefficient, a synced reference's weights, and the rollout that was still
feeding optimizer steps (with the number it had fed), so a run resumed inside a rollout takes the same steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpo.config import ConfigError
from grpo.training import checkpoint as ckpt
from grpo.training.model import load_model_files, save_model_files
from grpo.training.rollout import RolloutBatch


def checkpoint_to_resume(cfg, requested: Any) -> Path | None:
    """train(resume_from_checkpoint=...) (True: the newest in output_dir; a path: that one), else the config's
    resume_from_checkpoint or resume; None to start from step 0."""
    if requested is None:
        requested = cfg.resume_from_checkpoint or cfg.resume
    try:
        path = ckpt.resolve_resume(cfg.output_dir, requested)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if path is None and requested:
        print(f"resume: no complete checkpoint in {cfg.output_dir}; starting from step 0.")
    return path


def trainer_state(trainer) -> dict[str, Any]:
    pending = None
    if trainer.pending is not None and trainer.pending[1]:
        batch, left = trainer.pending
        pending = {"batch": batch.tensors(), "taken": len(trainer._plan(batch)) - len(left)}
    return {"step": trainer.step, "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.scheduler.state_dict(), "sampler": trainer.sampler.state_dict(),
            "rng": ckpt.rng_state(), "nonfinite_total": trainer.nonfinite_total,
            "rollout_count": trainer.rollout_count, "num_tokens": trainer.num_tokens, "pending": pending,
            "objective": trainer.objective.state_dict(),
            "reference": trainer.reference.state_dict() if trainer.cfg.sync_ref_model else None}


def save_checkpoint(trainer) -> Path:
    cfg = trainer.cfg
    return ckpt.save_checkpoint(cfg.output_dir, trainer.step,
                                lambda path: save_model_files(trainer.policy, trainer.tokenizer, path),
                                None if cfg.save_only_model else trainer_state(trainer), cfg.save_total_limit,
                                write_json=trainer.control.state.save_to_json)


def restore(trainer, path: Path) -> None:
    from transformers import TrainerState

    try:
        state = ckpt.load_trainer_state(path)
        load_model_files(trainer.policy, path)
    except ValueError as err:
        raise ConfigError(f"resume_from_checkpoint: {err}") from None
    trainer.rollouts.engine_stale = True
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.sampler.load_state_dict(state["sampler"])
    ckpt.set_rng_state(state["rng"])
    trainer.step, trainer.nonfinite_total = state["step"], state["nonfinite_total"]
    trainer.rollout_count = state.get("rollout_count", trainer.step)
    trainer.num_tokens = state.get("num_tokens", 0.0)
    trainer.objective.load_state_dict(state.get("objective", trainer.objective.state_dict()))
    if state.get("reference") is not None:
        trainer.reference.load_state_dict(state["reference"])
    if state.get("pending") is not None:
        batch = RolloutBatch(**state["pending"]["batch"])
        for name in ("old_logp", "ref_logp"):  # (kept on the model's device, as the rollout made them)
            if getattr(batch, name) is not None:
                setattr(batch, name, getattr(batch, name).to(trainer.accel.device))
        trainer.pending = (batch, trainer._plan(batch)[state["pending"]["taken"]:])
    if (path / "trainer_state.json").is_file():
        saved = TrainerState.load_from_json(str(path / "trainer_state.json"))
        trainer.control.state.log_history, trainer.control.state.global_step = saved.log_history, saved.global_step
