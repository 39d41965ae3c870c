"""One run per directory: a new run never writes over another's results, and a resumed run is the run it resumes.

`train()` into an output_dir that holds a run's files (config.yaml, metrics.jsonl, checkpoint-*/, final/, ...) is
refused unless it resumes (resume, --resume, resume_from_checkpoint) or `overwrite_output_dir` is set, which deletes
those files first (only those: a file grpo does not write is left alone). A resumed run compares its resolved
config (grpo.training.observe.summary.RunFiles.resolved, kept in each checkpoint) with the checkpoint's:

- what makes it another run is refused: the model, the data, the rewards, the group size, the seed, the batch
  layout of a rollout (prompts per rollout, optimizer steps per rollout, passes), LoRA, the dtype;
- what only steers the rest of the run (learning_rate, beta, clipping, max_steps, temperature, the micro-batch
  size, ...) is taken, and printed as `old -> new`: learning_rate and AdamW's settings are written into the
  restored optimizer and schedule (which would otherwise keep the checkpoint's), as a user who lowers the rate to
  calm a run means;
- where the output goes, how often it logs, evaluates and saves, and the launch details say nothing.

One run at a time: train, resume and overwrite alike first take the directory's lock (grpo.training.run.lock), so a
second run into a directory a live run holds is refused in one line, and its files are untouched. A run that wrote
final/ records its step in finished.json: `--resume` of it says it is finished and does nothing, unless max_steps
grew.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from grpo.config import ConfigError
from grpo.training.run import lock
from grpo.training.checkpoint.files import MANIFEST, PREFIX
from grpo.training.run.loop_state import LoopState
from grpo.training.checkpoint.state import checkpoint_to_resume

FINISHED = "finished.json"  # the step at which final/ was written
RUN_FILES = ("config.yaml", "layout.yaml", "metrics.jsonl", "samples", "runs", "tensorboard", "final", "final.tmp",
             "plot.png", "nonfinite", "wandb_run_id", FINISHED)
IDENTITY = ("model_name_or_path", "model_revision", "torch_dtype", "bf16", "fp16", "task", "task_difficulty",
            "task_train_size", "dataset_name", "dataset_config", "dataset_split", "prompt_column", "system_prompt",
            "chat_template", "use_chat_template", "prefill", "max_prompt_length", "num_generations", "seed",
            "data_seed", "shuffle_dataset", "reward_funcs", "step_reward_funcs", "use_peft", "lora_r", "lora_alpha",
            "lora_dropout", "lora_target_modules", "lora_target_parameters", "lora_modules_to_save", "use_rslora", "use_dora",
            "load_in_4bit", "cast_lm_head_to_fp32")
LAYOUT_IDENTITY = ("processes", "prompts_per_rollout", "steps_per_rollout", "num_iterations",
                   "steps_per_epoch")
QUIET = ("output_dir", "overwrite_output_dir", "resume", "resume_from_checkpoint", "stop_signals", "run_name",
         "project", "disable_tqdm", "num_threads", "metric_names", "num_completions_to_print", "report_to",
         "per_device_eval_batch_size", "push_to_hub")
QUIET_PREFIXES = ("log", "eval_", "save_", "hub_", "wandb_")


def run_files(out: Path) -> list[str]:
    """The names in `out` that a run writes (sorted)."""
    if not out.is_dir():
        return []
    return sorted(p.name for p in out.iterdir() if p.name in RUN_FILES or p.name.startswith(PREFIX))


def prepare(cfg, procs, loop: LoopState, requested: Any, total_steps: int,
            current: Callable[[], tuple[dict, dict]], resume: Callable[[Path, set[str]], None],
            restore: Callable[[Path], None]) -> bool:
    """At the start of train(): the run directory's lock (grpo.training.run.lock) and rules, then the checkpoint to
    continue from (if any) handed to `resume(path, changed keys)`, after comparing the checkpoint's config with
    `current()` (this run's resolved config and layout). True: a resume of a run that is finished (nothing to do;
    said in a line; `loop.step` set to its step, its last checkpoint handed to `restore`, so the trainer holds the
    final weights). The main process decides; every process raises the same ConfigError and applies the same
    changes. Collective."""
    main, out = procs.accel.is_main_process, Path(cfg.output_dir)
    resuming = bool(requested if requested is not None else (cfg.resume_from_checkpoint or cfg.resume))
    verdict = [None, None, None]  # (refusal, the step a finished run ended at, its checkpoint at that step)
    if main:
        try:
            lock.take(out)
            if resuming and (requested is True or (requested is None and not cfg.resume_from_checkpoint)):
                verdict[1] = _finished(out, total_steps)
                last = out / f"{PREFIX}{verdict[1]}"
                verdict[2] = str(last) if verdict[1] and (last / MANIFEST).is_file() else None
        except ConfigError as err:
            verdict[0] = str(err)
    _agree(procs.accel, verdict)
    if verdict[1]:
        try:  # the checkpoint of its last step (a steps or epoch strategy writes one): the trainer holds its weights
            if verdict[2] is not None:
                restore(checkpoint_to_resume(cfg, verdict[2], procs))  # (quietly: said above)
        finally:
            release(out, main)
        loop.step = verdict[1]
        return True
    try:
        path = checkpoint_to_resume(cfg, requested, procs)
        decision = [None, []]  # (refusal, changes)
        if main:
            try:
                if path is not None:
                    decision[1] = compare_with_checkpoint(cfg, path, *current())
                elif not resuming and not loop.owns_output_dir:
                    claim(out, cfg.overwrite_output_dir)
            except ConfigError as err:
                decision[0] = str(err)
        _agree(procs.accel, decision)
        if path is not None:
            resume(path, {k for k, _, _ in decision[1]})
    except BaseException:
        release(out, main)  # (a refused run leaves the directory free)
        raise
    loop.owns_output_dir = True  # (a second train() of this trainer continues in it)
    return False


def _agree(accel, decision: list) -> None:
    """The main process's decision to every process; its refusal (decision[0]) raised on all. Collective."""
    if accel.num_processes > 1:  # (every process, sequence-parallel ones included)
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(decision)
    if decision[0] is not None:
        raise ConfigError(decision[0])


