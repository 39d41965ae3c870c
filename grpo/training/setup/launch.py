"""The process a run starts in: accelerate's Accelerator, the environment the distributed backends read, seeds,
DeepSpeed's auto values.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from grpo.config import ConfigError, GRPOConfig


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_accelerator(cfg: GRPOConfig):
    """accelerate's Accelerator for the config: mixed precision (bf16, fp16) and the CPU when asked or without a GPU."""
    from accelerate import Accelerator

    cuda = torch.cuda.is_available() and not cfg.use_cpu
    if cfg.fp16 and not cuda:
        raise ConfigError("fp16: float16 mixed precision needs a CUDA GPU (its loss scaler); use bf16 on the CPU.")
    precision = "bf16" if cfg.bf16 else "fp16" if cfg.fp16 else "no"
    from accelerate.state import AcceleratorState

    state = AcceleratorState._shared_state
    if state and (AcceleratorState().mixed_precision != precision or (AcceleratorState().device.type == "cpu") != (
            not cuda)):
        # An earlier trainer of this process (a notebook, a test) set another precision: accelerate keeps one per
        # process, so its state is reset (the process group, if any, is kept).
        AcceleratorState._reset_state(reset_partial_state=False)
    return Accelerator(cpu=not cuda, mixed_precision=precision)


def configure_process(cfg: GRPOConfig) -> None:
    """Process-wide settings the config asks for: threads, log levels, determinism, TF32."""
    import logging

    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    if cfg.log_level != "passive":
        from transformers.utils import logging as hf_logging

        level = getattr(logging, cfg.log_level.upper())
        logging.getLogger("grpo").setLevel(level)
        hf_logging.set_verbosity(level)
    if cfg.full_determinism:
        import os

        # As transformers' enable_full_determinism (TRL's), without CUDA_LAUNCH_BLOCKING (not needed once cuBLAS
        # has its workspace setting). Under the strict flag torch picks deterministic kernels where it has them:
        # index_add_ and scatter_add_ (the tiled head's backward) and sdpa's flash and mem-efficient backward on
        # CUDA (cuDNN attention is excluded); an op with none raises. The flash-attn package reads its own setting.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        os.environ.setdefault("FLASH_ATTENTION_DETERMINISTIC", "1")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    if cfg.tf32 is not None and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
        torch.backends.cudnn.allow_tf32 = cfg.tf32


def fill_deepspeed_auto(accelerator, cfg: GRPOConfig) -> None:
    """The DeepSpeed config's "auto" values that accelerate would read from a prepared dataloader (this loop has
    none): the micro-batch size and the gradient clipping."""
    if accelerator.distributed_type != "DEEPSPEED":
        return
    ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
    for key, value in (("train_micro_batch_size_per_gpu", cfg.per_device_train_batch_size),
                       ("gradient_clipping", cfg.max_grad_norm if cfg.max_grad_norm > 0 else 0.0)):
        if ds_config.get(key) in (None, "auto"):
            ds_config[key] = value
