"""Which engine a run takes, by one rule, and the engine's two halves built for it.

    auto:   the CPU engine for a float32 model on the CPU in one unwrapped process (no DDP, FSDP or DeepSpeed);
            the transformers engine otherwise (a GPU, bfloat16 or float16 weights, several processes).
    cpu / transformers: that engine; `cpu` where it cannot run is an error that says why.

An engine is a rollout engine (`generate`: grpo.engines.base) and an update backend (log-probs and the loss's
backward: grpo.engines.policy). The trainer prints the choice and its reason at the start of a run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo.config import ConfigError
from grpo.engines.policy import TransformersBackend
from grpo.engines.sampling import TransformersSampler
from grpo.engines.sharding import WholeWeightsSampler, all_processes_stopped, sharding

ENGINES = ("auto", "transformers", "cpu")


@dataclass
class EngineChoice:
    name: str  # "cpu" or "transformers"
    reason: str  # why, in a few words: printed as "engine: NAME (REASON)"


def _architecture(model) -> str:
    config = getattr(model, "config", None)
    names = getattr(config, "architectures", None) or [type(model).__name__]
    return names[0].removesuffix("ForCausalLM")


def _dtype(model) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def choose_engine(requested: str, model, device: torch.device, processes: int, distributed: str,
                  mixed_precision: str = "no") -> EngineChoice:
    """The engine for `model` (loaded, not yet wrapped) trained on `device` by `processes` processes under
    accelerate's `distributed` type ("NO", "MULTI_CPU", "MULTI_GPU", "FSDP", "DEEPSPEED", ...) and
    `mixed_precision` ("no", "bf16", "fp16")."""
    dtype = str(_dtype(model)).removeprefix("torch.")
    arch = _architecture(model)
    blockers = [f"{mixed_precision} mixed precision"] if mixed_precision != "no" else []
    if device.type != "cpu":
        blockers.append(f"the model trains on {device.type}")
    if dtype != "float32":
        blockers.append(f"its weights are {dtype}")
    if processes > 1:
        blockers.append(f"{processes} processes")
    elif distributed != "NO":
        blockers.append(f"{distributed} wraps the model")
    if requested == "cpu" and blockers:
        raise ConfigError(f"engine: 'cpu' runs a float32 model on the CPU in one process, but here "
                          f"{', '.join(blockers)}; set engine to auto or transformers.")
    if requested in ("cpu", "transformers"):
        return EngineChoice(requested, f"engine={requested} in the config")
    if not blockers:
        return EngineChoice("cpu", f"float32 {arch} on CPU, 1 process")
    processes_text = f"{processes} process" + ("es" if processes > 1 else "")
    return EngineChoice("transformers", f"{device.type}, {dtype} {arch}, {processes_text}")


def make_engine(choice: EngineChoice, model, policy, accelerator, tokenizer, params, reference=None,
                generator=None, gather_for_generation: bool = True):
    """(rollout engine, update backend) for the choice. `model` is the policy as accelerate prepared it, `policy`
    the unwrapped module; `generator` a rollout engine of the caller's that replaces the built one."""
    generator = generator or make_sampler(choice, policy, tokenizer, model, gather_for_generation)
    if choice.name == "cpu":
        from grpo.engines.cpu import CPUBackend

        return generator, CPUBackend(policy, accelerator, generator, params, reference)
    return generator, TransformersBackend(model, accelerator)


def make_vllm(cfg, policy, tokenizer, accelerator):
    """The vLLM rollout engine (`use_vllm`): colocated, holding a copy of `policy`'s weights, or a client of a
    `grpo vllm-serve` server, into which the main process pushes them."""
    eos = [tokenizer.eos_token_id]
    if cfg.vllm_mode == "server":
        from grpo.engines.vllm_server import VLLMServerClient

        url = cfg.vllm_server_base_url or f"http://{cfg.vllm_server_host}:{cfg.vllm_server_port}"
        try:
            return VLLMServerClient(url, eos, cfg.vllm_server_timeout, push=accelerator.is_main_process,
                                    barrier=accelerator.wait_for_everyone if accelerator.num_processes > 1 else None)
        except ConnectionError as err:
            raise ConfigError(f"vllm_mode: server: {err}") from None
    from grpo.engines.vllm import VLLMEngine, VLLMUnavailable

    extra = dict(cfg.vllm_engine_kwargs)
    if accelerator.num_processes > 1:
        if cfg.vllm_tensor_parallel_size > 1:
            raise ConfigError("vllm_tensor_parallel_size: with several training processes each colocated engine "
                              "holds the whole model (tensor parallelism across them is not built yet); set it to 1, "
                              "or use vllm_mode: server with `grpo vllm-serve --tensor-parallel-size N`.")
        # One engine per process, on its own device, inside the process group the launcher made (as TRL does).
        extra.setdefault("distributed_executor_backend", "external_launcher")
    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    path = getattr(base.config, "_name_or_path", None) or cfg.model_name_or_path
    try:
        return VLLMEngine(path, policy, eos_ids=eos, dtype=_dtype(policy),
                          gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                          tensor_parallel_size=cfg.vllm_tensor_parallel_size, max_model_len=cfg.vllm_max_model_length,
                          enable_sleep_mode=cfg.vllm_enable_sleep_mode, model_impl=cfg.vllm_model_impl,
                          seed=cfg.seed, **extra)
    except VLLMUnavailable as err:
        raise ConfigError(f"use_vllm: {err}") from None
    except ValueError as err:  # (a setting vLLM refuses, named by the engine)
        raise ConfigError(str(err)) from None


def make_sampler(choice: EngineChoice, model, tokenizer, prepared=None, gather_for_generation: bool = True):
    """The choice's own rollout engine, sampling from `model` (unwrapped). When `prepared` (the model as accelerate
    prepared it) has sharded weights (FSDP2, ZeRO-3), it samples from whole weights gathered for each rollout and
    released after (`gather_for_generation`), or through the sharded model, every process stepping until all have
    stopped (each forward gathers: slower, within memory)."""
    pad, eos = tokenizer.pad_token_id, [tokenizer.eos_token_id]
    if choice.name == "cpu":
        from grpo.engines.cpu import CPUSampler

        return CPUSampler(model, pad, eos)
    if prepared is None or sharding(prepared) is None:
        return TransformersSampler(model, pad, eos)
    if gather_for_generation:
        return WholeWeightsSampler(TransformersSampler(model, pad, eos), prepared)
    return TransformersSampler(model, pad, eos, all_stopped=all_processes_stopped)
