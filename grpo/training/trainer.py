"""`GRPOTrainer`: the GRPO loop, readable top to bottom.

    for each step:
        prompts      <- the next B prompts (same on every process)
        completions  <- G samples per prompt from the rollout engine (this process's share of the B*G rows)
        rewards      <- every reward function, weighted and summed; gathered so group statistics see all G
        advantages   <- (r - group mean) / group std   [+ process-supervision advantages from step rewards]
        old/ref      <- log-probs of the sampling policy (when num_iterations > 1) and of the reference (beta > 0)
        update       <- num_iterations AdamW steps on the clipped surrogate + beta * KL, in micro-batches
        log, eval, checkpoint

A step is one rollout batch. Checkpoints are written between steps, so resume never needs a half-used rollout.
The math lives in `grpo.core`, generation and the passes through the model in an engine (`grpo.engines`), the
rollout's bookkeeping in `grpo.training.rollout`; this file moves tensors between them.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any

import torch

from grpo.config import GRPOConfig
from grpo.core import engine_importance_weights, policy_loss
from grpo.engines.base import SamplingParams
from grpo.engines.policy import reference_view
from grpo.engines.select import choose_engine, make_engine, make_vllm
from grpo.training import checkpoint as ckpt
from grpo.training.data import PromptSampler, build_prompt_set
from grpo.training.health import HealthMonitor, nonfinite_messages
from grpo.training.micro_batches import MicroBatches, Plan
from grpo.training.model import (load_model, load_tokenizer, load_trainable_state, prepare_model, save_final,
                                 trainable_state)
from grpo.training.rollout import Processes, RolloutBatch, Rollouts
from grpo.training.setup import (batch_layout, check_accelerator, check_reward_columns, check_sizes,
                                 fill_deepspeed_auto, load_task, make_datasets, make_optimizer, make_reward_runner,
                                 make_schedule, make_step_rewards, seed_everything, total_steps)
from grpo.training.summary import end_lines, finish_run, start_lines
from grpo.training.tracking import accumulate, extreme

# grpo.core metric -> logged name (the seed tutorial's names where it has one).
LOSS_METRIC_NAMES = {"policy_loss": "policy/loss", "kl": "policy/kl_divergence"}


class TrainingStopped(RuntimeError):
    """The run stopped itself (e.g. repeated non-finite losses); the last good checkpoint is intact."""


class GRPOTrainer:
    """Train a causal LM with GRPO.

    model: a path / hub name, or a loaded `transformers` model (then `processing_class` is its tokenizer).
    reward_funcs: one reward spec or callable (TRL signature), or a list; default: the config's, else the task's.
    train_dataset / eval_dataset: `datasets.Dataset`; default: the config's dataset or built-in task.
    peft_config: a `peft.LoraConfig` (or set `use_peft` in the config).
    generator: a rollout engine (`grpo.engines.base.RolloutEngine`); default: the chosen engine's sampler.
    """

    def __init__(self, model: Any = None, reward_funcs: Any = None, args: GRPOConfig | None = None,
                 train_dataset=None, eval_dataset=None, peft_config=None, processing_class=None,
                 generator=None, step_reward_funcs: list | None = None):
        from accelerate import Accelerator

        self.cfg = cfg = args or GRPOConfig()
        self.accel = Accelerator(cpu=not torch.cuda.is_available())
        check_accelerator(self.accel)
        self.procs = Processes(self.accel)
        self.world, self.rank = self.procs.world, self.procs.rank
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        seed_everything(cfg.seed)
        self.task = load_task(cfg) if train_dataset is None and cfg.dataset_name is None else None
        self.prefill = cfg.prefill if cfg.prefill is not None else (self.task.prefill if self.task else "")
        self.rewards, self.reward_names = make_reward_runner(cfg, reward_funcs, self.task)
        self.step_rewards = make_step_rewards(cfg, step_reward_funcs)
        train_dataset, eval_dataset = make_datasets(cfg, self.task, train_dataset, eval_dataset)
        check_reward_columns(self.rewards, list(train_dataset.column_names))  # before any model load
        self.B, self.G = batch_layout(cfg, self.world)

        from_path = model is None or isinstance(model, (str, Path))
        if from_path and model is not None:
            cfg.model_name_or_path = str(model)
        self.tokenizer = processing_class or load_tokenizer(cfg.model_name_or_path if from_path else model.name_or_path)
        # Tokenize and check the data before the weights load: a bad row or length fails in seconds.
        self.train_set = build_prompt_set(train_dataset, self.tokenizer, cfg, self.prefill, "dataset_name")
        self.eval_set = (build_prompt_set(eval_dataset, self.tokenizer, cfg, self.prefill, "eval_dataset_name")
                         if eval_dataset is not None else None)
        check_sizes(cfg, len(self.train_set), self.B, self.train_set.prompt_ids, None if from_path else model.config)
        if from_path:
            model = load_model(cfg)
        self.engine = choose_engine(cfg.engine, model, self.accel.device, self.world, self.accel.distributed_type)
        on_disk = cfg.reference_weights == "disk" or (cfg.reference_weights == "auto" and self.engine.name == "cpu")
        model, self.reference = prepare_model(model, cfg, peft_config, Path(cfg.output_dir) if on_disk else None,
                                              reference_prefix=f".reference-rank{self.rank}-")
        self.total_steps = total_steps(cfg, len(self.train_set), self.B)
        self.optimizer = make_optimizer(model, cfg)
        # The schedule counts optimizer updates: num_iterations of them per step.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, make_schedule(cfg, self.total_steps * cfg.num_iterations))
        fill_deepspeed_auto(self.accel, cfg)
        self.model, self.optimizer = self.accel.prepare(model, self.optimizer)
        if self.reference is not None:
            self.reference.to(self.accel.device)
        self.policy = self.accel.unwrap_model(self.model)
        self.params = SamplingParams(cfg.max_completion_length, cfg.temperature, cfg.top_p, cfg.top_k, cfg.min_p,
                                     cfg.repetition_penalty)
        if generator is None and cfg.use_vllm:
            generator = make_vllm(cfg, self.policy, self.tokenizer, self.accel)
        self.generator, self.backend = make_engine(self.engine, self.model, self.policy, self.accel, self.tokenizer,
                                                   self.params, self.reference, generator)
        packing, why = self.backend.packing(self.policy, cfg.use_remove_padding)
        self.micro = MicroBatches(cfg.per_device_train_batch_size, cfg.max_tokens_per_micro_batch, packing, self.procs,
                                  why)
        self.sampler = PromptSampler(len(self.train_set), cfg.seed)
        self.rollouts = Rollouts(cfg, self.generator, self.policy, self.tokenizer, self.train_set, self.sampler,
                                 self.rewards, self.step_rewards, self.procs, self.B, self.G, self.params)
        self.health = HealthMonitor(accuracy=self.reward_names[0],
                                    format=next((n for n in self.reward_names if "format" in n), None))
        self.step = 0
        self.nonfinite_in_a_row = 0
        self.nonfinite_total = 0

    # ---- the loop ----------------------------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        from grpo.training.display import LiveDisplay, NullDisplay
        from grpo.training.tracking import NullLogger, RunLogger

        cfg, out = self.cfg, Path(self.cfg.output_dir)
        main = self.accel.is_main_process
        if cfg.resume:
            self._resume()
        if main:
            out.mkdir(parents=True, exist_ok=True)
            cfg.save(out / "config.yaml")
            print("\n".join(start_lines(self)))
        report = [r for r in cfg.report_to if r != "none"]
        logger = RunLogger(out, report, cfg.to_dict(), resume_step=self.step) if main else NullLogger()
        display = LiveDisplay(self.total_steps) if main else NullDisplay()
        last: dict[str, float] = {}
        started = time.perf_counter()
        self.backend.prepare()  # (again, when train() is called a second time)
        try:
            if self.step == 0 and self.eval_set is not None and cfg.eval_steps > 0:
                logger.log(0, self.evaluate())
            while self.step < self.total_steps:
                metrics = self.train_step()
                self.step += 1
                health, alarms = self.health.check(metrics)
                metrics.update(health)
                for name, message in alarms:
                    display.alarm(name, message)
                if self.eval_set is not None and (
                        (cfg.eval_steps and self.step % cfg.eval_steps == 0) or self.step == self.total_steps):
                    metrics.update(self.evaluate())
                if self.step % cfg.logging_steps == 0 or self.step == self.total_steps or "eval/accuracy" in metrics:
                    logger.log(self.step, metrics)
                    display.update(self.step, metrics)
                if cfg.log_completions_steps and self.step % cfg.log_completions_steps == 0:
                    logger.log_samples(self.step, self._last_samples)
                if cfg.save_steps and self.step % cfg.save_steps == 0 and self.step < self.total_steps:
                    self.save_checkpoint()
                last = metrics
        finally:
            display.close()
            logger.close()
            self.backend.release()  # the model goes back as it was loaded
        self.save_model(out / "final")
        if main:
            finish_run(out)
            print("\n".join(end_lines(self, last, time.perf_counter() - started)))
        return last

    def train_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        batch = self.rollout()
        t1 = time.perf_counter()
        metrics = self.update(batch)
        metrics.update(batch.metrics)
        metrics["time/update"] = time.perf_counter() - t1
        metrics["time/step"] = time.perf_counter() - t0
        self._last_samples = batch.samples
        return metrics

    # ---- rollout: generate, score, advantages; old and reference log-probs -------------------------------------
    def rollout(self) -> RolloutBatch:
        batch = self.rollouts.make(self.step)
        t0 = time.perf_counter()
        batch.plans = self.micro.plan(batch)
        self._score_logprobs(batch)
        batch.metrics.update({f"time/{k}": v for k, v in self.rollouts.times.items()})
        batch.metrics["time/logprobs"] = time.perf_counter() - t0
        return batch

    @torch.no_grad()
    def _score_logprobs(self, batch: RolloutBatch) -> None:
        """The reference's log-probs (beta > 0). The sampling policy's come from the first update pass."""
        if self.cfg.beta <= 0:
            return
        batch.ref_logp = torch.zeros(batch.completion_mask.shape, device=self.accel.device)
        with reference_view(self.policy, self.reference) as ref:
            for plan in batch.plans or self.micro.plan(batch):
                micro = plan.inputs(batch, self.accel.device)
                batch.ref_logp[plan.rows, :plan.width] = self.backend.logprobs(
                    ref, micro.input_ids, micro.attention_mask, plan.width, self.cfg.temperature, micro.packed)

    # ---- update: num_iterations optimizer steps over the rollout ------------------------------------------------
    def update(self, batch: RolloutBatch) -> dict[str, float]:
        cfg = self.cfg
        plans = batch.plans = batch.plans or self.micro.plan(batch)
        # Normalizers over the whole step on all processes make micro-batching and multi-process exact.
        if cfg.loss_aggregation == "token_mean":
            normalizer = float(self.procs.gather(batch.completion_mask.sum().reshape(1)).sum())
        else:
            normalizer = float(batch.input_ids.shape[0] * self.world)
        sums: dict[str, torch.Tensor] = {}  # metric sums weighted by tokens, kept on the device until the end
        weights: dict[str, torch.Tensor] = {}  # each metric's own tokens (entropy is taken in the first pass only)
        for it in range(cfg.num_iterations):
            old_parts = []  # the first pass's log-probs: no optimizer step yet, so the sampling policy's
            self.optimizer.zero_grad(set_to_none=True)
            for k, plan in enumerate(plans):
                sync = k == len(plans) - 1
                if self.accel.distributed_type == "DEEPSPEED":  # its engine steps in backward unless told that
                    self.accel.gradient_state._set_sync_gradients(sync)  # more micro-batches follow
                with self.accel.no_sync(self.model) if not sync else contextlib.nullcontext():
                    logp, out, weight = self._micro_step(batch, plan, normalizer, with_entropy=it == 0)
                old_parts.append((plan.rows, plan.width, logp))
                for key, value in out.metrics.items():
                    sums[key] = accumulate(key, sums.get(key), value.detach().double(), weight)
                    weights[key] = weights.get(key, 0.0) + weight
            if it == 0 and cfg.num_iterations > 1:
                batch.old_logp = torch.zeros(batch.completion_mask.shape, device=self.accel.device)
                for rows, width, old in old_parts:
                    batch.old_logp[rows, :width] = old
            grad_norm = self._optimizer_step(batch)
        names = [k for k in sums if not k.startswith("advantage")]  # advantages are logged once per rollout
        means = [sums[k] if extreme(k) else sums[k] / weights[k].clamp(min=1e-9) for k in names]
        values = torch.stack(means).tolist() if names else []
        out = {LOSS_METRIC_NAMES.get(k, k if "/" in k else f"policy/{k}"): v for k, v in zip(names, values)}
        out["train/grad_norm"] = grad_norm
        out["train/learning_rate"] = self.scheduler.get_last_lr()[0]
        out["health/nonfinite_steps"] = float(self.nonfinite_total)
        return out

    def _micro_step(self, batch: RolloutBatch, plan: Plan, normalizer: float, with_entropy: bool):
        """One micro-batch's loss, backpropagated by the engine. Returns (log-probs, LossOutput, token count)."""
        cfg, device = self.cfg, self.accel.device
        micro = plan.inputs(batch, device)
        mask, ref, adv = (plan.take(t, device) for t in (batch.completion_mask, batch.ref_logp, batch.advantages))
        correct = cfg.use_vllm and cfg.vllm_importance_sampling_correction and micro.sampling_logp is not None

        def loss_fn(logp, sub=slice(None), entropy=None):
            # First pass over this rollout (no old log-probs yet): no optimizer step has happened, so the policy's
            # own log-probs are the sampling policy's.
            old = logp.detach() if micro.old_logp is None else micro.old_logp[sub]
            weights, engine_metrics = None, {}
            if correct:  # vLLM sampled from its own copy: weigh each token by pi_old / pi_vllm
                weights, engine_metrics = engine_importance_weights(
                    old, micro.sampling_logp[sub], mask[sub], mode=cfg.vllm_importance_sampling_mode,
                    clip_max=cfg.vllm_importance_sampling_clip_max, clip_min=cfg.vllm_importance_sampling_clip_min)
            out = policy_loss(logp, old, adv[sub], mask[sub], ref_logp=None if ref is None else ref[sub],
                              beta=cfg.beta, kl_estimator=cfg.kl_estimator, eps_low=cfg.epsilon,
                              eps_high=cfg.epsilon_high, ratio_level=cfg.importance_sampling_level,
                              aggregation=cfg.loss_aggregation, max_length=cfg.max_completion_length,
                              normalizer=normalizer, entropy=entropy, sampling_weights=weights)
            out.metrics.update({f"sampling/importance_{k}": v for k, v in engine_metrics.items()})
            return out

        logp, out = self.backend.loss_and_backward(micro, cfg.temperature, loss_fn, with_entropy)
        return logp, out, mask.sum().double()

    def _optimizer_step(self, batch: RolloutBatch) -> float:
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else float("inf")
        # accelerate's: a float16 loss scaler's gradients unscaled first; under DeepSpeed the norm its engine took
        # when it stepped, in the last micro-batch's backward, clipping by its config's gradient_clipping
        norm = self.accel.clip_grad_norm_(params, max_norm)
        grad_norm = float("nan") if norm is None else float(norm)  # (None: a DeepSpeed engine that kept no norm)
        if norm is not None and not math.isfinite(grad_norm):
            self._skip_nonfinite_step(batch, grad_norm)
            return grad_norm
        self.nonfinite_in_a_row = 0
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)  # no gradient buffers held through the next rollout
        self.backend.after_optimizer_step(stepped=True)
        self.rollouts.engine_stale = True
        return grad_norm

    def _skip_nonfinite_step(self, batch: RolloutBatch, grad_norm: float) -> None:
        # Skip: AdamW would write NaN into every weight (measured in TRL 1.16, reliability.md 3.2).
        if self.accel.scaler is not None:  # its step skips the update too, and lowers the loss scale
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.backend.after_optimizer_step(stepped=False)
        self.nonfinite_total += 1
        self.nonfinite_in_a_row += 1
        saved = ckpt.save_nonfinite_inputs(self.cfg.output_dir, self.step + 1, self.rank, batch)
        warning, stop = nonfinite_messages(self.step + 1, grad_norm, saved, self.nonfinite_in_a_row,
                                           self.cfg.max_nonfinite_steps, self.accel.distributed_type == "DEEPSPEED")
        print(warning)
        if stop:
            raise TrainingStopped(stop)

    # ---- eval, save, resume ---------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        from grpo.evaluate import evaluate_prompts

        params = SamplingParams(self.cfg.max_completion_length, self.cfg.eval_temperature)
        self.rollouts.ready_engine()
        result = evaluate_prompts(self.generator, self.tokenizer, self.eval_set, self.rewards, self.reward_names,
                                  params, seed=self.cfg.seed + 12345, k=self.cfg.eval_num_samples)
        return {f"eval/{k}": v for k, v in result.items() if isinstance(v, (int, float))}

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "sampler": self.sampler.state_dict(), "rng": ckpt.rng_state(),
                "nonfinite_total": self.nonfinite_total}

    def save_checkpoint(self) -> Path | None:
        if not self.accel.is_main_process:
            return None
        return ckpt.save_checkpoint(self.cfg.output_dir, self.step, trainable_state(self.policy), self.state_dict(),
                                    self.cfg.save_total_limit)

    def _resume(self) -> None:
        path = ckpt.latest_checkpoint(self.cfg.output_dir)
        if path is None:
            print(f"resume: no complete checkpoint in {self.cfg.output_dir}; starting from step 0.")
            return
        weights, state = ckpt.load_checkpoint(path)
        load_trainable_state(self.policy, weights)
        self.rollouts.engine_stale = True
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        ckpt.set_rng_state(state["rng"])
        self.step, self.nonfinite_total = state["step"], state["nonfinite_total"]
        print(f"resume: continuing from {path} (step {self.step}).")

    def save_model(self, path: str | Path) -> None:
        self.accel.wait_for_everyone()
        if self.accel.is_main_process:
            save_final(self.policy, self.tokenizer, path, merge=self.cfg.merge_lora_on_save)
