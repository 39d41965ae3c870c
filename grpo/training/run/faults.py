"""Engine faults: a rollout or an update that runs out of memory, or a vLLM engine that dies, ends the run with one
error naming the setting to change (`EngineFailed`, exit status 1). Nothing is written after the fault, so the
checkpoints written before it are intact and the run resumes from the newest once the setting is changed."""

from __future__ import annotations

import contextlib

import torch

from grpo.training.checkpoint.files import complete_checkpoints
from grpo.training.run.errors import EngineFailed, TrainingStopped, resume_hint

_UPDATE = ("lower per_device_train_batch_size (gradient_accumulation_steps keeps the batch: the same run, in smaller "
           "passes), or set gradient_checkpointing: true, or lower max_completion_length")
_SAMPLER = ("lower generation_batch_size (or prompts_per_step: the completions a rollout samples at once) or "
            "max_completion_length")


def is_out_of_memory(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and "out of memory" in str(err).lower())


def _from_vllm(err: BaseException) -> bool:
    return type(err).__module__.split(".")[0] == "vllm"


def engine_failure(err: BaseException, cfg, phase: str) -> EngineFailed | None:
    """The run-ending error for `err`, raised in `phase` (generation, update), or None when it is no engine fault."""
    vllm = cfg.use_vllm and phase == "generation"
    first = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
    if isinstance(err, TrainingStopped):
        return None
    if is_out_of_memory(err):
        what = f"out of device memory in {phase} ({type(err).__name__}: {first})"
        if vllm and cfg.vllm_mode == "server":
            advice = "give the vLLM server more memory (grpo vllm-serve --gpu-memory-utilization) or " + _SAMPLER
        elif vllm:
            advice = (f"vLLM holds vllm_gpu_memory_utilization={cfg.vllm_gpu_memory_utilization} of the device: "
                      "raise it if its KV cache is short, or " + _SAMPLER)
        elif cfg.use_vllm:  # the update, beside a colocated vLLM engine
            advice = (f"lower vllm_gpu_memory_utilization (now {cfg.vllm_gpu_memory_utilization}: vLLM's share, "
                      "which the update cannot use), or " + _UPDATE)
        else:
            advice = _SAMPLER if phase == "generation" else _UPDATE
    elif _from_vllm(err) or (vllm and cfg.vllm_mode == "server" and isinstance(err, ConnectionError)):
        what = f"the vLLM engine failed in {phase} ({type(err).__name__}: {first})"
        advice = ("its log above says why; an engine that ran out of memory needs a lower "
                  f"vllm_gpu_memory_utilization (now {cfg.vllm_gpu_memory_utilization}) or vllm_max_model_length"
                  if cfg.vllm_mode != "server" else "restart `grpo vllm-serve`, and see its log for why it stopped")
    else:
        return None
    found = complete_checkpoints(cfg.output_dir)
    last = (f"{found[-1][1]} is intact; resume from it: {resume_hint()}" if found else
            "no checkpoint was written before it")
    return EngineFailed(f"{what}: {advice}. {last}.")


@contextlib.contextmanager
def engine_faults(cfg, phase: str):
    """Turn an engine fault raised inside the block into EngineFailed (other errors pass as they are)."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - re-raised unless it is an engine fault
        failure = engine_failure(err, cfg, phase)
        if failure is None:
            raise
        raise failure from err
