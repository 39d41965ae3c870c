"""How a run stops before its end, and the exit status `grpo train` gives each way (docs/runs.md).

    0   done: final/ written
    1   stopped by the run itself (TrainingStopped: a streak of non-finite losses, an engine that failed)
    2   a bad config or bad data, found before training (ConfigError, RewardError)
    74  a checkpoint or final/ could not be written (SaveFailed: no space, no permission); the previous checkpoint
        is intact: free space or fix the permission, then resume                       (sysexits.h EX_IOERR)
    75  stopped by a signal (SIGTERM, SIGINT, SIGUSR1: `stop_signals`) after a whole step, with a checkpoint of that
        step written: resume continues exactly                                         (sysexits.h EX_TEMPFAIL)
    130 a second Ctrl-C: stopped at once, nothing saved since the last checkpoint
"""

from __future__ import annotations

import shlex

EXIT_STOPPED, EXIT_SAVE_FAILED, EXIT_RESUMABLE, EXIT_INTERRUPTED = 1, 74, 75, 130
_resume_command: list[str] | None = None  # set by `grpo train`: the command line that continues the run


def set_resume_command(argv: list[str]) -> None:
    """The command that resumes this run (what `grpo train` was given, with --resume), for the stop messages."""
    global _resume_command
    _resume_command = list(argv) + ([] if "--resume" in argv else ["--resume"])


def resume_hint() -> str:
    return shlex.join(_resume_command) if _resume_command else "train(resume_from_checkpoint=True), same config"


class TrainingStopped(RuntimeError):
    """The run stopped itself (e.g. repeated non-finite losses); the last good checkpoint is intact."""

    exit_code = EXIT_STOPPED


class TrainingInterrupted(TrainingStopped):
    """A stop signal came: the run finished its optimizer step, wrote a checkpoint of it and stopped."""

    exit_code = EXIT_RESUMABLE


class SaveFailed(TrainingStopped):
    """A checkpoint or final/ could not be written; the checkpoints written before are intact."""

    exit_code = EXIT_SAVE_FAILED


class EngineFailed(TrainingStopped):
    """The rollout or update engine died or ran out of memory; the message names the setting to change."""

