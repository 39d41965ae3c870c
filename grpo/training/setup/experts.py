"""Expert parallelism at start (`expert_parallel_size`, grpo.engines.expert_parallel): what it cannot combine with,
refused by name before the model loads; then the policy's (and a reference's) experts split over each group of
processes, and DDP told to leave the shards out of its all-reduce."""

from __future__ import annotations

import torch

from grpo.config import ConfigError
from grpo.engines.expert_parallel import ExpertParallel, expert_group, experts_modules, split_experts
from grpo.training.setup.inputs import check_groups


def check_expert_parallel(cfg, processes: int, distributed: str, multi_turn: bool = False) -> None:
    """Refuse an expert_parallel_size the launch cannot take, or one combined with what it is not built for
    (`multi_turn`: the rollouts are an agent's: tools, environments or a rollout_func)."""
    size = cfg.expert_parallel_size
    if size == 1:
        return
    check_groups("expert_parallel_size", size, processes)
    refusals = [
        (distributed in ("FSDP", "DEEPSPEED"), f"{distributed} shards the weights itself; EP runs under DDP "
                                               "(accelerate's multi-GPU/multi-CPU launch)"),
        (cfg.sequence_parallel_size > 1, "with sequence_parallel_size > 1 is not built (both regroup the "
                                         "processes); set one of them to 1"),
        (cfg.use_vllm, "with use_vllm: vLLM would need every expert pushed to it; rollouts run in grpo's sampler"),
        (cfg.max_staleness > 0, "with max_staleness > 0: the rollout worker's forwards would not enter the "
                                "groups' exchanges; set max_staleness: 0"),
        (multi_turn, "with multi-turn rollouts (tools, environments, rollout_func): processes take different "
                     "numbers of turns, and every generation step is collective under EP"),
        (cfg.use_peft, "with use_peft: LoRA's adapters, merges and saves over split experts are not built"),
        (cfg.reference_weights == "disk", "with reference_weights: disk: the reference on disk holds every "
                                          "expert; set it to auto"),
    ]
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"expert_parallel_size={size}: {why}.")


def make_expert_parallel(cfg, accelerator, policy, reference) -> ExpertParallel | None:
    """Split `policy`'s experts (and a reference module's, which scores with the same exchanges) over groups of
    expert_parallel_size processes; DDP (accelerate's prepare, after this) leaves the shards alone. None: EP off.
    Collective (the process groups)."""
    size = cfg.expert_parallel_size
    if size == 1:
        return None
    if not experts_modules(policy):
        raise ConfigError(f"expert_parallel_size={size}: {type(policy).__name__} has no stacked experts to split "
                          "(a dense model, or an MoE whose experts are separate modules); set it to 1.")
    ep = expert_group(accelerator.process_index, accelerator.num_processes, size)
    shards = split_experts(policy, ep)
    if isinstance(reference, torch.nn.Module):
        split_experts(reference, ep)
    ids = {id(p) for p in shards}
    names = [name for name, p in policy.named_parameters() if id(p) in ids]
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(policy, names)
    return ExpertParallel(ep, shards)
