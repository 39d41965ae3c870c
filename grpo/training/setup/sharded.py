"""Runs whose weights are sharded over processes (accelerate's FSDP2, DeepSpeed ZeRO-3): what setting one up adds.

The reference model (beta > 0, no LoRA) is sharded the way the policy is: FSDP2 by accelerate's own `fully_shard`
recipe (each decoder layer a unit), ZeRO-3 by a DeepSpeed engine without an optimizer (as TRL's
`prepare_deepspeed`). With LoRA there is no second model: the reference is the policy with its adapters off.
`local_bytes` measures what sharding saves: the bytes of weights and optimizer state this process holds.
"""

from __future__ import annotations

import copy
import dataclasses
import os

import torch

from grpo.config import ConfigError, GRPOConfig


def zero_stage(accelerator) -> int | None:
    """DeepSpeed's ZeRO stage under accelerate's DeepSpeed, else None."""
    if accelerator.distributed_type != "DEEPSPEED":
        return None
    return accelerator.state.deepspeed_plugin.zero_stage


def shards_weights(accelerator) -> bool:
    """Whether accelerate will shard the weights: FSDP (version 2) or DeepSpeed ZeRO-3."""
    return accelerator.distributed_type == "FSDP" or zero_stage(accelerator) == 3


def describe(accelerator, cfg: GRPOConfig) -> str:
    """How the run shards, for its start lines ("" when it does not)."""
    stage = zero_stage(accelerator)
    if shards_weights(accelerator):
        rollouts = "gathered weights" if cfg.ds3_gather_for_generation else "the sharded model"
        name = "FSDP2" if stage is None else "ZeRO-3"
        return f"; {name}: weights, gradients and optimizer state sharded, rollouts from {rollouts}"
    if stage in (1, 2):
        return f"; ZeRO-{stage}: optimizer state{' and gradients' if stage == 2 else ''} sharded"
    return ""


def check_sharding(accelerator, cfg: GRPOConfig) -> None:
    """Refuse, before any model loads, what the sharded paths do not run."""
    for name, kind in (("FSDP", "FSDP"), ("DEEPSPEED", "DeepSpeed")):
        if os.environ.get(f"ACCELERATE_USE_{name}", "").lower() == "true" and accelerator.distributed_type != name:
            # (accelerate's CPU path runs DDP only: it would train with whole weights in every process)
            raise ConfigError(f"accelerate launched {kind}, which accelerate runs on GPUs only; on a machine without "
                              "a GPU launch with recipes/accelerate/ddp_cpu.yaml.")
    if accelerator.distributed_type == "FSDP":
        version = getattr(accelerator.state.fsdp_plugin, "fsdp_version", 1)
        if version != 2:
            raise ConfigError(f"FSDP version {version}: this trainer runs FSDP2 (fully_shard); set fsdp_version: 2 "
                              "in the accelerate config (recipes/accelerate/fsdp2.yaml).")
        try:
            from accelerate.utils import fsdp2_prepare_model  # noqa: F401 - accelerate >= 1.6
        except ImportError:
            raise ConfigError("FSDP2 needs accelerate >= 1.6 (pip install -U accelerate).") from None
    if shards_weights(accelerator) and cfg.reference_weights == "disk":
        raise ConfigError("reference_weights: disk keeps a whole copy of the reference on each process; with sharded "
                          "weights (FSDP2, ZeRO-3) the reference is sharded like the policy. Set it to auto.")
    if shards_weights(accelerator) and cfg.sync_ref_model:
        raise ConfigError("sync_ref_model: not built with sharded weights (FSDP2, ZeRO-3): the sharded reference's "
                          "state dict holds this process's shards (ZeRO-3: an engine's 'module.' names and empty "
                          "parameters), so the sync and its checkpoint would be wrong. Set sync_ref_model: false, or "
                          "shard optimizer state only (ZeRO-2, recipes/accelerate/zero2.yaml) or use DDP.")
    if not cfg.ds3_gather_for_generation:
        if not shards_weights(accelerator):
            raise ConfigError("ds3_gather_for_generation: false applies to sharded weights (FSDP2, DeepSpeed "
                              "ZeRO-3); this run holds whole weights in each process, so remove the key.")
        if cfg.use_vllm:
            raise ConfigError("ds3_gather_for_generation: vLLM always receives whole weights (gathered one tensor "
                              "at a time into its engine); false applies to the transformers sampler. Remove the "
                              "key or set use_vllm: false.")


