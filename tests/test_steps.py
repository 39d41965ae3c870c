"""The batch layout (grpo.training.update.steps): completions per rollout and per optimizer step as TRL 1.16 counts them,
our prompts_per_step resolved with TRL's keys, contradictions refused, and the optimizer steps of a rollout."""

from __future__ import annotations

import pytest
import torch

from grpo.config import ConfigError, GRPOConfig
from grpo.training.update.steps import resolve_layout, rollout_plan


def layout(processes=1, n_prompts=100, **values):
    return resolve_layout(GRPOConfig(**values), processes, n_prompts)


@pytest.mark.parametrize("values, processes", [
    (dict(per_device_train_batch_size=8, num_generations=8), 1),
    (dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4), 1),
    (dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, steps_per_generation=4, num_generations=4), 1),
    (dict(per_device_train_batch_size=4, generation_batch_size=32, num_generations=8), 2),
    (dict(per_device_train_batch_size=2, gradient_accumulation_steps=3, steps_per_generation=6, num_generations=6), 2),
])
def test_rollout_and_step_sizes_are_trls(values, processes):
    """TRL's own GRPOConfig resolves generation_batch_size (the rollout) and steps_per_generation; ours gives the
    same rollout, and optimizer steps of per_device_train_batch_size x gradient_accumulation_steps x processes."""
    trl = pytest.importorskip("trl")
    ours = layout(processes, **values)
    theirs = trl.GRPOConfig(output_dir="unused", use_cpu=True, **values)
    theirs_gbs = theirs.generation_batch_size * processes if "generation_batch_size" not in values else \
        theirs.generation_batch_size  # (TRL reads its process count from the launch: here one process)
    assert ours.rollout_completions == theirs_gbs
    ga = values.get("gradient_accumulation_steps", 1)
    assert ours.step_completions == values["per_device_train_batch_size"] * ga * processes
    assert ours.steps_per_rollout * ga == (theirs.steps_per_generation if "generation_batch_size" not in values
                                           else values["generation_batch_size"] // (4 * processes))


def test_by_hand():
    # 4 x 2 micro-batches x 1 process = 8 completions per optimizer step; steps_per_generation 4 = 2 optimizer
    # steps per pass; the rollout is 16 completions = 4 prompts of 4. With 2 iterations it feeds 4 optimizer steps;
    # 10 prompts are 2 whole rollouts per epoch (the last 2 prompts wait for the next epoch): 8 steps per epoch.
    got = layout(n_prompts=10, per_device_train_batch_size=4, gradient_accumulation_steps=2, steps_per_generation=4,
                 num_generations=4, num_iterations=2, num_train_epochs=1.5)
    assert (got.prompts_per_rollout, got.micro_batches, got.steps_per_rollout, got.rollout_steps) == (4, 2, 2, 4)
    assert (got.steps_per_epoch, got.total_steps) == (8, 12)
    assert layout(max_steps=7).total_steps == 7


def test_prompts_per_step_sets_the_optimizer_steps_completions():
    # 2 prompts x 4 = 8 completions per optimizer step, in micro-batches of at most 3 rows: 3 + 3 + 2.
    got = layout(prompts_per_step=2, num_generations=4, per_device_train_batch_size=3)
    assert (got.step_completions, got.micro_batches, got.steps_per_rollout) == (8, 3, 1)
    got = layout(prompts_per_step=2, num_generations=4, per_device_train_batch_size=4, steps_per_generation=4)
    assert (got.prompts_per_rollout, got.steps_per_rollout) == (4, 2)  # 2 micro-batches a step, 4 per rollout
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps: 3 micro-batches of "
                       r"per_device_train_batch_size=4 .* but prompts_per_step x num_generations is 8"):
        layout(prompts_per_step=2, num_generations=4, per_device_train_batch_size=4, gradient_accumulation_steps=3)


@pytest.mark.parametrize("values, message", [
    (dict(gradient_accumulation_steps=2, steps_per_generation=3), "steps_per_generation: 3 is not a multiple of "
                                                                   "gradient_accumulation_steps=2"),
    (dict(per_device_train_batch_size=4, generation_batch_size=12, num_generations=4),
     "generation_batch_size: 12 must be divisible by per_device_train_batch_size x processes = 8"),
    (dict(per_device_train_batch_size=10, num_generations=8), "is not a multiple of num_generations=8"),
    (dict(prompts_per_step=3, num_generations=4), "12 completions cannot be split evenly over 8 processes"),
])
def test_contradictions_are_refused(values, message):
    processes = 8 if "prompts_per_step" in values else 2
    with pytest.raises(ConfigError, match=message):
        layout(processes, **values)


def test_less_than_a_group_per_step_takes_one_group():
    """TRL refuses per_device_train_batch_size=1 with num_generations=2 (seed tutorial 000's settings); grpo takes
    one group per optimizer step, in micro-batches of one."""
    got = layout(per_device_train_batch_size=1, num_generations=2)
    assert (got.prompts_per_rollout, got.micro_batches, got.step_completions) == (1, 2, 2)


def test_rollout_plan_slices_each_pass_alike():
    got = layout(per_device_train_batch_size=2, gradient_accumulation_steps=2, steps_per_generation=4,
                 num_generations=4, num_iterations=2)
    plans = rollout_plan(got, 8, seed=0, rollout_index=3)
    assert [(p.iteration, p.slice_index) for p in plans] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    rows = [torch.cat(p.micro_batches).tolist() for p in plans]
    assert sorted(rows[0] + rows[1]) == list(range(8)) and rows[:2] == rows[2:]
    assert rows[0] + rows[1] != list(range(8))  # shuffled (TRL shuffles the generation batch too)
    assert all(len(m) == 2 for p in plans for m in p.micro_batches)
    again = rollout_plan(got, 8, seed=0, rollout_index=3)
    assert [torch.cat(p.micro_batches).tolist() for p in again] == rows  # a resumed run takes the same slices
    one = layout(per_device_train_batch_size=3, prompts_per_step=2, num_generations=4)
    assert [m.tolist() for m in rollout_plan(one, 8, 0, 0)[0].micro_batches] == [[0, 1, 2], [3, 4, 5], [6, 7]]
