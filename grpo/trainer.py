"""`GRPOTrainer`: the GRPO loop, readable top to bottom.

    for each step:
        prompts      <- the next B prompts (same on every process)
        completions  <- G samples per prompt from the policy (this process's share of the B*G rows)
        rewards      <- every reward function, weighted and summed; gathered so group statistics see all G
        advantages   <- (r - group mean) / group std   [+ process-supervision advantages from step rewards]
        old/ref      <- log-probs of the sampling policy (when num_iterations > 1) and of the reference (beta > 0)
        update       <- num_iterations AdamW steps on the clipped surrogate + beta * KL, in micro-batches
        log, eval, checkpoint

A step is one rollout batch. Checkpoints are written between steps, so resume never needs a half-used rollout.
The math lives in `grpo.core`; this file only moves tensors between it, the model and the rewards.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grpo import checkpoint as ckpt
from grpo import native
from grpo.config import ConfigError, GRPOConfig
from grpo.core import group_advantages, mix_advantages, policy_loss, process_advantages
from grpo.data import PromptSampler, build_prompt_set
from grpo.fused import fuse_decoder_ops
from grpo.health import HealthMonitor
from grpo.generation import SamplingParams, TransformersGenerator, row_seed
from grpo.model import (completion_logprobs, completion_loss, dropout_active, load_model, load_tokenizer,
                        load_trainable_state, plain_head, prepare_model, reference_view, save_final,
                        sparse_tied_embedding_grad, trainable_state)
from grpo.rollout import RolloutBatch, Sampled, as_completion, char_to_token_ends, group_stats, pack, strip_eos
from grpo.setup import (batch_layout, check_sizes, make_datasets, make_optimizer, make_reward_runner, make_schedule,
                        make_step_rewards, seed_everything, total_steps, load_task)


# grpo.core metric -> logged name (the seed tutorial's names where it has one).
LOSS_METRIC_NAMES = {"policy_loss": "policy/loss", "kl": "policy/kl_divergence"}


class TrainingStopped(RuntimeError):
    """The run stopped itself (e.g. repeated non-finite losses); the last good checkpoint is intact."""


class GRPOTrainer:
    """Train a causal LM with GRPO.

    model: a path / hub name, or a loaded `transformers` model (then `processing_class` is its tokenizer).
    reward_funcs: reward specs or callables (TRL signature); default: the config's, else the built-in task's.
    train_dataset / eval_dataset: `datasets.Dataset`; default: the config's dataset or built-in task.
    peft_config: a `peft.LoraConfig` (or set `use_peft` in the config).
    generator: a rollout backend (`grpo.generation.Generator`); default: sample with the policy.
    """

    def __init__(self, model: Any = None, reward_funcs: list | None = None, args: GRPOConfig | None = None,
                 train_dataset=None, eval_dataset=None, peft_config=None, processing_class=None,
                 generator=None, step_reward_funcs: list | None = None):
        from accelerate import Accelerator

        self.cfg = cfg = args or GRPOConfig()
        self.accel = Accelerator(cpu=not torch.cuda.is_available())
        self.deepspeed = self.accel.distributed_type == "DEEPSPEED"
        if self.deepspeed and self.accel.state.deepspeed_plugin.zero_stage == 3:
            # ZeRO-3 shards every weight (transformers loads them sharded); sampling, the reference and saving here
            # read whole weights. Measured: sampling read the sharded head and the reference's embedding.
            raise ConfigError("DeepSpeed ZeRO-3 is not supported (sampling, the reference model and saving read "
                              "whole weights): use ZeRO-2 (recipes/accelerate/zero2.yaml), which shards the "
                              "optimizer state and gradients, or DDP (recipes/accelerate/ddp.yaml).")
        self.world, self.rank = self.accel.num_processes, self.accel.process_index
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        seed_everything(cfg.seed)
        self.task = load_task(cfg) if train_dataset is None and cfg.dataset_name is None else None
        self.prefill = cfg.prefill if cfg.prefill is not None else (self.task.prefill if self.task else "")
        self.rewards, self.reward_names = make_reward_runner(cfg, reward_funcs, self.task)
        self.step_rewards = make_step_rewards(cfg, step_reward_funcs)
        train_dataset, eval_dataset = make_datasets(cfg, self.task, train_dataset, eval_dataset)
        self._check_reward_columns(list(train_dataset.column_names))  # before any model load
        self.B, self.G = batch_layout(cfg, self.world)

        from_path = model is None or isinstance(model, (str, Path))
        if from_path and model is not None:
            cfg.model_name_or_path = str(model)
        self.tokenizer = processing_class or load_tokenizer(cfg.model_name_or_path if from_path else model.name_or_path)
        self.eos_ids = {self.tokenizer.eos_token_id}
        # Tokenize and check the data before the weights load: a bad row or length fails in seconds.
        self.train_set = build_prompt_set(train_dataset, self.tokenizer, cfg, self.prefill, "dataset_name")
        self.eval_set = (build_prompt_set(eval_dataset, self.tokenizer, cfg, self.prefill, "eval_dataset_name")
                         if eval_dataset is not None else None)
        check_sizes(cfg, len(self.train_set), self.B, self.train_set.prompt_ids, None if from_path else model.config)
        if from_path:
            model = load_model(cfg)
        on_disk = cfg.reference_weights == "disk" or (cfg.reference_weights == "auto" and self.world == 1
                                                       and self.accel.device.type == "cpu")
        model, self.reference = prepare_model(model, cfg, peft_config, Path(cfg.output_dir) if on_disk else None,
                                              reference_prefix=f".reference-rank{self.rank}-")
        self.total_steps = total_steps(cfg, len(self.train_set), self.B)

        self.optimizer = make_optimizer(model, cfg)
        # The schedule counts optimizer updates: num_iterations of them per step.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, make_schedule(cfg, self.total_steps * cfg.num_iterations))
        if self.deepspeed:  # "auto" values accelerate would read from a prepared dataloader (this loop has none)
            ds_config = self.accel.state.deepspeed_plugin.deepspeed_config
            for key, value in (("train_micro_batch_size_per_gpu", cfg.per_device_train_batch_size),
                               ("gradient_clipping", cfg.max_grad_norm if cfg.max_grad_norm > 0 else 0.0)):
                if ds_config.get(key) in (None, "auto"):
                    ds_config[key] = value
        self.model, self.optimizer = self.accel.prepare(model, self.optimizer)
        if self.reference is not None:
            self.reference.to(self.accel.device)
        self.policy = self.accel.unwrap_model(self.model)
        self.sparse_embedding = False
        if self.model is self.policy:  # one process, not wrapped by DDP, FSDP or DeepSpeed
            self.sparse_embedding = sparse_tied_embedding_grad(self.policy)
            if self.accel.device.type == "cpu":  # the MLP activations and RMSNorms as compiled passes (grpo/fused.py)
                fuse_decoder_ops(self.policy)
                native.keep_freed_memory()  # activations reused without page faults, micro-batch after micro-batch
                if self.reference is not None:
                    fuse_decoder_ops(getattr(self.reference, "module", self.reference))  # (a DiskReference's module)
        # hidden_loss adds the head's weight gradient during forward, so backward must not rescale the loss.
        self.fused_loss = (self.model is self.policy and self.accel.scaler is None
                           and self.accel.gradient_accumulation_steps == 1)
        self.generator = generator or TransformersGenerator(self.policy, self.tokenizer.pad_token_id,
                                                            list(self.eos_ids))
        self.sampler = PromptSampler(len(self.train_set), cfg.seed)
        self.params = SamplingParams(cfg.max_completion_length, cfg.temperature, cfg.top_p, cfg.top_k, cfg.min_p,
                                     cfg.repetition_penalty)
        # The sampler's own log-probs are the first update pass's up to float32 rounding when this process sampled
        # from the same weights without filters; the fused loss then applies the LM head 3 times instead of 4 (a
        # frozen head, which needs them only roughly, 2 instead of 3 and no buffer): grpo.core.hidden_loss's
        # logp_estimate. Not where training-mode dropout makes the update's forward differ from sampling's.
        head = plain_head(self.policy)
        self.frozen_head = head is not None and not head.weight.requires_grad
        unfiltered = (cfg.top_k == 0 and cfg.top_p == 1.0 and cfg.min_p == 0.0 and cfg.repetition_penalty == 1.0)
        # (A bfloat16 or float16 trained head rounds its logits too coarsely for the estimates to count as exact.)
        self.sampling_estimates = (self.fused_loss and unfiltered and isinstance(self.generator, TransformersGenerator)
                                   and self.generator.model is self.policy and head is not None
                                   and (self.frozen_head or (not dropout_active(self.policy)
                                                             and head.weight.dtype in (torch.float32, torch.float64))))
        # Sampling's packed copy of a trained head (generation) is the size of the head's gradient (update), and
        # the next rollout starts right after the optimizer step drops that gradient: its memory is handed over
        # (`_head_grad_storage`, `_optimizer_step`), sparing the pack a fresh allocation whose first touch
        # page-faults every 4 KiB (~40-60 ms per rollout for a 151k vocabulary's 155 MB head). It is not kept
        # past the rollout, so the reference pass and the update hold no more memory than without it.
        self.lend_head_grad = False
        if (self.sampling_estimates and not self.frozen_head and head.weight.device.type == "cpu"
                and head.weight.dtype == torch.float32 and torch.get_num_threads() == 1):
            self.lend_head_grad = native.library() is not None  # (the packed copy is the compiled head's)
        self._head_grad_space: torch.Tensor | None = None  # the flat memory under the head's gradient, when lent
        self.health = HealthMonitor(accuracy=self.reward_names[0],
                                    format=next((n for n in self.reward_names if "format" in n), None))
        self.step = 0
        self.nonfinite_in_a_row = 0
        self.nonfinite_total = 0

    def _check_reward_columns(self, columns: list[str]) -> None:
        from grpo.rewards import RewardError

        try:
            self.rewards.check_columns(columns)
        except RewardError as err:
            raise ConfigError(str(err).replace("\n", "; ")) from None

    # ---- the loop ----------------------------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        from grpo.display import LiveDisplay, NullDisplay
        from grpo.tracking import NullLogger, RunLogger

        cfg, out = self.cfg, Path(self.cfg.output_dir)
        main = self.accel.is_main_process
        if cfg.resume:
            self._resume()
        if main:
            out.mkdir(parents=True, exist_ok=True)
            cfg.save(out / "config.yaml")
        report = [r for r in cfg.report_to if r != "none"]
        logger = RunLogger(out, report, cfg.to_dict(), resume_step=self.step) if main else NullLogger()
        display = LiveDisplay(self.total_steps) if main else NullDisplay()
        last: dict[str, float] = {}
        if self.sparse_embedding:  # (again, when train() is called a second time)
            sparse_tied_embedding_grad(self.policy)
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
            if self.sparse_embedding:  # the model goes back as it was loaded
                sparse_tied_embedding_grad(self.policy, sparse=False)
        self.save_model(out / "final")
        if main:
            try:
                from grpo.plot import plot_run

                plot_run(out)
            except Exception as err:  # noqa: BLE001 - a plot must never lose a finished run
                print(f"warning: could not draw the plot: {err}")
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

    # ---- rollout: generate, score, advantages ------------------------------------------------------------------
    def rollout(self) -> RolloutBatch:
        self._times = {"generation": 0.0, "scoring": 0.0}
        if self.cfg.dynamic_sampling:
            sampled, sampling_metrics = self._sample_dynamic()
        else:
            sampled, sampling_metrics = self._sample(self.sampler.next(self.B)), {}
        batch = self._assemble(sampled)
        batch.metrics.update(sampling_metrics)
        batch.metrics.update({f"time/{k}": v for k, v in self._times.items()})
        return batch

    def _sample(self, prompts_idx: list[int], round_: int = 0) -> Sampled:
        """Generate G completions for each prompt (this process's share of the rows) and score them."""
        G = self.G
        n_local = len(prompts_idx) * G // self.world
        first = self.rank * n_local
        rows = [i for i in prompts_idx for _ in range(G)][first:first + n_local]
        prompts, prompt_ids, columns = self.train_set.rows(rows)
        t0 = time.perf_counter()
        # Seeds belong to rows; a dynamic-sampling refill round gets rows of its own.
        seeds = [row_seed(self.cfg.seed, self.step, first + r + round_ * 1_000_000) for r in range(n_local)]
        out = self.generator.generate(prompt_ids, self.params, seeds)
        t1 = time.perf_counter()
        texts = self.tokenizer.batch_decode([strip_eos(c, self.eos_ids) for c in out.ids], skip_special_tokens=False)
        completions = [as_completion(p, t) for p, t in zip(prompts, texts)]
        scored = self.rewards(prompts, completions, out.ids, columns)
        self._times["generation"] += t1 - t0
        self._times["scoring"] += time.perf_counter() - t1
        return Sampled(prompts, prompt_ids, columns, out.ids, out.truncated, texts, completions, scored.total,
                       scored.per_func, scored.errors, scored.timeouts, out.logprobs)

    def _sample_dynamic(self) -> tuple[Sampled, dict[str, float]]:
        """DAPO dynamic sampling: drop groups whose rewards are all equal, sample more prompts until the step has
        prompts_per_step groups or max_generation_rounds is reached (then it trains on the groups it has)."""
        G, kept, dropped, rounds, last = self.G, [], 0, 0, None
        while sum(len(k.total) for k in kept) < self.B * G and rounds < self.cfg.max_generation_rounds:
            last = self._sample(self.sampler.next(self.B), rounds)
            rounds += 1
            rewards = torch.tensor(last.total).view(-1, G)
            varied = [g for g in range(rewards.shape[0]) if float(rewards[g].max() - rewards[g].min()) > 0]
            dropped += rewards.shape[0] - len(varied)
            kept.append(last.select([g * G + j for g in varied for j in range(G)]))
        groups = sum(len(k.total) for k in kept) // G
        # No group with signal at all: train on the last round as it is (its advantages are zero).
        sampled = Sampled.concat(kept).select(list(range(min(groups, self.B) * G))) if groups else last
        return sampled, {"sampling/dropped_groups": float(dropped), "sampling/generation_rounds": float(rounds),
                         "sampling/kept_groups": float(min(groups, self.B))}

    def _assemble(self, s: Sampled) -> RolloutBatch:
        """Advantages, padding, and the old/reference log-probs: the training batch of the sampled groups."""
        cfg, G = self.cfg, self.G
        n_local = len(s.total)
        t0 = time.perf_counter()
        rewards = self._gather(torch.tensor(s.total, dtype=torch.float32)).view(-1, G)
        mine = slice(self.rank * n_local, (self.rank + 1) * n_local)
        outcome = group_advantages(rewards, scale=cfg.scale_rewards, eps=cfg.advantage_eps,
                                   unbiased=cfg.unbiased_std).view(-1)[mine]
        keep = [not (cfg.mask_truncated_completions and t) for t in s.truncated]
        input_ids, attention, cmask = pack(s.prompt_ids, s.completion_ids, self.tokenizer.pad_token_id, keep)
        advantages, step_metrics = outcome, {}
        if self.step_rewards:
            ids = [strip_eos(c, self.eos_ids) for c in s.completion_ids]
            advantages, step_metrics = self._process_advantages(s.prompts, s.completions, ids, s.columns, outcome,
                                                                cmask)
        self._times["scoring"] += time.perf_counter() - t0
        t1 = time.perf_counter()
        batch = RolloutBatch(input_ids, attention, cmask, advantages)
        if self.sampling_estimates and s.logprobs is not None:
            batch.sampling_logp = torch.zeros_like(cmask)
            for i, row in enumerate(s.logprobs):
                batch.sampling_logp[i, :len(row)] = torch.tensor(row[:cmask.shape[1]], dtype=cmask.dtype)
        self._score_logprobs(batch)
        batch.metrics = {**self._rollout_metrics(s, rewards, outcome), **step_metrics,
                         "time/logprobs": time.perf_counter() - t1}
        batch.samples = [{"prompt": p if isinstance(p, str) else p[-1]["content"], "completion": t,
                          "reward": r, "advantage": float(a), **{f"reward/{k}": v[i] for k, v in s.per_func.items()}}
                         for i, (p, t, r, a) in enumerate(zip(s.prompts, s.texts, s.total, outcome))][:16]
        return batch

    def _process_advantages(self, prompts, completions, ids, columns, outcome, cmask):
        """Step rewards -> token positions -> DeepSeekMath 4.1.3 process advantages, mixed with the outcome ones."""
        cfg = self.cfg
        step_scores: list[list[float]] = [[] for _ in ids]
        step_ends: list[list[int]] = [[] for _ in ids]
        for func in self.step_rewards:
            result = func(prompts=prompts, completions=completions, **columns)
            for i, steps in enumerate(result):
                if steps:
                    chars, scores = zip(*steps)
                    step_scores[i] += list(scores)
                    step_ends[i] += char_to_token_ends(self.tokenizer, ids[i], list(chars))
        scores_all, ends_all = self._gather_objects(step_scores), self._gather_objects(step_ends)
        T = cmask.shape[1]
        n_local = len(ids)
        mask_all = torch.zeros(len(scores_all), T)
        lengths = self._gather(cmask.sum(1))
        for r in range(len(scores_all)):  # every row's mask, rebuilt from its length (all ranks' rows)
            mask_all[r, :int(min(lengths[r], T))] = 1.0
        process = process_advantages(scores_all, ends_all, mask_all, self.G, eps=cfg.advantage_eps,
                                     unbiased=cfg.unbiased_std)[self.rank * n_local:(self.rank + 1) * n_local]
        mixed = mix_advantages(outcome, process, cmask, outcome_weight=cfg.outcome_weight,
                               process_weight=cfg.process_weight)
        flat = [s for row in step_scores for s in row]
        first_wrong = [any(s <= 0 for s in row) for row in step_scores]
        return mixed, {"reward/step/mean": float(np.mean(flat)) if flat else 0.0,
                       "reward/step/count": float(len(flat)) / max(1, len(ids)),
                       "reward/step/first_wrong_found_frac": float(np.mean(first_wrong)) if first_wrong else 0.0}

    @torch.no_grad()
    def _score_logprobs(self, batch: RolloutBatch) -> None:
        """The reference's log-probs (beta > 0). The sampling policy's come from the first update pass."""
        cfg = self.cfg
        if cfg.beta > 0:
            with reference_view(self.policy, self.reference) as ref:
                batch.ref_logp = self._logprobs_in_chunks(ref, batch)

    def _logprobs_in_chunks(self, model, batch: RolloutBatch) -> torch.Tensor:
        T, size = batch.completion_width, self.cfg.per_device_train_batch_size
        parts = [completion_logprobs(model, batch.input_ids[s:s + size], batch.attention_mask[s:s + size], T,
                                     self.cfg.temperature) for s in range(0, batch.input_ids.shape[0], size)]
        return torch.cat(parts)

    def _rollout_metrics(self, scored: Sampled, rewards, outcome) -> dict[str, float]:
        lengths = torch.tensor([len(c) for c in scored.completion_ids], dtype=torch.float32)
        lengths_all = self._gather(lengths)
        truncated = self._gather(torch.tensor(scored.truncated, dtype=torch.float32))
        m = {"reward/total": float(rewards.nanmean()), "reward/total/std": float(rewards.std()),
             "advantage/mean": float(outcome.mean()), "advantage/std": float(outcome.std()),
             "completion/mean_length": float(lengths_all.mean()), "completion/max_length": float(lengths_all.max()),
             "completion/truncated_frac": float(truncated.mean())}
        for name, values in scored.per_func.items():
            vals = self._gather(torch.tensor([float("nan") if v is None else float(v) for v in values]))
            m[f"reward/{name}"] = float(vals.nanmean())
            m[f"reward/{name}/none_frac"] = float(vals.isnan().float().mean())  # "does not apply" to these rows
        for name, count in scored.errors.items():
            m[f"reward/errors/{name}"] = float(count)
        for name, count in scored.timeouts.items():
            m[f"reward/timeouts/{name}"] = float(count)
        m.update(group_stats(rewards))
        return m

    # ---- update: num_iterations optimizer steps over the rollout ------------------------------------------------
    def update(self, batch: RolloutBatch) -> dict[str, float]:
        cfg = self.cfg
        n = batch.input_ids.shape[0]
        size = cfg.per_device_train_batch_size
        chunks = [slice(s, min(s + size, n)) for s in range(0, n, size)]
        # Normalizers over the whole step on all processes make micro-batching and multi-process exact.
        if cfg.loss_aggregation == "token_mean":
            normalizer = float(self._gather(batch.completion_mask.sum().reshape(1)).sum())
        else:
            normalizer = float(n * self.world)
        sums: dict[str, float] = {}
        weight_total = 0.0
        old_parts: list = []  # (rows, width, log-probs) of the first pass: the sampling policy's log-probs
        for it in range(cfg.num_iterations):
            if it == 1:
                batch.old_logp = torch.zeros_like(batch.completion_mask)
                for sl, width, old in old_parts:
                    batch.old_logp[sl, :width] = old
            self.optimizer.zero_grad(set_to_none=True)
            for k, sl in enumerate(chunks):
                sync = k == len(chunks) - 1
                if self.deepspeed:  # its engine steps in backward unless told that more micro-batches follow
                    self.accel.gradient_state._set_sync_gradients(sync)
                ctx = self.accel.no_sync(self.model) if not sync else contextlib.nullcontext()
                with ctx:
                    metrics, w = self._micro_step(batch, sl, normalizer, with_entropy=it == 0, old_parts=old_parts)
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + value * w
                weight_total += w
            grad_norm = self._optimizer_step(batch)
        out = {LOSS_METRIC_NAMES.get(k, f"policy/{k}"): v / max(weight_total, 1e-9) for k, v in sums.items()
               if not k.startswith("advantage")}  # advantages are logged once per rollout
        out["train/grad_norm"] = grad_norm
        out["train/learning_rate"] = self.scheduler.get_last_lr()[0]
        out["health/nonfinite_steps"] = float(self.nonfinite_total)
        return out

    def _micro_step(self, batch: RolloutBatch, sl: slice, normalizer: float, with_entropy: bool, old_parts: list):
        cfg = self.cfg
        cmask = batch.completion_mask[sl]
        width = int(batch.attention_mask[sl, batch.input_ids.shape[1] - batch.completion_width:].sum(1).max())
        width = max(width, 1)
        cut = batch.completion_width - width  # trailing columns that are padding in every row of this chunk
        end = batch.input_ids.shape[1] - cut
        ids, attn = batch.input_ids[sl, :end], batch.attention_mask[sl, :end]
        cm = cmask[:, :width]
        adv = batch.advantages[sl]
        adv = adv[:, :width] if adv.dim() == 2 else adv
        ref = batch.ref_logp[sl, :width] if batch.ref_logp is not None else None
        given_old = batch.old_logp[sl, :width] if batch.old_logp is not None else None

        def loss_of(logp, rows=slice(None), entropy=None):
            # First pass over this rollout (no old log-probs yet): no optimizer step has happened, so the policy's
            # own log-probs are the sampling policy's; they are kept for later iterations instead of a second pass.
            old = logp.detach() if given_old is None else given_old[rows]
            return policy_loss(logp, old, adv[rows], cm[rows], ref_logp=None if ref is None else ref[rows],
                               beta=cfg.beta, kl_estimator=cfg.kl_estimator, eps_low=cfg.epsilon,
                               eps_high=cfg.epsilon_high, ratio_level=cfg.importance_sampling_level,
                               aggregation=cfg.loss_aggregation, max_length=cfg.max_completion_length,
                               normalizer=normalizer, entropy=entropy)

        fused = None
        if self.fused_loss:  # the loss's gradient in the log-prob pass
            estimate = None  # of the log-probs: the sampler's in the first pass; for a frozen head, the last pass's
            if given_old is None and batch.sampling_logp is not None:
                estimate = batch.sampling_logp[sl, :width]
            elif self.frozen_head and given_old is not None and batch.sampling_logp is not None:
                estimate = given_old
            storage = self._head_grad_storage()
            fused = completion_loss(self.model, ids, attn, width, cfg.temperature,
                                    lambda lp, rows: loss_of(lp, rows).loss, with_entropy=with_entropy,
                                    logp_estimate=estimate, weight_grad_storage=storage)
            if storage is not None:
                grad = plain_head(self.policy).weight.grad
                if grad is None or grad.data_ptr() != storage.data_ptr():
                    self._head_grad_space = None  # not taken (the two-pass path makes its own): not held either
        if fused is not None:
            loss, logp, entropy = fused
        else:
            out = completion_logprobs(self.model, ids, attn, width, cfg.temperature, with_entropy=with_entropy)
            logp, entropy = out if with_entropy else (out, None)
        if given_old is None and cfg.num_iterations > 1:
            old_parts.append((sl, width, logp.detach()))
        out = loss_of(logp, entropy=entropy)  # the whole micro-batch: its metrics, and its loss on the plain path
        # DDP averages gradients over processes; the loss is already a share of the global sum, so undo the mean.
        self.accel.backward((loss if fused is not None else out.loss) * self.world)
        metrics = {k: float(v) for k, v in out.metrics.items()}
        return metrics, float(cm.sum())

    def _head_grad_storage(self) -> torch.Tensor | None:
        """Memory for the head's gradient when it is about to be made (`lend_head_grad` and no .grad yet): the
        head's shape, at the start of a flat buffer large enough for the packed copy it is lent to next."""
        if not self.lend_head_grad:  # (which implies a plain linear head)
            return None
        weight = plain_head(self.policy).weight
        if weight.grad is not None:
            return None
        # A later iteration over the same rollout takes back what the last optimizer step lent (not yet packed into).
        space, self.generator.head_space = self.generator.head_space, None
        if space is None:
            space = torch.empty(max(weight.numel(), native.packed_floats(native.library(), weight)))
        self._head_grad_space = space
        return space[:weight.numel()].view_as(weight)

    def _optimizer_step(self, batch: RolloutBatch) -> float:
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else float("inf")
        # accelerate's: a float16 loss scaler's gradients unscaled first; under DeepSpeed the norm its engine took
        # when it stepped, in the last micro-batch's backward, clipping by its config's gradient_clipping
        norm = self.accel.clip_grad_norm_(params, max_norm)
        grad_norm = float("nan") if norm is None else float(norm)  # (None: a DeepSpeed engine that kept no norm)
        if norm is not None and not math.isfinite(grad_norm):
            # Skip: AdamW would write NaN into every weight (measured in TRL 1.16, reliability.md 3.2).
            if self.accel.scaler is not None:  # its step skips the update too, and lowers the loss scale
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self._head_grad_space = None
            self.nonfinite_total += 1
            self.nonfinite_in_a_row += 1
            saved = self._save_nonfinite_inputs(batch)
            taken = ("DeepSpeed's engine had stepped already (it skips float16 overflows itself)" if self.deepspeed
                     else "optimizer step skipped")
            print(f"warning: step {self.step + 1}: non-finite gradient norm ({grad_norm}); {taken}, "
                  f"inputs saved to {saved}.")
            if self.nonfinite_in_a_row >= self.cfg.max_nonfinite_steps:
                raise TrainingStopped(
                    f"step {self.step + 1}: {self.nonfinite_in_a_row} non-finite gradient norms in a row "
                    f"(max_nonfinite_steps={self.cfg.max_nonfinite_steps}); stopped with the last checkpoint intact. "
                    f"Inspect {saved}, lower learning_rate, or check the rewards.")
            return grad_norm
        self.nonfinite_in_a_row = 0
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)  # no gradient buffers held through the next rollout...
        if self._head_grad_space is not None:  # ...but the head's, whose memory the next rollout packs the head into
            self.generator.head_space, self._head_grad_space = self._head_grad_space, None
        return grad_norm

    def _save_nonfinite_inputs(self, batch: RolloutBatch) -> Path:
        """The step's tensors and sample texts, so a NaN can be reproduced and inspected offline."""
        path = Path(self.cfg.output_dir) / "nonfinite" / f"step_{self.step + 1:06d}_rank{self.rank}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        fields = ("input_ids", "attention_mask", "completion_mask", "advantages", "old_logp", "ref_logp")
        torch.save({**{f: getattr(batch, f) for f in fields}, "samples": batch.samples}, path)
        return path

    # ---- eval, save, resume ---------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        from grpo.evaluate import evaluate_prompts

        params = SamplingParams(self.cfg.max_completion_length, self.cfg.eval_temperature)
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

    # ---- process-group helpers ---------------------------------------------------------------------------------
    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.world == 1 else self.accel.gather(t.to(self.accel.device)).cpu()

    def _gather_objects(self, rows: list) -> list:
        if self.world == 1:
            return rows
        from accelerate.utils import gather_object

        return gather_object(rows)