def check_sharded_images(accelerator, train_set) -> None:
    """With sharded weights every process must run each vision block in every forward (each gathers its weights
    collectively), and a process whose micro-batch has no image would not: a dataset mixing rows with and without
    images is refused (gpu_review2 N6; under DDP a stand-in image keeps the vision side's gradients instead,
    grpo.engines.images.vision_zero, which cannot match the sharded all-gathers' order)."""
    images = getattr(train_set, "images", None)
    bare = next((i for i, row in enumerate(images or []) if not row), None)
    if shards_weights(accelerator) and bare is not None:
        raise ConfigError(f"dataset row {bare} has no image: with sharded weights (FSDP2, ZeRO-3) a process whose "
                          "micro-batch has no image skips the vision tower's collective all-gathers and the run "
                          "hangs; give every row an image, or train with DDP (recipes/accelerate/ddp.yaml).")


def float32_reduce(policy):
    """FSDP2's mixed-precision policy `policy` with gradients reduce-scattered in float32 (verl's default):
    accelerate's `mixed_precision: bf16` reduces them in bf16, which loses precision as ranks add up. None (no
    mixed precision) and a policy that already reduces in float32 are returned as they are; reduce_dtype None
    means the param_dtype's."""
    if policy is None or policy.param_dtype in (None, torch.float32) or policy.reduce_dtype == torch.float32:
        return policy
    return dataclasses.replace(policy, reduce_dtype=torch.float32)


def reduce_in_float32(accelerator) -> None:
    """Under FSDP2 with mixed precision: the plugin's policy (the one `prepare` gives `fully_shard`) reduces
    gradients in float32. Before `prepare`."""
    if accelerator.distributed_type == "FSDP":
        plugin = accelerator.state.fsdp_plugin
        plugin.mixed_precision_policy = float32_reduce(plugin.mixed_precision_policy)


def place_reference(reference, accelerator):
    """The reference model on the run's device, sharded like the policy under FSDP2 and ZeRO-3."""
    if reference is None or hasattr(reference, "loaded"):  # (none, or the CPU engine's reference on disk)
        return reference
    if accelerator.distributed_type == "FSDP":
        from accelerate.utils import fsdp2_prepare_model

        return fsdp2_prepare_model(accelerator, reference).eval()
    if zero_stage(accelerator) == 3:
        import deepspeed

        # No optimizer: the training-only blocks go, as transformers and TRL drop them for an inference engine.
        config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
        for key in ("optimizer", "scheduler"):
            config.pop(key, None)
        config["zero_optimization"].pop("offload_optimizer", None)
        engine, *_ = deepspeed.initialize(model=reference, config=config)
        engine.eval()  # (DeepSpeed's eval() returns None)
        return engine
    return reference.to(accelerator.device)


def _local(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors behind `t` that this process holds."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return [t.to_local()]
    if hasattr(t, "ds_tensor"):  # ZeRO-3: its partition, and the whole data if it keeps it (a small, persistent one)
        return [t.ds_tensor, t.data]
    return [t]


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def local_bytes(model, optimizer) -> dict[str, int]:
    """Bytes of the weights and of the optimizer state this process holds, counted from the tensors themselves
    (under FSDP2 the local shards, under ZeRO-3 the partitions; each storage once, so the optimizer's master
    weights count only where they are a copy). `optimizer` as accelerate prepared it."""
    seen: set[int] = set()

    def size(tensors) -> int:
        total = 0
        for t in (local for t in tensors for local in _local(t)):
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen and storage.nbytes():
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    inner = optimizer
    while hasattr(inner, "optimizer"):  # accelerate's wrapper, DeepSpeed's ZeRO optimizer: the torch one inside
        inner = inner.optimizer
    weights = size(model.parameters())
    state = size(_tensors([group["params"] for group in inner.param_groups]))  # master copies, if any
    state += size(_tensors(list(inner.state.values())))
    return {"weights": weights, "optimizer": state}
