"""Which engine a run takes, by one rule, and the engine's two halves built for it.

    auto:   the CPU engine for a float32 model on the CPU in one unwrapped process (no DDP, FSDP or DeepSpeed);
            the transformers engine otherwise (a GPU, bfloat16 or float16 weights, several processes).
    cpu / transformers: that engine; `cpu` where it cannot run is an error that says why.

An engine is a rollout engine (`generate`: grpo.engines.base) and an update backend (log-probs and the loss's
backward: grpo.engines.policy). The trainer prints the choice and its reason at the start of a run.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass

import torch

from grpo.config import ConfigError
from grpo.engines.base import as_engine
from grpo.engines.images import is_vision_config
from grpo.engines.policy import TransformersBackend
from grpo.engines.sampling import TransformersSampler
from grpo.engines.expert_parallel import is_split
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
    vision = is_vision_config(getattr(model, "config", None))
    if vision:
        blockers.append("it is a vision-language model")  # (the CPU engine's passes take no image features)
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
    return EngineChoice("transformers", f"{device.type}, {dtype} {arch}, {processes_text}"
                                        + (", vision-language" if vision else ""))


def make_engine(choice: EngineChoice, model, policy, accelerator, tokenizer, params, reference=None,
                generator=None, gather_for_generation: bool = True, sp=None, offload: bool = False):
    """(rollout engine, update backend) for the choice. `model` is the policy as accelerate prepared it, `policy`
    the unwrapped module; `generator` a rollout engine of the caller's that replaces the built one; `sp`: this
    process's sequence-parallel group (grpo.engines.ulysses.SequenceGroup), or None; `offload`: the update's saved
    activations in host memory (grpo.engines.offload; the CPU engine's are there already)."""
    generator = as_engine(generator) if generator is not None else make_sampler(choice, policy, tokenizer, model,
                                                                                 gather_for_generation)
    if choice.name == "cpu":
        from grpo.engines.cpu import CPUBackend

        return generator, CPUBackend(policy, accelerator, generator, params, reference)
    return generator, TransformersBackend(model, accelerator, sp, offload)


LOCAL_HOSTS = ("0.0.0.0", "127.0.0.1", "localhost", "::", "::1")


def machines() -> int:
    """How many machines the launcher started this run on (torchrun and accelerate set both sizes)."""
    import os

    world = int(os.environ.get("WORLD_SIZE", 1))
    return max(1, world // max(int(os.environ.get("LOCAL_WORLD_SIZE", world)), 1))


def vllm_dtype(policy, mixed_precision: str) -> str:
    """The dtype a colocated engine runs in: the one the trainer computes its forward in, i.e. the autocast
    dtype under bf16 / fp16 mixed precision (not the float32 of the master weights: a float32 engine would
    sample at float32's speed and memory), else the weights' own."""
    if mixed_precision in ("bf16", "fp16"):
        return {"bf16": "bfloat16", "fp16": "float16"}[mixed_precision]
    return str(_dtype(policy)).removeprefix("torch.")


def make_vllm(cfg, policy, tokenizer, accelerator, rows: int | None = None):
    """The vLLM rollout engine (`use_vllm`): colocated, holding a copy of `policy`'s weights, or a client of a
    `grpo vllm-serve` server, into which the main process pushes them. `rows`: the completions one process
    generates per rollout (the engine's max_num_seqs, as TRL sets it)."""
    eos = [tokenizer.eos_token_id]
    if cfg.vllm_mode == "server":
        return _server_client(cfg, policy, eos, accelerator)
    from grpo.engines.vllm import VLLMEngine, VLLMUnavailable

    if cfg.vllm_tensor_parallel_size > 1:
        # vLLM's tensor parallelism beside a trainer means one engine shard per training process (TRL: a TP
        # group of processes under external_launcher); in one process its workers would be other processes, and
        # every weight update would pickle the whole model to them.
        raise ConfigError("vllm_tensor_parallel_size: a colocated engine runs on its own process's device (tensor "
                          "parallelism across training processes is not built); set it to 1, or use vllm_mode: "
                          "server with `grpo vllm-serve --tensor-parallel-size N`.")
    # TRL's settings (trl/generation/vllm_generation.py): the engine never holds more sequences than one rollout
    # has, and a 4096-token batch keeps vLLM's memory profile (at its 8192 default or more) from leaving no room
    # for the KV cache beside a trainer. external_launcher: the engine's one worker is this process, in the
    # process group the launcher made (one process: rank 0 of 1).
    extra = {"max_num_batched_tokens": 4096, "distributed_executor_backend": "external_launcher",
             **({"max_num_seqs": rows} if rows else {}), **cfg.vllm_engine_kwargs}
    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    path = getattr(base.config, "_name_or_path", None) or cfg.model_name_or_path
    try:
        return VLLMEngine(path, policy, eos_ids=eos,
                          dtype=vllm_dtype(policy, getattr(accelerator, "mixed_precision", "no")),
                          gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                          tensor_parallel_size=cfg.vllm_tensor_parallel_size, max_model_len=cfg.vllm_max_model_length,
                          enable_sleep_mode=cfg.vllm_enable_sleep_mode, model_impl=cfg.vllm_model_impl,
                          seed=cfg.seed, per_row_seeds=per_row_seeds(cfg, accelerator.device), **extra)
    except VLLMUnavailable as err:
        raise ConfigError(f"use_vllm: {err}") from None
    except ValueError as err:  # (a setting vLLM refuses, named by the engine)
        raise ConfigError(str(err)) from None


def per_row_seeds(cfg, device) -> bool:
    """vllm_per_row_seeds, null resolved: on on the CPU (where the row-by-row draw costs little beside the model),
    off on accelerators (vLLM's batched sampler)."""
    return cfg.vllm_per_row_seeds if cfg.vllm_per_row_seeds is not None else torch.device(device).type == "cpu"


def server_urls(cfg) -> list[str]:
    """The servers of `vllm_mode: server`: vllm_server_base_url (a URL, a list of them, or URLs separated by
    commas), else vllm_server_host (a host or several separated by commas, each `host` or `host:port`, the port
    vllm_server_port where none is given)."""
    def names(value) -> list[str]:
        return [v.strip() for v in (value.split(",") if isinstance(value, str) else value) if str(v).strip()]

    if cfg.vllm_server_base_url:
        urls = [url.rstrip("/") for url in names(cfg.vllm_server_base_url)]
        local = [u for u in urls if urllib.parse.urlsplit(u).hostname in LOCAL_HOSTS]
    else:
        hosts = names(cfg.vllm_server_host)
        urls = [f"http://{h}" if h.count(":") == 1 else f"http://{h}:{cfg.vllm_server_port}" for h in hosts]
        local = [h for h in hosts if h.split(":")[0] in LOCAL_HOSTS or h in LOCAL_HOSTS]
    if not urls:
        raise ConfigError("vllm_server_base_url / vllm_server_host: no server named; give its URL or host.")
    if len(set(urls)) < len(urls):
        raise ConfigError(f"vllm_server_base_url / vllm_server_host: a server named twice ({', '.join(urls)}).")
    if local and machines() > 1:
        raise ConfigError(f"vllm_server_base_url: this run spans {machines()} machines, and {local[0]!r} would point "
                          f"each one at itself; set vllm_server_base_url (or vllm_server_host) to the server's "
                          f"address.")
    return urls


def _server_client(cfg, policy, eos: list[int], accelerator):
    from grpo.engines.vllm_fleet import VLLMFleet

    urls = server_urls(cfg)
    together = {}
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list, gather_object

        together = {"gather": gather_object, "share": lambda parts: broadcast_object_list([parts])[0]}
    try:
        client = VLLMFleet(urls, eos, cfg.vllm_server_timeout, push=accelerator.is_main_process,
                           barrier=accelerator.wait_for_everyone if accelerator.num_processes > 1 else None,
                           transport=cfg.vllm_weight_transfer, group_port=cfg.vllm_group_port,
                           device=accelerator.device, per_row_seeds=cfg.vllm_per_row_seeds,
                           rank=accelerator.process_index, processes=accelerator.num_processes, **together)
    except ConnectionError as err:
        raise ConfigError(f"vllm_mode: server: {err}") from None
    # The server holds whatever it was last given (the checkpoint it loaded, or an earlier run's weights): the
    # first rollout must sample from this policy, a resumed or LoRA-wrapped one included.
    client.update_weights(policy)
    return client


def make_sampler(choice: EngineChoice, model, tokenizer, prepared=None, gather_for_generation: bool = True):
    """The choice's own rollout engine, sampling from `model` (unwrapped). When `prepared` (the model as accelerate
    prepared it) has sharded weights (FSDP2, ZeRO-3), it samples from whole weights gathered for each rollout and
    released after (`gather_for_generation`), or through the sharded model, every process stepping until all have
    stopped (each forward gathers: slower, within memory)."""
    pad, eos = tokenizer.pad_token_id, [tokenizer.eos_token_id]
    if choice.name == "cpu":
        from grpo.engines.cpu import CPUSampler

        return CPUSampler(model, pad, eos)
    if prepared is None or sharding(prepared) is None:  # (split experts: every process steps until all stop)
        return TransformersSampler(model, pad, eos, all_stopped=all_processes_stopped if is_split(model) else None)
    if gather_for_generation:
        return WholeWeightsSampler(TransformersSampler(model, pad, eos), prepared)
    return TransformersSampler(model, pad, eos, all_stopped=all_processes_stopped)