def _finished(out: Path, total_steps: int) -> int | None:
    """The step the run in `out` ended at (final/ written), if at this run's max steps or beyond: said in a line.
    A run that is to go further is no longer finished."""
    done = out / FINISHED
    try:
        step = int(json.loads(done.read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if step < total_steps:
        done.unlink()
        return None
    print(f"resume: the run in {out} finished at step {step} (final/ written): nothing to do; raise max_steps above "
          f"{step} to train it further.")
    return step


def finished(out: Path, step: int, main: bool) -> None:
    """After final/ is written: the run is complete at `step` (a later --resume does nothing unless max_steps
    grows)."""
    if main:
        (out / FINISHED).write_text(json.dumps({"step": step}) + "\n")


def release(out: Path, main: bool) -> None:
    """When train() ends, however it ends: the directory's lock given back (main process)."""
    if main:
        lock.release(out)


def claim(out: Path, overwrite: bool) -> None:
    """Refuse a directory that holds another run's files, or (overwrite) delete those files."""
    found = run_files(out)
    if not found:
        return
    if not overwrite:
        shown = ", ".join(found[:6]) + (", ..." if len(found) > 6 else "")
        raise ConfigError(f"output_dir: {out} holds a run ({shown}); continue it with --resume (resume: true), choose "
                          "another output_dir, or set overwrite_output_dir: true to delete that run's files and start "
                          "over.")
    for name in found:
        target = out / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    print(f"overwrite_output_dir: deleted the previous run's {', '.join(found)} in {out}.")


def saved_files(path: Path, cfg) -> tuple[dict | None, dict | None]:
    """The config and layout a checkpoint was written with (older checkpoints: those of its run directory)."""
    def read(name: str) -> dict | None:
        for where in (path, Path(cfg.output_dir)):
            if (where / name).is_file():
                return yaml.safe_load((where / name).read_text())
        return None

    return read("config.yaml"), read("layout.yaml")


def compare_with_checkpoint(cfg, path: Path, now: dict, layout: dict) -> list[tuple[str, Any, Any]]:
    """Refuse (ConfigError) a resume whose config makes it another run than the one `path` belongs to (`now`: this
    run's resolved config, `layout` its batch layout); return the other changes (key, old, new) and print them."""
    saved, saved_layout = saved_files(path, cfg)
    if saved is None:
        print(f"resume: {path} has no config.yaml to compare this run's config with.")
        return []
    refused = [(k, saved[k], now[k]) for k in IDENTITY if k in saved and k in now and saved[k] != now[k]]
    refused += [(f"layout.{k}", saved_layout[k], layout[k]) for k in LAYOUT_IDENTITY
                if saved_layout and k in saved_layout and saved_layout[k] != layout[k]]
    if refused:
        changes = "; ".join(f"{k} {old!r} -> {new!r}" for k, old, new in refused)
        raise ConfigError(f"resume: {changes} would make this another run than the one {path} belongs to; resume with "
                          "the checkpoint's values, or start a new run from its weights (model_name_or_path: "
                          f"{path}, another output_dir).")
    changed = [(k, saved[k], now[k]) for k in now if k in saved and saved[k] != now[k] and k not in QUIET
               and not k.startswith(QUIET_PREFIXES)]
    if changed:
        print("resume: changed since the checkpoint, taken from now on: "
              + "; ".join(f"{k} {old!r} -> {new!r}" for k, old, new in changed))
    return changed


def apply_changes(cfg, optimizer, scheduler, changed: set[str]) -> None:
    """After the checkpoint's optimizer and schedule are restored: the config's learning_rate, AdamW settings and
    schedule replace theirs (restored, they would silently keep the checkpoint's)."""
    import torch

    if not changed & {"learning_rate", "adam_beta1", "adam_beta2", "adam_epsilon", "weight_decay", "max_steps",
                      "num_train_epochs", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio"}:
        return
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):  # (a user's own scheduler keeps its state)
        return
    scheduler.base_lrs = [cfg.learning_rate] * len(scheduler.base_lrs)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group.update(lr=cfg.learning_rate * factor(scheduler.last_epoch), weight_decay=cfg.weight_decay,
                     betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
