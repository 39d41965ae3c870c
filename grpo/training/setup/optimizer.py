"""The optimizer and its learning-rate schedule (transformers' schedules by name), and the warning for weights that
a low-precision optimizer step would round away.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable

import torch

from grpo.config import GRPOConfig


def make_schedule(cfg: GRPOConfig, total: int) -> Callable[[int], float]:
    """The learning-rate factor of optimizer step `step` of `total`, after linear warmup (warmup_steps, a fraction
    of the steps below 1, else warmup_ratio), as transformers' schedules of the same names."""
    steps = cfg.warmup_steps
    warmup = math.ceil(steps * total) if 0 < steps < 1 else int(steps) or int(cfg.warmup_ratio * total)
    kwargs = cfg.lr_scheduler_kwargs or {}
    cycles = kwargs.get("num_cycles", 0.5)
    floor = kwargs["min_lr"] / cfg.learning_rate if "min_lr" in kwargs else kwargs.get("min_lr_rate", 0.0)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if cfg.lr_scheduler_type in ("constant", "constant_with_warmup"):
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        if cfg.lr_scheduler_type == "linear":
            return max(0.0, 1.0 - progress)
        cosine = 0.5 * (1.0 + math.cos(math.pi * 2.0 * cycles * min(1.0, progress)))
        if cfg.lr_scheduler_type == "cosine_with_min_lr":
            return floor + (1.0 - floor) * cosine
        return max(0.0, cosine)

    return factor


def make_optimizer(model, cfg: GRPOConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters. The fused implementation (one kernel per step instead of a dozen
    elementwise passes; 0.06 s instead of 0.30 s for 43M float32 parameters on one CPU core) where every parameter
    is a plain float tensor on CPU or CUDA, the default implementation otherwise."""
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs = dict(lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon,
                  weight_decay=cfg.weight_decay)
    fusable = bool(params) and all(type(p.data) is torch.Tensor and p.is_floating_point()
                                   and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(params, fused=True if fusable else None, **kwargs)


def rounded_away(params, lr: float, sample: int = 2**16) -> float:
    """The share of the low-precision (bfloat16, float16) elements of `params` that a step of size `lr` leaves
    unchanged: w + lr rounds back to w in the parameter's dtype (it does when lr is under half a unit in the last
    place of w: bf16 at |w| = 0.02 takes steps of 6e-5 or more). Estimated from each tensor's first `sample`
    elements; 0 when no parameter is low precision."""
    same = total = 0
    for p in params:
        if p.dtype in (torch.bfloat16, torch.float16) and p.device.type != "meta":  # (meta: loaded on another rank)
            w = p.detach().reshape(-1)[:sample]
            same += int(((w.float() + lr).to(p.dtype) == w).sum())
            total += w.numel()
    return same / total if total else 0.0


def warn_low_precision_training(model, optimizer, cfg: GRPOConfig, distributed_type: str, mixed_precision: str):
    """Warn when a torch optimizer steps bfloat16/float16 trainable weights with no float32 master copy (TRL trains
    the same way when told `dtype: bfloat16`, so this is a warning, not a refusal): small steps round away. DeepSpeed
    keeps float32 master weights in its optimizer, and FSDP2 with mixed precision upcasts trainable weights."""
    low = [p for p in model.parameters() if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16)]
    master_copy = distributed_type == "DEEPSPEED" or (distributed_type == "FSDP" and mixed_precision != "no")
    if not low or master_copy or not type(optimizer).__module__.startswith("torch.optim"):
        return
    lost, dtype = rounded_away(low, cfg.learning_rate), str(low[0].dtype).removeprefix("torch.")
    warnings.warn(f"torch_dtype: {dtype} trainable weights are stepped by {type(optimizer).__name__} with no "
                  f"float32 master copy; at learning_rate {cfg.learning_rate:g} a step of that size leaves "
                  f"{lost:.1%} of them unchanged (rounded away). Set torch_dtype: float32 and bf16: true (bf16 "
                  "compute over float32 weights, as TRL and verl train), or train under DeepSpeed ZeRO or FSDP2 with "
                  "mixed precision, which keep float32 master weights.", stacklevel=3)
