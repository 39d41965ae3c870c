"""Stop signals: a pre-empted or Ctrl-C'd run finishes its optimizer step, writes a checkpoint and exits 75.

SLURM (`scancel`, pre-emption, the time limit) and Kubernetes send SIGTERM and kill the job some seconds later
(SLURM's KillWait, Kubernetes' terminationGracePeriodSeconds: 30 s by default); SLURM's `--signal=USR1@120` sends
SIGUSR1 that long before the time limit. On the first signal of `stop_signals` the run takes the step it is in to
its end, writes checkpoint-<step> and raises `TrainingInterrupted` (`grpo train` prints the resume command and exits
75). With several processes the signal may reach one of them only: once per optimizer step every process adds its
flag in an all-reduce, so all stop after the same step and write one whole checkpoint together.

A second Ctrl-C (SIGINT) stops at once (KeyboardInterrupt). A launcher such as torchrun passes the terminal's Ctrl-C
on to its workers, which then see the same SIGINT twice within milliseconds: a repeat within `REPEAT_WINDOW_S` is
taken as that copy. Handlers are installed for `train()` only, from the main thread only (Python's rule), and the
previous ones put back after.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from grpo.training.checkpoint.files import PREFIX, complete_checkpoints
from grpo.training.run.errors import TrainingInterrupted, resume_hint

REPEAT_WINDOW_S = 1.0
class StopSignals:
    """The stop signals of a run: installed by `install()`, agreed on by every process with `agreed()`."""

    def __init__(self, names, processes):
        self.numbers = [getattr(signal, name) for name in names]
        self.processes = processes
        self.received, self.first_at, self.previous = 0, 0.0, {}

    def install(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self.previous = {n: signal.signal(n, self._handle) for n in self.numbers}
        return self

    def restore(self) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)
        self.previous = {}

    def _handle(self, number: int, frame) -> None:
        now = time.monotonic()
        if not self.received:
            self.received, self.first_at = number, now
            if self.processes.rank == 0:  # (on a terminal, off the live display's line and a ^C first)
                print(f"{chr(10) if sys.stderr.isatty() else ''}grpo: {signal.Signals(number).name}: finishing this "
                      "optimizer step, then writing a checkpoint (Ctrl-C again to stop at once).", file=sys.stderr,
                      flush=True)
        elif number == signal.SIGINT and now - self.first_at > REPEAT_WINDOW_S:
            raise KeyboardInterrupt

    def agreed(self) -> int:
        """The signal any process received (0: none): the same answer on every process. Collective."""
        if self.processes.accel.num_processes == 1:
            return self.received
        flag = torch.tensor([self.received], device=self.processes.accel.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return int(flag.item())


def stop_if_signalled(signals: StopSignals, cfg, accel, step: int, total_steps: int,
                      save: Callable[[], Any]) -> None:
    """After optimizer step `step`: when a stop signal came to any process, write this step's checkpoint (`save()`,
    unless the cadence just did) and raise TrainingInterrupted saying how to resume. Collective."""
    number = signals.agreed()
    if number:
        raise stopped_with_checkpoint(signal.Signals(number).name, cfg, accel, step, total_steps, save)


def stopped_with_checkpoint(reason: str, cfg, accel, step: int, total_steps: int,
                            save: Callable[[], Any]) -> TrainingInterrupted:
    """Write step `step`'s checkpoint (unless the cadence just did): the TrainingInterrupted (exit 75) that says
    `reason` and how to resume. Collective. Also when every vLLM server of the run stopped answering (its
    ServersDown: the step's rollout had not begun to change anything the checkpoint holds)."""
    if not _saved_now(cfg.output_dir, step, accel):
        save()
    path = Path(cfg.output_dir) / f"{PREFIX}{step}"
    note = " (model only: save_only_model is set, so it cannot be resumed)" if cfg.save_only_model else ""
    return TrainingInterrupted(f"{reason} after step {step} of {total_steps}; wrote {path}{note}. "
                               f"Resume: {resume_hint()}")


def _saved_now(output_dir: str, step: int, accel) -> bool:
    """Whether this step's checkpoint is complete on disk already (the cadence wrote it): the main process looks,
    every process takes its answer."""
    found = [step in dict(complete_checkpoints(output_dir))] if accel.is_main_process else [False]
    if accel.num_processes > 1:  # (every process, sequence-parallel ones included)
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(found)
    return found[0]
