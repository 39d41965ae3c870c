"""The loop's own state, in one owner, and the protocol of every part a checkpoint saves.

`LoopState` is what the loop itself counts and carries between optimizer steps: the step, the rollouts drawn, the
completion tokens seen, the non-finite steps skipped, the rollout still feeding optimizer steps, whether this run
owns its output directory, and what it last sampled. The trainer holds one; the checkpoint, the run directory and the
stop signals are handed it (never the trainer). Its `state_dict` is the counters a resume restores; the pending
rollout travels per process beside it (grpo.training.checkpoint.state).

`Stateful` is the shape a checkpoint sees in every other part (scheduler, prompt sampler, objective, rollout source,
reference): `state_dict()` and `load_state_dict(state)`, as torch's modules and optimizers have them (prime-rl's
`AppState(Stateful)` is the model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class LoopState:
    step: int = 0  # optimizer steps taken
    rollout_count: int = 0  # rollouts drawn (a rollout may feed several steps)
    num_tokens: float = 0.0  # completion tokens seen (TRL's num_tokens)
    nonfinite_total: int = 0  # optimizer steps skipped for a non-finite gradient norm
    nonfinite_in_a_row: int = 0  # the same, since the last finite one (not saved: a resume starts counting again)
    pending: tuple[Any, list] | None = None  # (a rollout batch, its optimizer steps still to take)
    owns_output_dir: bool = False  # a second train() of the same trainer continues in its directory
    last_samples: list | None = None  # the last rollout's rows as logged (TRL's `_logs`)

    COUNTERS = ("step", "rollout_count", "num_tokens", "nonfinite_total")

    def state_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.COUNTERS}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # (checkpoints from before rollout_count and num_tokens were kept: one rollout per step, no count)
        self.step, self.nonfinite_total = state["step"], state["nonfinite_total"]
        self.rollout_count = state.get("rollout_count", self.step)
        self.num_tokens = state.get("num_tokens", 0.0)
