"""The batch layout of a run and the optimizer steps of each rollout, resolved once from the config.

TRL 1.16's counting (trl/trainer/grpo_config.py, `__post_init__`; grpo_trainer.py, `_get_train_sampler`):

    micro-batch      per_device_train_batch_size completions, on one process
    optimizer step   gradient_accumulation_steps micro-batches on every process
    rollout          generation_batch_size = per_device_train_batch_size x processes x steps_per_generation
                     completions (steps_per_generation defaults to gradient_accumulation_steps: one optimizer step)
    per rollout      steps_per_generation / gradient_accumulation_steps optimizer steps per pass, num_iterations
                     passes; the rollout's rows are shuffled once and split in that many slices (TRL shuffles too)
    max_steps        optimizer steps; an epoch is floor(prompts / prompts per rollout) rollouts

Our `prompts_per_step` sets the completions of one optimizer step (prompts_per_step x num_generations): the
micro-batches are then what it needs (per_device_train_batch_size caps them; the last may be smaller), unless
gradient_accumulation_steps is set too, which must agree. steps_per_generation must be a multiple of
gradient_accumulation_steps here (an optimizer step never spans two rollouts).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from grpo.config import ConfigError, GRPOConfig


@dataclass(frozen=True)
class Layout:
    processes: int
    num_generations: int  # G
    prompts_per_rollout: int  # B: the rollout's prompts, all processes
    micro_batch: int  # most rows of one micro-batch (per_device_train_batch_size)
    micro_batches: int  # per optimizer step on each process (gradient_accumulation_steps)
    steps_per_rollout: int  # optimizer steps per pass over the rollout (K)
    num_iterations: int  # passes over each rollout (mu)
    steps_per_epoch: int  # optimizer steps
    total_steps: int  # optimizer steps of the run

    @property
    def rollout_completions(self) -> int:
        return self.prompts_per_rollout * self.num_generations

    @property
    def step_completions(self) -> int:
        return self.rollout_completions // self.steps_per_rollout

    @property
    def rollout_steps(self) -> int:
        """Optimizer steps one rollout feeds."""
        return self.steps_per_rollout * self.num_iterations

    def to_dict(self) -> dict:
        return {**asdict(self), "rollout_completions": self.rollout_completions,
                "step_completions": self.step_completions, "rollout_steps": self.rollout_steps}


def resolve_layout(cfg: GRPOConfig, processes: int, n_prompts: int | None = None) -> Layout:
    """The run's layout for `processes` processes and a dataset of `n_prompts` prompts (None: max_steps decides);
    a ConfigError names the keys of a contradiction."""
    G, pdb, ga = cfg.num_generations, cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps
    if cfg.prompts_per_step is not None:
        step = cfg.prompts_per_step * G
        if step % processes:
            raise ConfigError(f"prompts_per_step: {cfg.prompts_per_step} prompts x {G} generations = {step} "
                              f"completions cannot be split evenly over {processes} processes; choose "
                              f"prompts_per_step so that B x G divides by {processes}.")
        local = step // processes
        if ga is not None and ga * pdb != local:
            raise ConfigError(f"gradient_accumulation_steps: {ga} micro-batches of per_device_train_batch_size={pdb} "
                              f"on {processes} process(es) are {ga * pdb * processes} completions per optimizer step, "
                              f"but prompts_per_step x num_generations is {step}; set one of them.")
        ga = ga or math.ceil(local / pdb)
        steps = _steps_per_rollout(cfg, step, ga, pdb, processes)
        prompts = cfg.prompts_per_step * steps
    else:
        ga = ga or 1
        spg = cfg.steps_per_generation
        if cfg.generation_batch_size is not None:
            if cfg.generation_batch_size % (pdb * processes):
                raise ConfigError(f"generation_batch_size: {cfg.generation_batch_size} must be divisible by "
                                  f"per_device_train_batch_size x processes = {pdb * processes} (TRL's rule).")
            from_gbs = cfg.generation_batch_size // (pdb * processes)
            if spg is not None and spg != from_gbs:
                raise ConfigError(f"generation_batch_size: {cfg.generation_batch_size} completions are "
                                  f"{from_gbs} micro-batch passes on {processes} process(es), but "
                                  f"steps_per_generation is {spg}; set one of them.")
            spg = from_gbs
        spg = spg or ga
        _check_multiple(spg, ga)
        rollout = pdb * processes * spg
        if rollout % G == 0:
            prompts, steps = rollout // G, spg // ga
        elif rollout < G and spg == ga and cfg.generation_batch_size is None:
            # Less than one group per optimizer step (TRL refuses): one group per step, in micro-batches of pdb.
            if G % processes:
                raise ConfigError(f"num_generations: a group of {G} cannot be split over {processes} processes.")
            prompts, steps, ga = 1, 1, math.ceil(G // processes / pdb)
        else:
            raise ConfigError(f"per_device_train_batch_size: a rollout of {pdb} x {processes} process(es) x "
                              f"{spg} steps_per_generation = {rollout} completions is not a multiple of "
                              f"num_generations={G}; each prompt needs a full group (TRL's rule). Change "
                              "per_device_train_batch_size, gradient_accumulation_steps or steps_per_generation, or "
                              "set prompts_per_step.")
    if cfg.dynamic_sampling and (steps > 1 or processes > 1):
        raise ConfigError("dynamic_sampling: refills a rollout's groups for one optimizer step on one process; with "
                          "several optimizer steps per rollout or several processes the refilled groups would need "
                          "moving. Turn it off, or use one step per rollout on one process.")
    per_epoch = max(1, (n_prompts or prompts) // prompts) * steps * cfg.num_iterations
    total = cfg.max_steps if cfg.max_steps > 0 else max(1, math.ceil(cfg.num_train_epochs * per_epoch))
    return Layout(processes, G, prompts, pdb, ga, steps, cfg.num_iterations, per_epoch, total)


def _steps_per_rollout(cfg: GRPOConfig, step: int, ga: int, pdb: int, processes: int) -> int:
    if cfg.generation_batch_size is not None:
        if cfg.generation_batch_size % step:
            raise ConfigError(f"generation_batch_size: {cfg.generation_batch_size} is not a multiple of the "
                              f"{step} completions of an optimizer step (prompts_per_step x num_generations).")
        return cfg.generation_batch_size // step
    if cfg.steps_per_generation is not None:
        _check_multiple(cfg.steps_per_generation, ga)
        return cfg.steps_per_generation // ga
    return 1


def _check_multiple(spg: int, ga: int) -> None:
    if spg % ga:
        raise ConfigError(f"steps_per_generation: {spg} is not a multiple of gradient_accumulation_steps={ga}; "
                          "an optimizer step takes its micro-batches from one rollout here (TRL's old-log-prob "
                          "bookkeeping for steps that span two is not built).")


@dataclass(frozen=True)
class StepPlan:
    """One optimizer step of a rollout: its pass (iteration), its slice and its micro-batches: each the rows it takes
    (indices of this process's rollout rows), as a tensor or as a `grpo.training.update.micro_batches.Plan`."""

    iteration: int
    slice_index: int
    micro_batches: list

    @property
    def rows(self) -> int:
        return sum(len(m) for m in self.micro_batches)


def rollout_plan(layout: Layout, local_rows: int, seed: int, rollout_index: int,
                 cut: Callable[[torch.Tensor], list] | None = None) -> list[StepPlan]:
    """The optimizer steps one rollout of `local_rows` rows on this process feeds, in order: every slice of pass 0,
    then of pass 1, ... With several slices the rows are shuffled first (seeded by the run's seed and the rollout's
    index, so a resumed run takes the same slices); with one slice they stay in order. `cut(rows)` makes a slice's
    micro-batches (by tokens, packed: `MicroBatches.plan`), once per slice, every pass taking the same; default:
    consecutive runs of layout.micro_batch rows."""
    K = layout.steps_per_rollout
    if K == 1:
        order = torch.arange(local_rows)
    else:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + rollout_index + 17)
        order = torch.randperm(local_rows, generator=generator)
    size = local_rows // K
    cut = cut or (lambda rows: [rows[s:s + layout.micro_batch] for s in range(0, len(rows), layout.micro_batch)])
    slices = [cut(order[k * size:(k + 1) * size]) for k in range(K)]
    return [StepPlan(it, k, micro) for it in range(layout.num_iterations) for k, micro in enumerate(slices)]
