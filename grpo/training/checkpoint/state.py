"""A run's state in a checkpoint, and back: what `train()` continues from, exactly.

Beside the model files (grpo.training.checkpoint.files): the optimizer, the schedule, the prompt sampler, every random
state, the counters, the adaptive entropy coefficient, a synced reference's weights, and the rollout that was still
feeding optimizer steps (with the number it had fed), so a run resumed inside a rollout takes the same steps; with
max_staleness, the rollouts generated ahead (grpo.training.rollout.pipeline).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo.config import ConfigError
from grpo.engines.expert_parallel import whole_experts
from grpo.training.checkpoint import files as ckpt
from grpo.training.checkpoint import sharded as sharded_ckpt
from grpo.training.setup.model import load_model_files, save_model_files
from grpo.training.run.loop_state import LoopState, Stateful
from grpo.training.rollout.batch import RolloutBatch


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


@dataclass
class Checkpointing:
    """What a checkpoint is written from and restored into: the model's files, the loop's state and the Stateful
    parts, never the trainer. `parts` are saved once (the main process's: scheduler, prompt sampler, objective, a
    synced reference); `own_parts` once per process (the rollout source, with the rollouts it generated ahead), beside
    each process's random state and its rows of the rollout still feeding optimizer steps."""

    cfg: Any
    accel: Any
    procs: Any  # grpo.training.setup.processes.Processes
    model: Any  # as accelerate prepared it (a sharded run saves through it)
    policy: Any  # the unwrapped model
    optimizer: Any
    tokenizer: Any
    sharded: bool  # FSDP or DeepSpeed: weights and optimizer state in shards
    loop: LoopState
    parts: dict[str, Stateful]
    own_parts: dict[str, Stateful]
    rollout_steps: int  # optimizer steps a rollout feeds
    replan: Callable[[RolloutBatch], list]  # a restored rollout's optimizer steps, planned again
    control: Any  # grpo.training.run.control.RunControl: its transformers TrainerState (global step, log history)
    write_run_files: Callable[[Path], None]  # config.yaml and layout.yaml

    def state(self) -> dict[str, Any]:
        """Everything `restore` needs besides the model files (and, for a sharded run, besides the sharded optimizer
        state). Each process's own part is gathered to every process: `processes[rank]`. Collective when the run
        has several processes."""
        own = {"rng": ckpt.rng_state(), "pending": None,
               **{name: part.state_dict() for name, part in self.own_parts.items()}}
        if self.loop.pending is not None and self.loop.pending[1]:
            batch, left = self.loop.pending
            own["pending"] = {"batch": batch.tensors(), "taken": self.rollout_steps - len(left)}
        state = {**self.loop.state_dict(), **{name: part.state_dict() for name, part in self.parts.items()},
                 "processes": self.procs.gather_objects([own])}
        if not self.sharded:  # (a sharded run's optimizer state is saved in shards, beside)
            state["optimizer"] = self.optimizer.state_dict()
        return state

    def save(self) -> Path | None:
        """Write checkpoint-<step> (grpo.training.checkpoint.files; sharded runs: grpo.training.checkpoint.sharded). Every
        process calls it; returns the path on the main process."""
        cfg, accel, step = self.cfg, self.accel, self.loop.step
        state = None if cfg.save_only_model else self.state()

        def write_json(path: Path) -> None:  # trainer_state.json, and the run's config.yaml and layout.yaml beside it
            self.control.state.save_to_json(str(path))
            self.write_run_files(path.parent)

        if self.sharded:
            return sharded_ckpt.save(accel, self.model, self.policy, self.optimizer, self.tokenizer, cfg.output_dir,
                                     step, state, cfg.save_total_limit, write_json=write_json)
        with whole_experts(self.policy, main_only=True):  # (expert parallelism: every expert, to the main process)
            if not accel.is_main_process:
                return None
            return ckpt.save_checkpoint(cfg.output_dir, step, lambda path: save_model_files(self.policy,
                                                                                            self.tokenizer, path),
                                        state, cfg.save_total_limit, write_json=write_json)

    def restore(self, path: Path) -> None:
        """The model files, the optimizer, the loop state and every part as `path` holds them."""
        state = self._load(path)
        # (checkpoints written before the per-process parts held the main process's random state and rollout only)
        processes = state.get("processes") or [{"rng": state["rng"], "pending": state.get("pending")}]
        if len(processes) != self.procs.world:
            raise ConfigError(f"resume_from_checkpoint: {path} was written by {len(processes)} process(es), this run "
                              f"has {self.procs.world}; resume with {len(processes)}.")
        own = processes[self.procs.rank]
        for name, part in self.parts.items():
            if state.get(name) is not None:  # (older checkpoints lack the objective; a reference saved if synced)
                part.load_state_dict(state[name])
        ckpt.set_rng_state(own["rng"])
        self.loop.load_state_dict(state)
        for name, part in self.own_parts.items():
            part.load_state_dict(own.get(name))
        if own.get("pending") is not None:
            batch = RolloutBatch(**own["pending"]["batch"])
            for name in ("old_logp", "ref_logp"):  # (kept on the model's device, as the rollout made them)
                if getattr(batch, name) is not None:
                    setattr(batch, name, getattr(batch, name).to(self.accel.device))
            self.loop.pending = (batch, self.replan(batch)[own["pending"]["taken"]:])
        if (path / "trainer_state.json").is_file():
            from transformers import TrainerState

            saved = TrainerState.load_from_json(str(path / "trainer_state.json"))
            self.control.state.log_history, self.control.state.global_step = saved.log_history, saved.global_step

    def _load(self, path: Path) -> dict[str, Any]:
        """trainer_state.pt, with the model's weights and the optimizer's state loaded from beside it."""
        try:
            state = ckpt.load_trainer_state(path)
            if self.sharded:  # the sharded weights and optimizer state, not the gathered copy
                sharded_ckpt.load(self.accel, self.model, self.optimizer, path)
            elif "optimizer" not in state:
                raise ConfigError(f"resume_from_checkpoint: {path} was written by a sharded run (its optimizer state "
                                  "is in shards); resume with the launch configuration that wrote it.")
            else:
                with whole_experts(self.policy):  # (expert parallelism: each process keeps its shard of them)
                    load_model_files(self.policy, path)
                self.optimizer.load_state_dict(state["optimizer"])
        except ValueError as err:
            raise ConfigError(f"resume_from_checkpoint: {err}") from None
        return state
