"""The update's mechanics: a rollout's optimizer steps planned, each step's micro-batches through the loss and its
backward, the scoring passes over the same micro-batches, and the gradient clipped and applied.

    plan       the rollout's rows into optimizer steps (TRL's counting, `grpo.training.update.steps.rollout_plan`), each
               step's rows into micro-batches (by rows or by a token budget, packed where the passes are
               padding-free: `grpo.training.update.micro_batches`), the same number on every process
    score      the no-gradient log-prob passes (reference, old policy) over the first pass's micro-batches
    run        each optimizer step: its micro-batches forward and backward, each loss a share of the step's loss over
               every process (`grpo.core.aggregation_normalizer`), so any cut gives the one-batch gradient; then the
               trainer's optimizer step

The trainer (`grpo.training.trainer`) calls these in the algorithm's order; its optimizer step (callbacks, health,
the reference's sync) calls `clip_gradients` and `apply_step` from here.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch

from grpo.core import aggregation_normalizer
from grpo.training.update.micro_batches import MicroBatches, Plan
from grpo.training.update.objective import MicroInputs, Objective
from grpo.training.rollout.batch import RolloutBatch
from grpo.training.update.steps import Layout, StepPlan, rollout_plan
from grpo.training.observe.tracking import MetricSums

# grpo.core metric -> logged name (the seed tutorial's names where it has one).
LOSS_METRIC_NAMES = {"policy_loss": "policy/loss", "kl": "policy/kl_divergence"}


class Update:
    """The passes of the update for the model `model` (as accelerate prepared it) through `backend`."""

    routing = None  # an MoE model's grpo.engines.moe.Routing: routes replayed or measured, the aux loss

    def __init__(self, cfg, accel, model, backend, objective: Objective, procs, layout: Layout, micro: MicroBatches):
        self.cfg, self.accel, self.model, self.backend = cfg, accel, model, backend
        self.objective, self.procs, self.layout, self.micro = objective, procs, layout, micro

    def plan(self, batch: RolloutBatch) -> list[StepPlan]:
        """The rollout's optimizer steps, each step's rows cut into micro-batches (by rows or tokens, packed).
        Collective with a token budget on several processes."""
        return rollout_plan(self.layout, batch.input_ids.shape[0], self.cfg.seed, batch.index,
                            cut=lambda rows: self.micro.plan(batch, rows))

    def score(self, model, batch: RolloutBatch) -> torch.Tensor:
        """(N, T) log-probs of the rollout's completion tokens under `model`, without gradients, in the micro-batches
        of the update's first pass (which hold every row once); 0 past each row's end."""
        device = self.accel.device
        out = torch.zeros(batch.completion_mask.shape, device=device)
        with torch.no_grad(), self.accel.autocast():
            for step in batch.plans or self.plan(batch):
                for m in step.micro_batches if step.iteration == 0 else ():
                    x = m.inputs(batch, device)
                    with self.routing.score_pass(model, x) if self.routing else contextlib.nullcontext():
                        out[m.rows, :m.width] = self.backend.logprobs(
                            model, x.input_ids, x.attention_mask, m.width, self.cfg.temperature, x.packed,
                            **({"images": x.images} if x.images else {}))
        return out

    def run(self, batch: RolloutBatch, plans: list[StepPlan], optimizer, scheduler,
            optimizer_step: Callable[[RolloutBatch], float]) -> dict[str, float]:
        """The optimizer steps `plans` of the rollout: each one's gradient accumulated over its micro-batches, then
        `optimizer_step(batch)` (which returns the gradient norm). Their metrics merged (the last step's norm)."""
        record_old = batch.old_logp is None and self.layout.rollout_steps > 1  # (one slice, several passes)
        rollout_tokens = float(self.procs.gather(batch.completion_mask.sum().reshape(1)).sum())
        sums, out = MetricSums(), {}  # loss metrics weighted by tokens over the steps' micro-batches
        for plan in plans:
            optimizer.zero_grad(set_to_none=True)
            out["train/loss"] = self._accumulate(batch, plan, rollout_tokens, sums,
                                                 record_old and plan.iteration == 0)
            out["train/learning_rate"] = scheduler.get_last_lr()[0]  # the rate this step takes
            out["train/grad_norm"] = optimizer_step(batch)
            out.update(self.objective.end_step())
            out.update(self.routing.step_metrics() if self.routing else {})
        means = sums.means(skip="advantage", gather_objects=self.procs.gather_objects)  # (advantages: per rollout)
        out.update({LOSS_METRIC_NAMES.get(k, k if "/" in k else f"policy/{k}"): v for k, v in means.items()})
        return out

    def _accumulate(self, batch: RolloutBatch, plan: StepPlan, rollout_tokens: float, sums: MetricSums,
                    record_old: bool) -> float:
        """One optimizer step's gradient: its micro-batches forward and backward. Returns the step's loss over every
        process; with `record_old`, keeps the log-probs as the sampling policy's (no optimizer step yet)."""
        world, per_row = self.procs.world, self.cfg.importance_sampling_level == "sequence"
        step_tokens = sum(batch.completion_mask[m.rows].sum() for m in plan.micro_batches).reshape(1)
        counts = dict(step_tokens=float(self.procs.gather(step_tokens).sum()), step_rows=plan.rows * world,
                      micro_batches=len(plan.micro_batches), processes=world, rollout_tokens=rollout_tokens,
                      steps_per_rollout=self.layout.steps_per_rollout)  # (aggregation_normalizer's)
        old_parts, loss = [], torch.zeros((), device=self.accel.device)
        for k, micro in enumerate(plan.micro_batches):
            sync = k == len(plan.micro_batches) - 1
            if self.accel.distributed_type == "DEEPSPEED":  # its engine steps in backward unless told that
                self.accel.gradient_state._set_sync_gradients(sync)  # more micro-batches follow
            with self.accel.no_sync(self.model) if not sync else contextlib.nullcontext():
                logp, result, tokens = self._micro_step(batch, micro, counts)
            old_parts.append((micro, logp))
            loss = loss + result.loss.detach()
            for key, value in result.metrics.items():  # (a sequence-level ratio's clip fractions are of rows)
                sums.add(key, value, float(len(micro)) if per_row and key.startswith("clip_frac") else tokens)
        if record_old:
            batch.old_logp = torch.zeros(batch.completion_mask.shape, device=self.accel.device)
            for micro, old in old_parts:
                batch.old_logp[micro.rows, :micro.width] = old
        return float(self.procs.gather(loss.reshape(1).cpu()).sum())  # (each process's share)

    def _micro_step(self, batch: RolloutBatch, plan: Plan, counts: dict):
        """One micro-batch's loss, backpropagated by the engine. Returns (log-probs, LossOutput, token count)."""
        device = self.accel.device
        micro = plan.inputs(batch, device)  # (no all-padding completion columns; packed when padding-free)
        tokens = float(batch.completion_mask[plan.rows, :plan.width].sum())  # (on the CPU: the device never waits)
        mask, adv, ref = (plan.take(t, device) for t in (batch.completion_mask, batch.advantages, batch.ref_logp))
        normalizer = aggregation_normalizer(self.cfg.loss_aggregation, micro_tokens=tokens, **counts)
        inputs = MicroInputs(mask, adv, micro.old_logp, micro.sampling_logp, ref, normalizer, counts["micro_batches"])
        in_loss = self.objective.entropy_in_loss
        share = 1.0 / (counts["micro_batches"] * counts["processes"])  # (an MoE aux loss's: TRL's, grpo's scaling)
        # (the backend runs the forward and the loss under the run's autocast, the backward outside it)
        routing = (self.routing.update_pass(self.backend, self.model, micro, share) if self.routing
                   else contextlib.nullcontext())
        with routing:
            logp, out = self.backend.loss_and_backward(
                micro, self.cfg.temperature, lambda lp, sub=slice(None), entropy=None:
                self.objective.loss(lp, entropy, inputs, sub), True, entropy_in_loss=in_loss)  # (entropy: TRL's)
        return logp, out, tokens


def clip_gradients(accel, model, max_grad_norm: float, experts=None) -> tuple[float, bool]:
    """Clip the trainable gradients to `max_grad_norm` (<= 0: no clipping); returns (their norm, whether the step
    may be taken). accelerate's: a float16 loss scaler's gradients unscaled first; under DeepSpeed the norm its engine
    took when it stepped, in the last micro-batch's backward, clipping by its config's gradient_clipping. `experts`
    (grpo.engines.expert_parallel.ExpertParallel): the expert shards' gradients synchronized first, the norm over
    every process's shards."""
    params = [p for p in model.parameters() if p.requires_grad]
    limit = max_grad_norm if max_grad_norm > 0 else float("inf")
    if experts is not None:
        experts.sync_gradients()
        accel.unscale_gradients()
        norm = experts.clip(params, limit)
    else:
        norm = accel.clip_grad_norm_(params, limit)
    grad_norm = float("nan") if norm is None else float(norm)  # (None: a DeepSpeed engine that kept no norm)
    return grad_norm, norm is None or math.isfinite(grad_norm)


def apply_step(optimizer, scheduler) -> None:
    """The optimizer's step and the schedule's; no gradient buffers held through the next rollout."""
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
