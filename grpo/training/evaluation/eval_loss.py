"""TRL's eval loss (`eval_loss` of `evaluate()`): the training objective on an eval set, as TRL's prediction_step
computes it.

num_generations completions of each eval prompt are sampled with the training sampling settings and scored; their
group advantages are the training rollout's. The loss is the run's objective (surrogate, masks, beta x KL to the
reference, entropy bonus, its aggregation over the eval batch as one optimizer step) at ratio 1: the completions were
just sampled by this policy, so no optimizer step lies between. No gradient, nothing is updated; the entropy
controller's state is read, not moved. With group-normalized advantages the surrogate term is small (0 per group for
sequence_mean, the length-advantage covariance for token means): the number mostly carries beta x KL.
"""

from __future__ import annotations

import torch

from grpo.config.derived import needs_reference
from grpo.core import aggregation_normalizer
from grpo.engines.policy import completion_logprobs, reference_view
from grpo.training.update.objective import MicroInputs, Objective
from grpo.training.rollout.rollouts import Rollouts


class _InOrder:
    """The eval prompts in order, as the rollout's prompt sampler."""

    def next(self, k: int) -> list[int]:
        return list(range(k))

    def state_dict(self) -> dict:  # (the rollout saves the draw to put it back if the servers are down: in order,
        return {}  # there is no position to keep)

    def load_state_dict(self, state: dict) -> None:
        del state


@torch.no_grad()
def eval_loss(train: Rollouts, objective: Objective, reference, accel, prompt_set) -> float:
    """The objective's value on `prompt_set` (module docstring), summed over this process's micro-batches and every
    process, as the training loss is. `train` is the run's rollout, whose engine, rewards and sampling settings the
    eval rollout shares; `objective` the run's (its adaptive entropy coefficient included)."""
    cfg, procs, policy = train.cfg, train.procs, train.policy
    rollouts = Rollouts(cfg, train.generator, policy, train.tokenizer, prompt_set, _InOrder(), train.rewards,
                        train.step_rewards, procs, len(prompt_set), cfg.num_generations, train.params, train.agent)
    rollouts.trainer_state = train.trainer_state
    rollouts.engine_stale = train.engine_stale
    with accel.autocast():
        batch = rollouts.make(0)
    run_objective, objective = objective, Objective(cfg, procs)
    objective.load_state_dict(run_objective.state_dict())
    device, width, rows = accel.device, batch.completion_width, batch.input_ids.shape[0]
    size = max(1, cfg.per_device_eval_batch_size)
    chunks = [torch.arange(s, min(s + size, rows)) for s in range(0, rows, size)]
    tokens = float(procs.gather(batch.completion_mask.sum().reshape(1)).sum())
    total = torch.zeros((), device=device)
    for chunk in chunks:
        ids, att = batch.input_ids[chunk].to(device), batch.attention_mask[chunk].to(device)
        mask = batch.completion_mask[chunk].to(device)
        logp, entropy = completion_logprobs(policy, ids, att, width, cfg.temperature, with_entropy=True)
        ref = None
        if needs_reference(cfg):
            with reference_view(policy, reference) as network:  # (a DiskReference's weights: for this pass only)
                ref = completion_logprobs(network, ids, att, width, cfg.temperature)
        normalizer = aggregation_normalizer(cfg.loss_aggregation, step_tokens=tokens, step_rows=rows * procs.world,
                                            micro_tokens=float(mask.sum()), micro_batches=len(chunks),
                                            processes=procs.world, rollout_tokens=tokens, steps_per_rollout=1)
        inputs = MicroInputs(mask, batch.advantages[chunk].to(device), None, None, ref, normalizer, len(chunks))
        out = objective.loss(logp, entropy if objective.entropy_in_loss else None, inputs)
        total = total + out.loss.detach()
    return float(procs.gather(total.reshape(1).cpu()).sum())
