"""`Processes`: this process's place among the run's data-parallel ranks, and the gathers across them that the
rollout, the objective and the update need (sequence-parallel groups counted as one rank)."""

from __future__ import annotations

import torch

from grpo.engines.ulysses import sequence_group


class Processes:
    """This process's place among the run's data-parallel ranks, and the gathers the rollout needs.

    With sequence parallelism (`sp_size` > 1) the processes form groups of `sp_size` consecutive ranks that share
    every row (grpo.engines.ulysses): a group is one data-parallel rank, so `world` counts groups and `rank` is this
    process's group, and a gather keeps one copy of each group's values (its first process's)."""

    def __init__(self, accelerator, sp_size: int = 1):
        self.accel, self.sp_size = accelerator, sp_size
        self.world, self.rank = accelerator.num_processes // sp_size, accelerator.process_index // sp_size
        self.sp = sequence_group(accelerator, sp_size) if sp_size > 1 else None  # (grpo.engines.ulysses)

    def _firsts(self, gathered: torch.Tensor) -> torch.Tensor:
        """The parts of the SP groups' first processes from a gather of equal parts over every process."""
        if self.sp_size == 1:
            return gathered
        parts = gathered.reshape(self.accel.num_processes, -1, *gathered.shape[1:])[::self.sp_size]
        return parts.reshape(-1, *gathered.shape[1:])

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        if self.accel.num_processes == 1:
            return t
        return self._firsts(self.accel.gather(t.to(self.accel.device)).cpu())

    def gather_ragged(self, t: torch.Tensor) -> torch.Tensor:
        """A 1-D tensor of each process, of any length, concatenated on every process (TRL pads with a sentinel)."""
        if self.accel.num_processes == 1:
            return t
        local = t.to(self.accel.device)
        padded = self.accel.pad_across_processes(local, dim=0, pad_index=-1e9)
        gathered = self._firsts(self.accel.gather(padded))
        return gathered[gathered != -1e9]

    def gather_objects(self, rows: list) -> list:
        if self.accel.num_processes == 1:
            return rows
        if self.sp_size == 1:
            from accelerate.utils import gather_object

            return gather_object(rows)
        parts = [None] * self.accel.num_processes
        torch.distributed.all_gather_object(parts, rows)
        return [row for part in parts[::self.sp_size] for row in part]
