"""A trainer's state in a checkpoint, and back: what `train()` continues from, exactly.

Beside the model files (grpo.training.checkpoint): the optimizer, the schedule, the prompt sampler, every random
state, the counters, the adaptive entropy coefficient, a synced reference's weights, and the rollout that was still
feeding optimizer steps (with the number it had fed), so a run resumed inside a rollout takes the same steps; with
max_staleness, the rollouts generated ahead (grpo.training.pipeline).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpo.config import ConfigError
from grpo.training import checkpoint as ckpt, sharded_checkpoint as sharded_ckpt
from grpo.training.model import load_model_files, save_model_files
from grpo.training.rollout import RolloutBatch
from grpo.training.summary import write_run_files


def checkpoint_to_resume(cfg, requested: Any, processes=None) -> Path | None:
    """train(resume_from_checkpoint=...) (True: the newest in output_dir; a path: that one), else the config's
    resume_from_checkpoint or resume; None to start from step 0. With several processes the main process chooses
    (and removes a half-written checkpoint) and the others take its choice."""
    if requested is None:
        requested = cfg.resume_from_checkpoint or cfg.resume
    choice = [None]
    if processes is None or processes.rank == 0:
        try:
            path = ckpt.resolve_resume(cfg.output_dir, requested, cfg.damaged_checkpoint)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        choice = [None if path is None else str(path)]
    if processes is not None and processes.accel.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(choice)
    path = None if choice[0] is None else Path(choice[0])
    if path is None and requested and (processes is None or processes.rank == 0):
        print(f"resume: no complete checkpoint in {cfg.output_dir}; starting from step 0.")
    return path


def trainer_state(trainer) -> dict[str, Any]:
    """Everything `restore` needs besides the model files (and, for a sharded run, besides the sharded optimizer
    state). Each process's own part (its random state, and its rows of a rollout still feeding optimizer steps) is
    gathered to every process: `processes[rank]`. Collective when the run has several processes."""
    own = {"rng": ckpt.rng_state(), "pending": None, "pipeline": trainer.source.state_dict()}
    if trainer.pending is not None and trainer.pending[1]:
        batch, left = trainer.pending
        own["pending"] = {"batch": batch.tensors(), "taken": trainer.layout.rollout_steps - len(left)}
    state = {"step": trainer.step, "scheduler": trainer.scheduler.state_dict(), "sampler": trainer.sampler.state_dict(),
             "nonfinite_total": trainer.nonfinite_total, "rollout_count": trainer.rollout_count,
             "num_tokens": trainer.num_tokens, "processes": trainer.procs.gather_objects([own]),
             "objective": trainer.objective.state_dict(),
             "reference": trainer.reference.state_dict() if trainer.cfg.sync_ref_model else None}
    if not trainer.sharded:  # (a sharded run's optimizer state is saved in shards, beside)
        state["optimizer"] = trainer.optimizer.state_dict()
    return state


def save_checkpoint(trainer) -> Path | None:
    """Write checkpoint-<step> (grpo.training.checkpoint; sharded runs: grpo.training.sharded_checkpoint). Every
    process calls it; returns the path on the main process."""
    cfg, accel = trainer.cfg, trainer.accel
    state = None if cfg.save_only_model else trainer_state(trainer)

    def write_json(path: Path) -> None:  # trainer_state.json, and the run's config.yaml and layout.yaml beside it
        trainer.control.state.save_to_json(str(path))
        write_run_files(trainer, path.parent)

    if trainer.sharded:
        return sharded_ckpt.save(accel, trainer.model, trainer.policy, trainer.optimizer, trainer.tokenizer,
                                 cfg.output_dir, trainer.step, state, cfg.save_total_limit, write_json=write_json)
    if not accel.is_main_process:
        return None
    return ckpt.save_checkpoint(cfg.output_dir, trainer.step,
                                lambda path: save_model_files(trainer.policy, trainer.tokenizer, path),
                                state, cfg.save_total_limit, write_json=write_json)


def restore(trainer, path: Path) -> None:
    from transformers import TrainerState

    try:
        state = ckpt.load_trainer_state(path)
        if trainer.sharded:  # the sharded weights and optimizer state, not the gathered copy
            sharded_ckpt.load(trainer.accel, trainer.model, trainer.optimizer, path)
        elif "optimizer" not in state:
            raise ConfigError(f"resume_from_checkpoint: {path} was written by a sharded run (its optimizer state is "
                              "in shards); resume with the launch configuration that wrote it.")
        else:
            load_model_files(trainer.policy, path)
            trainer.optimizer.load_state_dict(state["optimizer"])
    except ValueError as err:
        raise ConfigError(f"resume_from_checkpoint: {err}") from None
    # (checkpoints written before the per-process parts held the main process's random state and rollout only)
    processes = state.get("processes") or [{"rng": state["rng"], "pending": state.get("pending")}]
    if len(processes) != trainer.world:
        raise ConfigError(f"resume_from_checkpoint: {path} was written by {len(processes)} process(es), this run has "
                          f"{trainer.world}; resume with {len(processes)}.")
    own = processes[trainer.rank]
    trainer.rollouts.engine_stale = True
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.sampler.load_state_dict(state["sampler"])
    ckpt.set_rng_state(own["rng"])
    trainer.step, trainer.nonfinite_total = state["step"], state["nonfinite_total"]
    trainer.rollout_count = state.get("rollout_count", trainer.step)
    trainer.num_tokens = state.get("num_tokens", 0.0)
    trainer.objective.load_state_dict(state.get("objective", trainer.objective.state_dict()))
    if state.get("reference") is not None:
        trainer.reference.load_state_dict(state["reference"])
    trainer.source.load_state_dict(own.get("pipeline"))  # (rollouts generated ahead, with max_staleness)
    if own.get("pending") is not None:
        batch = RolloutBatch(**own["pending"]["batch"])
        for name in ("old_logp", "ref_logp"):  # (kept on the model's device, as the rollout made them)
            if getattr(batch, name) is not None:
                setattr(batch, name, getattr(batch, name).to(trainer.accel.device))
        trainer.pending = (batch, trainer.updates.plan(batch)[own["pending"]["taken"]:])
    if (path / "trainer_state.json").is_file():
        saved = TrainerState.load_from_json(str(path / "trainer_state.json"))
        trainer.control.state.log_history, trainer.control.state.global_step = saved.log_history, saved.global_step
