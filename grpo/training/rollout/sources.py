"""Where the trainer's rollouts come from: one source object the loop calls the same way in every mode.

    SyncRollouts     max_staleness 0: generation, scoring and the update take turns in the trainer's process
                     (the run as it always was: `Rollouts.make`).
    LaggedRollouts   max_staleness k > 0, a forked rollout worker: grpo.training.rollout.pipeline.
    ServerRollouts   max_staleness k > 0 with a `grpo vllm-serve` server generating: grpo.training.rollout.pipeline_server.
"""

from __future__ import annotations

from typing import Protocol

import torch

from grpo.agents import AgentRollout
from grpo.agents.episodes import EpisodeRollout
from grpo.config import ConfigError
from grpo.config.derived import needs_reference
from grpo.training.rollout.pipeline import LaggedRollouts
from grpo.training.rollout.pipeline_server import ServerRollouts
from grpo.training.rollout.rollouts import Rollouts
from grpo.training.rollout.batch import RolloutBatch


class RolloutSource(Protocol):
    """What the loop calls of its rollout source, whichever mode the run is in (the three below)."""

    layout: str  # one line for the start of the run: how rollouts are made

    def start(self) -> None:  # when train() begins (a lag: the worker or client thread starts)
        ...

    def stepped(self, step: int) -> None:  # after optimizer step `step` (a lag: the next rollout may start)
        ...

    def next(self, index: int) -> RolloutBatch:  # rollout `index` of the run
        ...

    def close(self) -> None:  # when train() ends, however it ends
        ...

    def state_dict(self) -> dict | None:  # the rollouts generated ahead, for a checkpoint (Stateful)
        ...

    def load_state_dict(self, state: dict | None) -> None:
        ...


class SyncRollouts:
    """Rollout t made when the trainer asks for it, with the weights of that moment (max_staleness 0)."""

    layout = "synchronous (generation, scoring and the update take turns in this process)"

    def __init__(self, rollouts: Rollouts):
        self.rollouts = rollouts

    def start(self) -> None:
        pass

    def stepped(self, step: int) -> None:
        pass

    def next(self, index: int) -> RolloutBatch:
        return self.rollouts.make(index)

    def close(self) -> None:
        pass

    def state_dict(self) -> dict | None:
        return None

    def load_state_dict(self, state: dict | None) -> None:
        if state is not None and state.get("ready"):
            raise ConfigError(f"resume_from_checkpoint: the checkpoint holds {len(state['ready'])} rollout(s) "
                              f"generated ahead with max_staleness: {state['lag']}; resume with that max_staleness.")


def make_source(cfg, rollouts: Rollouts, policy, device, rollout_steps: int, total_steps: int, distributed: str,
                reference=None) -> RolloutSource:
    """The run's rollout source; a lag where the worker cannot run is a ConfigError saying why. `reference(batch)`:
    the reference's log-probs of a batch's rows, which the worker takes too where it can: the reference never
    changes (no sync_ref_model) and planning the passes needs no other process (no token budget over several)."""
    if cfg.max_staleness == 0:
        return SyncRollouts(rollouts)
    episodes = isinstance(rollouts.agent, EpisodeRollout)  # (an agent's endpoint is served where the engine is)
    if rollouts.agent is not None and not isinstance(rollouts.agent, AgentRollout) and not episodes:
        raise ConfigError("max_staleness: a rollout_func is handed the trainer itself, whose weights a rollout made "
                          "ahead would see mid-update; set max_staleness: 0.")
    if rollouts.agent is not None and not cfg.use_vllm and not episodes:
        raise ConfigError("max_staleness: multi-turn rollouts with a lag run on the vLLM server path (use_vllm, "
                          "vllm_mode: server), where tools and environments stay in the trainer's process; a forked "
                          "rollout worker would share the trainer's tool processes and environment instances. Use "
                          "the server, or set max_staleness: 0.")
    total_rollouts = -(-total_steps // rollout_steps)
    if cfg.use_vllm:  # (server mode: validated) the server generates; a thread of this process talks to it
        return ServerRollouts(rollouts, policy, cfg.max_staleness, rollout_steps, total_rollouts)
    if device.type != "cpu":
        raise ConfigError(f"max_staleness: the rollout worker is a forked process with its own copy of the model, "
                          f"which cannot use {device.type} after the trainer has; with GPUs a lag needs generation "
                          f"on other devices: use_vllm with vllm_mode: server, or set max_staleness: 0.")
    if torch.cuda.is_initialized():  # (a CPU run on a GPU host, with e.g. a reward model put on cuda)
        raise ConfigError("max_staleness: CUDA is initialised in the trainer's process (a reward model on cuda?), "
                          "and the forked rollout worker, which runs the rewards, cannot use it after a fork; keep "
                          "a CPU run's reward models on the CPU, or set max_staleness: 0.")
    if distributed in ("FSDP", "DEEPSPEED"):
        raise ConfigError(f"max_staleness: under {distributed} each process holds a shard of the weights and the "
                          "forked worker needs them whole: use use_vllm with vllm_mode: server (the push gathers "
                          "them), or set max_staleness: 0.")
    alone = rollouts.procs.world == 1 or cfg.max_tokens_per_micro_batch is None
    reference = reference if needs_reference(cfg) and not cfg.sync_ref_model and alone else None
    return LaggedRollouts(rollouts, policy, cfg.max_staleness, rollout_steps, total_rollouts, reference)
