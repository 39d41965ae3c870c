"""`GRPOTrainer`: the GRPO loop, readable top to bottom.

    for each optimizer step:
        if the last rollout has fed all its steps, a new rollout:
            prompts      <- the next B prompts (same on every process)
            completions  <- G samples per prompt from the rollout engine (this process's share of the B*G rows)
            rewards      <- every reward function, weighted and summed; gathered so group statistics see all G
            advantages   <- (r - group mean) / group std   [+ process-supervision advantages from step rewards]
            old/ref      <- log-probs of the sampling policy (when it feeds several steps) and of the reference
        update           <- one AdamW step on the surrogate + beta * KL over this step's rows, in micro-batches
        log, eval, checkpoint, callbacks

A rollout feeds steps_per_generation / gradient_accumulation_steps optimizer steps per pass, num_iterations passes
(TRL's counting; grpo.training.update.steps). Checkpoints may fall inside a rollout: they keep it, so resume is exact.
The math lives in `grpo.core` (put together in `grpo.training.update.objective`), generation and the passes through the
model in an engine (`grpo.engines`), the rollout's bookkeeping in `grpo.training.rollout.rollouts`, the update's micro-batches
and backward in `grpo.training.update.mechanics`; this file is the loop.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from grpo.agents import make_agent_spec, make_rollout
from grpo.config.base import shipped_model
from grpo.config.derived import needs_reference
from grpo.core import sync_reference_
from grpo.engines.base import SamplingParams
from grpo.engines.moe import make_routing
from grpo.engines.policy import reference_view
from grpo.engines.select import choose_engine, make_engine, make_vllm
from grpo.engines.vllm_server import ServersDown
from grpo.training.run import run_dir
from grpo.training.checkpoint import sharded as sharded_ckpt
from grpo.training.run.control import RunControl
from grpo.training.data.prompts import build_prompt_set
from grpo.training.observe.health import HealthMonitor, report_nonfinite
from grpo.training.run.hub import start_hub
from grpo.training.run.loop_state import LoopState
from grpo.training.observe.memory import peak_memory_metrics, reset_peak_memory
from grpo.training.update.micro_batches import MicroBatches
from grpo.training.setup.model import load_model, prepare_model, save_final
from grpo.training.update.objective import Objective
from grpo.training.rollout.sources import make_source
from grpo.training.setup.processes import Processes
from grpo.training.rollout.rollouts import Rollouts
from grpo.training.rollout.batch import RolloutBatch
from grpo.training.setup.sharded import check_sharded_images, check_sharding, place_reference, reduce_in_float32
from grpo.training.run.errors import TrainingStopped
from grpo.training.run.faults import engine_faults
from grpo.training.run.signals import StopSignals, stop_if_signalled, stopped_with_checkpoint
from grpo.training.checkpoint.state import Checkpointing
from grpo.training.setup.data import load_task, make_datasets, tokenizer_for
from grpo.training.setup.inputs import check_inputs, check_sequence_parallel, check_sizes, config_of
from grpo.training.setup.experts import check_expert_parallel, make_expert_parallel
from grpo.engines.expert_parallel import whole_experts
from grpo.training.setup.launch import configure_process, fill_deepspeed_auto, make_accelerator, seed_everything
from grpo.training.setup.optimizer import make_optimizer, make_schedule, warn_low_precision_training
from grpo.training.setup.rewards import check_reward_columns, make_reward_runner, make_step_rewards
from grpo.training.data.stream import epochs_done, make_prompts, prompt_count
from grpo.training.update.steps import StepPlan, resolve_layout
from grpo.training.observe.summary import RunFiles, StepLog, TrainResult, end_lines, finish_run, start_lines
from grpo.training.trl_surface import (TRLSurface, TrainingSummary, data_without_dataset, eval_sets,
                                       warn_as_trl, with_prompt_column)
from grpo.training.update.mechanics import Update, apply_step, clip_gradients
from grpo.training.setup.threads import set_threads
from grpo.training.data.vision import image_processing_for


class GRPOTrainer(TRLSurface):
    """Train a causal LM with GRPO; TRL's `GRPOTrainer` arguments, in TRL's order.

    model: a path / hub name, or a loaded `transformers` model (then `processing_class` is its tokenizer).
    reward_funcs: one reward (a callable of TRL's signature, a name, a loaded reward model) or a list of them;
        default: the config's, else the task's. reward_processing_classes: loaded reward models' tokenizers.
    args: our GRPOConfig, or TRL's (`trl.GRPOConfig`, whose values and meaning are kept).
    train_dataset / eval_dataset: `datasets.Dataset`, a list of dicts or a dict of columns; default: the config's
    dataset or built-in task.
    callbacks: `transformers.TrainerCallback`s (or classes); optimizers: (optimizer, lr scheduler) or (None, None).
    peft_config: a `peft.LoraConfig` (or set `use_peft`). generator: a rollout engine (`grpo.engines.base`).
    tools / rollout_func / environment_factory: multi-turn rollouts, TRL's arguments (grpo.agents, docs/agents.md).
    """

    def __init__(self, model: Any = None, reward_funcs: Any = None, args: Any = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, callbacks=None,
                 optimizers=(None, None), quantization_config=None, peft_config=None, tools=None, rollout_func=None,
                 environment_factory=None, *, generator=None,
                 step_reward_funcs: list | None = None, **unsupported):
        self.cfg = cfg = config_of(args, unsupported)
        warn_as_trl(cfg)
        from_path = model is None or isinstance(model, (str, Path))
        if from_path and model is not None:
            cfg.model_name_or_path = shipped_model(str(model))  # `tiny-tools`: the one in the package
        check_inputs(cfg, from_path, train_dataset)  # the model, then the data: in the order a user fixes them
        self.accel = make_accelerator(cfg)
        check_sharding(self.accel, cfg)
        reduce_in_float32(self.accel)  # (FSDP2 with bf16: gradients reduce in float32, as verl's)
        self.sharded = self.accel.distributed_type in ("FSDP", "DEEPSPEED")  # its state saved in shards
        check_sequence_parallel(cfg, self.accel.num_processes)
        self.procs = Processes(self.accel, cfg.sequence_parallel_size)  # (a sequence-parallel group: one rank)
        self.world, self.rank = self.procs.world, self.procs.rank
        configure_process(cfg)
        seed_everything(cfg.seed)
        self.hub = start_hub(cfg) if cfg.push_to_hub and self.accel.is_main_process else None  # (up front)
        train_dataset, task_ok = data_without_dataset(cfg, train_dataset, self.world, reward_funcs, tools,
                                                      environment_factory, rollout_func)  # (TRL's rules)
        self.task = load_task(cfg) if cfg.task is not None and task_ok else None
        self.prefill = cfg.prefill if cfg.prefill is not None else (self.task.prefill if self.task else "")
        self.agents = make_agent_spec(cfg, tools, environment_factory, rollout_func, self.task, self.accel)
        check_expert_parallel(cfg, self.accel.num_processes, self.accel.distributed_type, self.agents is not None)
        self.rewards, self.reward_names = make_reward_runner(cfg, reward_funcs, self.task, reward_processing_classes,
                                                             self.agents)
        self.step_rewards = make_step_rewards(cfg, step_reward_funcs)
        given_eval = eval_dataset
        train_dataset, eval_dataset = make_datasets(cfg, self.task, train_dataset, eval_dataset)
        train_dataset = with_prompt_column(train_dataset, self.agents)  # (a dataset of environments only)
        self.train_dataset = train_dataset  # (TRL's attribute; get_train_dataloader reads it)
        self.eval_dataset = given_eval if given_eval is not None else eval_dataset  # (TRL's attribute)
        check_reward_columns(self.rewards, train_dataset, self.agents)  # before any model load

        self._prompts(model, from_path, processing_class, train_dataset, eval_dataset)
        self._model_and_engine(model if not from_path else load_model(cfg, quantization_config), peft_config,
                               optimizers, generator)
        self._loop_parts(callbacks)
        self.control.event("on_init_end")

    def _prompts(self, model, from_path: bool, processing_class, train_dataset, eval_dataset) -> None:
        """The tokenizer (or processor), the train and eval prompts tokenized and checked, the batch layout: before
        the weights load, so a bad row or length fails in seconds."""
        cfg = self.cfg
        self.tokenizer = tokenizer_for(cfg, processing_class, cfg.model_name_or_path if from_path else
                                       model.name_or_path)
        self.images = image_processing_for(cfg, processing_class, self.tokenizer, None if from_path else model)
        self.train_set, self.sampler = make_prompts(train_dataset, self.tokenizer, cfg, self.prefill, self.rewards,
                                                    agents=self.agents, images=self.images)
        check_sharded_images(self.accel, self.train_set)
        self.eval_set = eval_sets(eval_dataset, lambda data: build_prompt_set(
            data, self.tokenizer, cfg, self.prefill, "eval_dataset_name", agents=self.agents,
            images=self.images))  # (a dict: by name)
        self.layout = resolve_layout(cfg, self.world, prompt_count(self.train_set))
        self.B, self.G = self.layout.prompts_per_rollout, cfg.num_generations
        check_sizes(cfg, prompt_count(self.train_set), self.B, self.train_set.prompt_ids,
                    None if from_path else model.config, self.tokenizer)

    def _model_and_engine(self, model, peft_config, optimizers, generator) -> None:
        """The loaded model made the policy (LoRA, a reference), its optimizer and schedule, prepared by accelerate;
        the rollout engine and the update backend."""
        cfg = self.cfg
        set_threads(cfg.num_threads, model, cfg.max_staleness)  # (null: from the machine and the model's size)
        self.engine = choose_engine(cfg.engine, model, self.accel.device, self.accel.num_processes,
                                    self.accel.distributed_type,
                                    self.accel.mixed_precision)
        on_disk = cfg.reference_weights == "disk" or (cfg.reference_weights == "auto" and self.engine.name == "cpu")
        model, self.reference = prepare_model(model, cfg, peft_config, Path(cfg.output_dir) if on_disk else None,
                                              reference_prefix=f".reference-rank{self.accel.process_index}-")
        self.experts = make_expert_parallel(cfg, self.accel, model, self.reference)  # (MoE experts split, or None)
        self.total_steps = self.layout.total_steps
        self.optimizer = optimizers[0] or make_optimizer(model, cfg)
        self.scheduler = optimizers[1] or torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, make_schedule(cfg, self.total_steps))
        warn_low_precision_training(model, self.optimizer, cfg, self.accel.distributed_type,
                                    self.accel.mixed_precision)
        fill_deepspeed_auto(self.accel, cfg)
        self.model, self.optimizer = self.accel.prepare(model, self.optimizer)
        self.reference = place_reference(self.reference, self.accel)  # (sharded as the policy is, under FSDP2, ZeRO-3)
        self.policy = self.accel.unwrap_model(self.model)
        self.params = SamplingParams(cfg.max_completion_length, cfg.temperature, cfg.top_p, cfg.top_k, cfg.min_p,
                                     cfg.repetition_penalty)
        if generator is None and cfg.use_vllm:
            generator = make_vllm(cfg, self.policy, self.tokenizer, self.accel, rows=self.B * self.G // self.world)
        self.generator, self.backend = make_engine(self.engine, self.model, self.policy, self.accel, self.tokenizer,
                                                   self.params, self.reference, generator,
                                                   gather_for_generation=cfg.ds3_gather_for_generation,
                                                   sp=self.procs.sp, offload=cfg.activation_offloading)

    def _loop_parts(self, callbacks) -> None:
        """The loop's parts over the engine: the rollout and its source, the objective, micro-batches and update, the
        callbacks' control, health alarms, the loop's state and the checkpoint that saves it."""
        cfg = self.cfg
        packing, why = self.backend.packing(self.policy, cfg.use_remove_padding)
        self.rollouts = Rollouts(cfg, self.generator, self.policy, self.tokenizer, self.train_set, self.sampler,
                                 self.rewards, self.step_rewards, self.procs, self.B, self.G, self.params,
                                 self.agents and make_rollout(self.agents, self))  # (multi-turn, or None)
        self.source = make_source(cfg, self.rollouts, self.policy, self.accel.device, self.layout.rollout_steps,
                                  self.total_steps, self.accel.distributed_type,
                                  self._reference_logprobs)  # (grpo.training.rollout.pipeline)
        self.objective = Objective(cfg, self.procs)
        self.micro = MicroBatches(cfg.per_device_train_batch_size, cfg.max_tokens_per_micro_batch, packing, self.procs,
                                  why, split=cfg.sequence_parallel_size)
        self.updates = Update(cfg, self.accel, self.model, self.backend, self.objective, self.procs, self.layout,
                              self.micro)
        self.updates.routing = make_routing(cfg, self.policy, self.generator, packing, self.procs.gather,
                                            self.procs.sp, multi_turn=bool(self.agents))  # (MoE)
        self.control = RunControl(cfg, callbacks, self.layout, self.accel.is_main_process)
        self.rollouts.trainer_state = self.control.state
        self.health = HealthMonitor(accuracy=self.reward_names[0],
                                    format=next((n for n in self.reward_names if "format" in n), None))
        self.loop = LoopState()  # the step, counters, the rollout still feeding steps (grpo.training.run.loop_state)
        self.run_files = RunFiles(cfg, self.rewards, getattr(self.policy, "name_or_path", None), self.prefill,
                                  self.task is not None, self.layout)
        self.checkpoints = Checkpointing(
            cfg, self.accel, self.procs, self.model, self.policy, self.optimizer, self.tokenizer, self.sharded,
            self.loop, parts={"scheduler": self.scheduler, "sampler": self.sampler, "objective": self.objective,
                              **({"reference": self.reference} if cfg.sync_ref_model else {})},
            own_parts={"pipeline": self.source,
                       **({"experts": self.experts.optimizer_part(self.optimizer)} if self.experts else {})},
            rollout_steps=self.layout.rollout_steps, replan=self.updates.plan,
            control=self.control, write_run_files=self.run_files.write)
        self._summary = TrainingSummary()

    @property
    def step(self) -> int:
        """Optimizer steps taken (TRL: state.global_step)."""
        return self.loop.step

    @step.setter
    def step(self, value: int) -> None:
        self.loop.step = value

    # ---- the loop ----------------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: Any = None) -> TrainResult:
        from grpo.training.observe.display import LiveDisplay, NullDisplay
        from grpo.training.observe.metric_names import dashboard_names
        from grpo.training.observe.tracking import NullLogger, RunLogger

        cfg, out, main = self.cfg, Path(self.cfg.output_dir), self.accel.is_main_process
        if run_dir.prepare(cfg, self.procs, self.loop, resume_from_checkpoint, self.total_steps,
                           lambda: (self.run_files.resolved(), self.layout.to_dict()), self._resume, self._restore):
            return TrainResult({}, global_step=self.step)  # (a resume of a finished run: nothing to do)
        try:
            if main:
                self.run_files.write(out)
                print("\n".join(self._start_lines()))
            shown = lambda logs: dashboard_names(logs, cfg.metric_names, self.reward_names)  # noqa: E731 - TRL's keys
            logger = RunLogger(out, cfg.report_to, cfg.to_dict(), run_name=cfg.run_name, resume_step=self.step,
                               options=cfg, sink_names=shown) if main else NullLogger()
        except BaseException:
            run_dir.release(out, main)  # (a full disk, a tracker that fails to start: the directory is left free)
            raise
        display = LiveDisplay(self.total_steps) if main and not cfg.disable_tqdm else NullDisplay()
        last: dict[str, float] = {}
        started = time.perf_counter()
        self._summary.start(self.step)
        report = StepLog(logger, display, self.control, self._summary, cfg.metric_names, self.reward_names)
        self.backend.prepare()  # (again, when train() is called a second time)
        self.control.event("on_train_begin")
        # Installed until train() returns: a signal after the last step lets the run finish (it is then complete).
        signals = StopSignals(cfg.stop_signals, self.procs).install()
        try:
            try:
                self.source.start()  # (a rollout worker with max_staleness > 0: forked from the model as it now is)
                if self.step == 0 and self.control.cadence.evaluate_first(self.eval_set is not None):
                    report(0, self.evaluate(loss=False))
                while self.step < self.total_steps and not self.control.control.should_training_stop:
                    try:
                        with engine_faults(cfg, "update"):
                            last = self._step_and_report(report)
                    except ServersDown as err:  # (every vLLM server gone: a checkpoint, then exit 75 as on a signal)
                        raise stopped_with_checkpoint(str(err), cfg, self.accel, self.step, self.total_steps,
                                                      self.save_checkpoint) from None
                    # a stop signal: this step's checkpoint, then TrainingInterrupted
                    stop_if_signalled(signals, cfg, self.accel, self.step, self.total_steps, self.save_checkpoint)
            finally:
                display.close()
                logger.close()
                self.source.close()
                self.backend.release()  # the model goes back as it was loaded
            self._write_model(out / "final", self.cfg.merge_lora_on_save, "adapter")  # (merged, adapter/ too)
            run_dir.finished(out, self.step, main)
            if main:
                finish_run(out)
                print("\n".join(end_lines(self.step, last, time.perf_counter() - started,
                                           [*self.rewards.failure_summary(), *self.health.summary()],
                                           cfg.output_dir, vision=self.images is not None)))
            summary = self._summary.metrics(self.step, self.layout.step_completions, self.reward_names,
                                            getattr(self.control.state, "total_flos", 0.0))
            self.control.logged(self.step, summary)  # (transformers' last log_history entry)
            self.control.event("on_train_end")
            if self.hub is not None:
                self.hub.finished(out / "final", self.step)
        finally:
            signals.restore()
            run_dir.release(out, main)
        return TrainResult(last, global_step=self.step, summary=summary)

    def _step_and_report(self, report: StepLog) -> dict[str, float]:
        """One optimizer step, its health alarms, then what the cadence and the callbacks ask for."""
        self.control.event("on_step_begin")
        metrics = self.train_step()
        self.loop.step += 1
        self.source.stepped(self.step)  # (with a lag, the worker may start the next rollout now)
        health, alarms = self.health.check(metrics)
        metrics.update(health)
        self._summary.add(metrics)
        for name, message in alarms:
            report.display.alarm(name, message)
        self.control.after_step(self.step, metrics, report, has_eval=self.eval_set is not None,  # eval, log, samples,
                                evaluate=lambda: self.evaluate(loss=False),  # checkpoint, as flagged
                                samples=self.loop.last_samples, save=self._checkpoint_and_upload)
        return metrics

    def train_step(self) -> dict[str, float]:
        """One optimizer step, with a rollout first when the last one has fed all its steps."""
        t0 = time.perf_counter()
        reset_peak_memory(self.accel.device)  # (memory/peak_gib: this step's, rollout and update)
        loop = self.loop
        fresh = loop.pending is None or not loop.pending[1]
        if fresh:
            batch = self.rollout()
            loop.pending = (batch, list(batch.plans))
        batch, plans = loop.pending
        t1 = time.perf_counter()
        metrics = self._optimize(batch, [plans.pop(0)])
        if fresh:
            metrics.update(batch.metrics)
            loop.num_tokens += batch.metrics.get("completion/tokens", 0.0)
            loop.last_samples = batch.samples
        metrics.update({"train/num_tokens": loop.num_tokens,
                        "train/epoch": epochs_done(self.train_set, self.step + 1, self.layout.steps_per_epoch),
                        "time/update": time.perf_counter() - t1, "time/step": time.perf_counter() - t0,
                        **peak_memory_metrics(self.accel.device)})
        return metrics

    # ---- rollout: generate, score, advantages; old and reference log-probs -------------------------------------
    def rollout(self) -> RolloutBatch:
        with self.accel.autocast():
            batch = self.source.next(self.loop.rollout_count)
        self.loop.rollout_count += 1
        t0 = time.perf_counter()
        batch.plans = self.updates.plan(batch)  # its optimizer steps and their micro-batches
        self._score_logprobs(batch)
        batch.metrics.update({f"time/{k}": v for k, v in self.rollouts.times.items()})
        batch.metrics["time/logprobs"] = time.perf_counter() - t0
        return batch

    @torch.no_grad()
    def _score_logprobs(self, batch: RolloutBatch) -> None:
        """The reference's log-probs (beta > 0); the sampling policy's when the rollout feeds several optimizer steps
        per pass (with one, they come from the first pass, before any step)."""
        if self.layout.steps_per_rollout > 1:
            batch.old_logp = self.updates.score(self.policy, batch)
        if needs_reference(self.cfg) and batch.ref_logp is None:  # (a rollout worker may have scored them already)
            batch.ref_logp = self._reference_logprobs(batch)

    @torch.no_grad()
    def _reference_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        with reference_view(self.policy, self.reference) as ref:
            return self.updates.score(ref, batch)

    # ---- update: optimizer steps over a rollout's rows, in micro-batches (grpo.training.update.mechanics) -----------------
    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """Every optimizer step the rollout feeds; their metrics merged (the gradient norm is the last step's)."""
        return self._optimize(batch, batch.plans or self.updates.plan(batch))

    def _optimize(self, batch: RolloutBatch, plans: list[StepPlan]) -> dict[str, float]:
        out = self.updates.run(batch, plans, self.optimizer, self.scheduler, self._optimizer_step)
        out["health/nonfinite_steps"] = float(self.loop.nonfinite_total)
        return out

    def _optimizer_step(self, batch: RolloutBatch) -> float:
        self.control.event("on_pre_optimizer_step")
        grad_norm, finite = clip_gradients(self.accel, self.model, self.cfg.max_grad_norm, self.experts)
        if not finite:
            self._skip_nonfinite_step(batch, grad_norm)
            return grad_norm
        self.loop.nonfinite_in_a_row = 0
        apply_step(self.optimizer, self.scheduler)
        self.backend.after_optimizer_step(stepped=True)
        self.rollouts.engine_stale = True
        self.control.event("on_optimizer_step")
        if self.cfg.sync_ref_model and (self.step + 1) % self.cfg.ref_model_sync_steps == 0:
            sync_reference_(self.reference.state_dict(), self.policy.state_dict(), self.cfg.ref_model_mixup_alpha)
        return grad_norm

    def _skip_nonfinite_step(self, batch: RolloutBatch, grad_norm: float) -> None:
        # Skip: AdamW would write NaN into every weight (measured in TRL 1.16, reliability.md 3.2).
        if self.accel.scaler is not None:  # its step skips the update too, and lowers the loss scale
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.backend.after_optimizer_step(stepped=False)
        self.loop.nonfinite_total += 1
        self.loop.nonfinite_in_a_row += 1
        report_nonfinite(self.cfg, self.loop, self.rank, batch, grad_norm, self.accel.distributed_type == "DEEPSPEED",
                         TrainingStopped)

    # ---- eval, save, resume ---------------------------------------------------------------------------------
    def _score_eval_set(self, prompt_set) -> dict[str, float]:
        """Sample and score one eval set (evaluate(), grpo.training.trl_surface, names and prefixes the metrics)."""
        from grpo.training.evaluation.held_out import evaluate_prompts

        params = SamplingParams(self.cfg.max_completion_length, self.cfg.eval_temperature)
        self.rollouts.ready_engine()
        with self.accel.autocast():
            result = evaluate_prompts(self.generator, self.tokenizer, prompt_set, self.rewards, self.reward_names,
                                      params, seed=self.cfg.seed + 12345, k=self.cfg.eval_num_samples,
                                      batch_size=self.cfg.per_device_eval_batch_size, agent=self.rollouts.agent)
        self.generator.sleep()  # (vLLM's sleep mode: the next update gets its memory, as after a rollout)
        return {k: v for k, v in result.items() if isinstance(v, (int, float))}

    def state_dict(self) -> dict[str, Any]:
        return self.checkpoints.state()

    def save_checkpoint(self) -> Path | None:
        return self.checkpoints.save()  # (collective: every process calls it)

    def _checkpoint_and_upload(self) -> None:
        path = self.save_checkpoint()
        if self.hub is not None and path is not None:
            self.hub.saved(path, self.step)

    def _restore(self, path: Path) -> None:
        self.checkpoints.restore(path)
        self.rollouts.engine_stale = True  # (the engine holds the weights it was loaded with)

    def _resume(self, path: Path, changed: set[str]) -> None:
        self._restore(path)
        run_dir.apply_changes(self.cfg, self.optimizer, self.scheduler, changed)  # (the config's rate, schedule)
        print(f"resume: continuing from {path} (step {self.step}).")

    def _start_lines(self) -> list[str]:
        return start_lines(self.cfg, self.policy, has_task=self.task is not None, train_set=self.train_set,
                           eval_set=self.eval_set, rewards=self.rewards, reward_names=self.reward_names,
                           accel=self.accel, procs=self.procs, agents=self.agents, engine=self.engine,
                           passes=self.micro.describe(), rollouts=self.source.layout, step=self.step,
                           total_steps=self.total_steps, layout=self.layout)

    def save_model(self, output_dir: str | Path | None = None, _internal_call: bool = False) -> None:
        """TRL's (transformers'): the model where `from_pretrained` loads it (default: output_dir), its tokenizer
        or processor beside; with LoRA the adapter there, as TRL saves it (`PeftModel.from_pretrained(base,
        output_dir)`). The merged model is final/, which train() writes (merge_lora_on_save). Collective."""
        self._write_model(output_dir or self.cfg.output_dir, merge=False, adapter_dir="")

    def _write_model(self, path: str | Path, merge: bool, adapter_dir: str) -> None:
        self.accel.wait_for_everyone()
        if self.sharded:  # gathered on the main process
            sharded_ckpt.save_final(self.accel, self.policy, self.images or self.tokenizer, path, merge, adapter_dir)
            return
        with whole_experts(self.policy, main_only=True):  # (expert parallelism: every expert, on the main process)
            if self.accel.is_main_process:
                save_final(self.policy, self.images or self.tokenizer, path, merge=merge, adapter_dir=adapter_dir)
