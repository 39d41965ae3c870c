"""When a run logs, evaluates and saves, and the `transformers` callbacks it calls (TRL's `callbacks=` argument).

`Cadence` turns the config's strategies and step counts (a count, or below 1 a fraction of the run, as
transformers reads them) into yes/no per optimizer step. `RunControl` keeps a `transformers.TrainerState` (global
step, epoch, max steps, `log_history`) that callbacks and reward functions (`trainer_state`) read, and calls each
callback's `on_*` method with the config, the state and a `TrainerControl`; the flags a callback sets
(should_log, should_evaluate, should_save, should_training_stop) are honoured by the loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

EVENTS = ("on_init_end", "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_step_begin",
          "on_pre_optimizer_step", "on_optimizer_step", "on_step_end", "on_evaluate", "on_save", "on_log")


def _every(value: float | None, total: int) -> int:
    """A steps setting as an interval: a count, or below 1 a fraction of the run's steps (at least 1)."""
    if not value:
        return 0
    return max(1, math.ceil(value * total)) if value < 1 else int(value)


class Cadence:
    def __init__(self, cfg, steps_per_epoch: int, total: int):
        self.cfg, self.per_epoch, self.total = cfg, steps_per_epoch, total
        self.log_every = _every(cfg.logging_steps, total)
        self.save_every = _every(cfg.save_steps, total)
        eval_steps = cfg.logging_steps if cfg.eval_steps is None else cfg.eval_steps
        self.eval_every = _every(eval_steps, total)

    def epoch_end(self, step: int) -> bool:
        return step % self.per_epoch == 0 or step == self.total

    def log(self, step: int) -> bool:
        strategy = self.cfg.logging_strategy
        if strategy == "no":
            return False
        if strategy == "epoch":
            return self.epoch_end(step)
        return step % self.log_every == 0 or step == self.total or (self.cfg.logging_first_step and step == 1)

    def evaluate(self, step: int, has_eval: bool) -> bool:
        strategy = self.cfg.eval_strategy
        if not has_eval or strategy == "no":
            return False
        if strategy == "epoch":
            return self.epoch_end(step)
        return step == self.total or bool(self.eval_every and step % self.eval_every == 0)

    def evaluate_first(self, has_eval: bool) -> bool:
        return has_eval and self.cfg.eval_on_start and self.cfg.eval_strategy != "no" and self.eval_every > 0

    def save(self, step: int) -> bool:
        """A checkpoint after `step`: every save_every steps and, as transformers' Trainer does under a steps
        strategy, at the last step (so a finished run resumes at its end rather than redoing its last steps)."""
        strategy = self.cfg.save_strategy
        if strategy == "no":
            return False
        if strategy == "epoch":
            return self.epoch_end(step)
        return bool(self.save_every and (step % self.save_every == 0 or step >= self.total))

    def samples(self, step: int) -> bool:
        if self.cfg.log_completions is not None:
            return self.cfg.log_completions and self.log(step)
        every = self.cfg.log_completions_steps
        return bool(every and step % every == 0)


class RunControl:
    """The callbacks of a run, the TrainerState they read, and the flags they set."""

    def __init__(self, cfg, callbacks: list | None, layout, is_main: bool):
        from transformers import TrainerState

        self.cfg = cfg
        self.callbacks = [cb() if isinstance(cb, type) else cb for cb in (callbacks or [])]
        for cb in self.callbacks:
            if not any(callable(getattr(cb, event, None)) for event in EVENTS):
                raise TypeError(f"callbacks: {type(cb).__name__} has none of the on_* methods of "
                                "transformers.TrainerCallback")
        self.state = TrainerState(max_steps=layout.total_steps, num_train_epochs=math.ceil(
            layout.total_steps / layout.steps_per_epoch), logging_steps=cfg.logging_steps,
            eval_steps=cfg.eval_steps or 0, save_steps=cfg.save_steps, train_batch_size=layout.micro_batch,
            is_local_process_zero=is_main, is_world_process_zero=is_main)
        self.control = self._fresh_control()
        self.cadence = Cadence(cfg, layout.steps_per_epoch, layout.total_steps)
        self.steps_per_epoch = layout.steps_per_epoch

    @staticmethod
    def _fresh_control():
        from transformers import TrainerControl

        return TrainerControl()

    def add(self, callback) -> None:
        self.callbacks.append(callback() if isinstance(callback, type) else callback)

    def pop(self, callback):
        for cb in self.callbacks:
            if cb is callback or (isinstance(callback, type) and isinstance(cb, callback)):
                self.callbacks.remove(cb)
                return cb
        return None

    def event(self, name: str, **kwargs: Any):
        """Call `name` on every callback (those that define it); a returned TrainerControl replaces ours."""
        for cb in self.callbacks:
            method = getattr(cb, name, None)
            if callable(method):
                result = method(self.cfg, self.state, self.control, **kwargs)
                if result is not None:
                    self.control = result
        return self.control

    def step_done(self, step: int, has_eval: bool, **kwargs: Any):
        """After optimizer step `step`: the state advances, our cadence sets the flags, callbacks may change them."""
        self.state.global_step = step
        self.state.epoch = step / self.steps_per_epoch
        control = self.control
        control.should_log = self.cadence.log(step)
        control.should_evaluate = self.cadence.evaluate(step, has_eval)
        control.should_save = self.cadence.save(step)
        control.should_epoch_stop = False
        self.event("on_step_end", **kwargs)
        if step % self.steps_per_epoch == 0:
            self.event("on_epoch_end", **kwargs)
        return self.control

    def logged(self, step: int, logs: dict[str, float], **kwargs: Any) -> None:
        self.state.log_history.append({**logs, "epoch": round(self.state.epoch, 4), "step": step})
        self.control.should_log = False
        self.event("on_log", logs=logs, **kwargs)

    def after_step(self, step: int, metrics: dict[str, float], report, *, has_eval: bool,
                   evaluate: Callable[[], dict[str, float]], samples: list | None,
                   save: Callable[[], Any]) -> None:
        """After optimizer step `step`: our cadence and then the callbacks set the flags; evaluate, log (`report`,
        a grpo.training.observe.summary.StepLog), write samples and save (`save()`) as they say (a callback's
        should_training_stop ends the loop)."""
        control = self.step_done(step, has_eval, metrics=metrics)
        if control.should_evaluate:
            evaluated = evaluate()  # (rewards only: the loss would sample the set again)
            metrics.update(evaluated)
            control.should_evaluate = False
            self.event("on_evaluate", metrics=evaluated)
        if control.should_log or any(k.startswith("eval/") for k in metrics):
            report(step, metrics)
        if self.cadence.samples(step):
            report.logger.log_samples(step, samples, print_rows=self.cfg.num_completions_to_print)
        if control.should_save:
            save()
            control.should_save = False
            self.event("on_save")
