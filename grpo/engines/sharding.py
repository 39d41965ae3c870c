"""Sharded weights (FSDP2, DeepSpeed ZeRO-3): the passes through a model that no process holds whole.

Under FSDP2 (`torch.distributed.fsdp.fully_shard`, which accelerate applies to each decoder layer) a parameter is a
DTensor holding this process's shard, gathered by the forward's hooks one layer at a time; under DeepSpeed ZeRO-3 a
parameter's data is empty outside its module's forward. Either way a forward is a sequence of collectives, so every
process must run the same forwards, and every function here that gathers is collective: every process calls it, in
the same order, whatever rows it holds.

- `sharding(model)`: "fsdp2", "zero3" or None.
- `whole_weights(model)`: a block in which the model holds its whole weights and its forwards communicate nothing,
  so each process samples on its own (TRL's `ds3_gather_for_generation`); the whole weights are released after.
- `WholeWeightsSampler` / `all_processes_stopped`: sampling from gathered weights, or through the sharded model with
  every process running until all have stopped (slower, within memory).
- `whole_tensors(model)` / `hf_weights(model)`: the weights gathered one tensor at a time (for saving, and for an
  engine that holds its own copy, such as vLLM).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator

import torch

from grpo.engines.base import EngineDefaults


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def sharding(model) -> str | None:
    """"fsdp2" when the model's parameters are FSDP2 DTensors, "zero3" when DeepSpeed ZeRO-3 partitions them, None
    when this process holds them whole (one process, DDP, ZeRO-1/2)."""
    for p in model.parameters():
        if _is_dtensor(p):
            return "fsdp2"
        if hasattr(p, "ds_id"):
            return "zero3"
    return None


def whole_numel(p: torch.Tensor) -> int:
    """A parameter's number of elements, whole (a ZeRO-3 parameter's own `numel` is its empty placeholder's)."""
    return getattr(p, "ds_numel", p.numel())


def is_peft(model) -> bool:
    return hasattr(model, "get_base_model") and hasattr(model, "peft_config")


# ---- whole weights for a block ---------------------------------------------------------------------------------
@contextlib.contextmanager
def whole_weights(model):
    """Every weight of `model` (as accelerate prepared it: the FSDP2 module, or the DeepSpeed engine) gathered whole
    for the block, and forwards that gather nothing, so processes may run different numbers of them; resharded on
    exit. Collective on entry and exit. A model whose weights are whole already is left as it is."""
    kind = sharding(model)
    if kind == "fsdp2":
        with _fsdp2_unsharded(model):
            yield
    elif kind == "zero3":
        with _zero3_gathered(model):
            yield
    else:
        yield


@contextlib.contextmanager
def _fsdp2_unsharded(model):
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if isinstance(model, FSDPModule):
        model._get_fsdp_state()._lazy_init()  # (settles the root's own resharding before it is saved below)
    # FSDP2 reshards a unit after its forward when its group has a post-forward mesh; with none, a forward of an
    # unsharded unit all-gathers nothing. The groups' settings are put back as they were.
    groups = [g for m in units for g in m._get_fsdp_state()._fsdp_param_groups]
    saved = [g.post_forward_mesh_info for g in groups]
    for m in units:
        m.unshard()
    for g in groups:
        g.post_forward_mesh_info = None
    try:
        yield
    finally:
        for g, info in zip(groups, saved):
            g.post_forward_mesh_info = info
        for m in units:
            m.reshard()


@contextlib.contextmanager
def _zero3_gathered(engine):
    """ZeRO-3: every parameter gathered, and the engine's module hooks (which fetch and release parameters around
    each submodule's forward) taken off for the block, as TRL's `unwrap_model_for_generation` does."""
    import deepspeed

    offload = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
    if offload is None:
        raise RuntimeError("whole_weights: a ZeRO-3 model is gathered through its training engine (the model as "
                           "accelerate prepared it, with its optimizer)")
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        for p in engine.module.parameters():
            p.ds_active_sub_modules.clear()
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            coordinator = offload.get_param_coordinator()
            if not coordinator.is_invalid_trace():  # the trace it recorded is of the training forwards
                coordinator._invalidate_trace()
            offload._register_deepspeed_module(offload.module)


class WholeWeightsSampler(EngineDefaults):
    """A rollout engine whose `generate` runs `sampler` on whole weights gathered for the call and released after
    (`ds3_gather_for_generation`). `model` is the policy as accelerate prepared it. Collective."""

    def __init__(self, sampler, model):
        self.sampler, self.model = sampler, model

    def generate(self, prompt_ids, params, seeds, **rows):  # (rows: each row's images, for a VLM)
        with whole_weights(self.model):
            return self.sampler.generate(prompt_ids, params, seeds, **rows)


def all_processes_stopped(done: torch.Tensor) -> bool:
    """Whether every row of every process has stopped: for sampling through sharded weights, where each token's
    forward is collective and a process whose rows have all ended keeps stepping until every process's have.
    `done` (N,) bool on the model's device. Collective."""
    flag = done.all().to(torch.int32).reshape(1)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


# ---- weights one tensor at a time --------------------------------------------------------------------------------
@contextlib.contextmanager
def _gathered(params: list):
    """ZeRO-3 parameters among `params` gathered for the block (FSDP2's DTensors are gathered by `_whole`)."""
    zero = [p for p in params if hasattr(p, "ds_id")]
    if not zero:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(zero):
        yield


def _whole(t: torch.Tensor, kind: str | None) -> torch.Tensor:
    """`t`'s whole value, inside `_gathered`: a tensor of its own when the model is sharded (so it outlives the
    gather), `t` itself otherwise."""
    if _is_dtensor(t):
        return t.full_tensor().detach()
    return t.detach().clone() if kind == "zero3" else t.detach()


class _Once:
    """A tensor under several names of a state dict (tied weights: embeddings = LM head) gathered once, and the
    same whole tensor given for each name, as it was one tensor in the model."""

    def __init__(self, entries: dict[str, torch.Tensor]):
        self.counts, self.values = Counter(id(t) for t in entries.values()), {}

    def __call__(self, tensor: torch.Tensor, gather: Callable[[], torch.Tensor]) -> torch.Tensor:
        if id(tensor) in self.values:
            return self.values[id(tensor)]
        value = gather()
        if self.counts[id(tensor)] > 1:
            self.values[id(tensor)] = value
        return value


def whole_tensors(model, keep: Callable[[str], bool] = lambda name: True) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) of each entry of `model.state_dict()` that `keep` accepts, gathered one at a time:
    a sharded model never holds more than one whole tensor here (and a tied one). Collective for a sharded model
    (`keep` must decide alike on every process)."""
    kind = sharding(model)
    entries = model.state_dict(keep_vars=True)
    once = _Once(entries)
    for name, tensor in entries.items():
        if keep(name):
            yield name, once(tensor, lambda: _gathered_whole([tensor], tensor, kind))


def _gathered_whole(params: list, tensor: torch.Tensor, kind: str | None, layer=None) -> torch.Tensor:
    """`tensor`'s whole value, with `params` gathered for it; plus `layer`'s active LoRA adapters merged in when
    given (each a delta, or DoRA's rescaled weight)."""
    with _gathered(params):
        base = value = _whole(tensor, kind)
        for adapter in layer.active_adapters if layer is not None else ():
            if adapter in layer.lora_A or adapter in layer.lora_embedding_A:
                delta = layer.get_delta_weight(adapter)  # (a DTensor under FSDP2: computed by its shards)
                delta = (delta.full_tensor() if _is_dtensor(delta) else delta).to(base.dtype)
                if adapter in getattr(layer, "lora_magnitude_vector", {}):  # DoRA: the base rescaled too
                    delta = _dora_merged(layer, adapter, base, delta) - base
                value = value + delta
    return value


def _dora_merged(layer, adapter: str, base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """DoRA's merged weight for one adapter, as peft's forward computes it (and `merge` writes it):
    W' = m / ||W + dW|| * (W + dW), the norm of each output row of the unmerged base W (peft's
    `DoraLinearLayer.get_weight_norm`), m the adapter's magnitude vector. Several adapters each rescale the base
    (peft's forward adds (m_a / n_a - 1) W + m_a / n_a dW_a per adapter), which the caller sums."""
    if type(layer.get_base_layer()) is not torch.nn.Linear:
        raise ValueError(f"hf_weights: DoRA on a {type(layer.get_base_layer()).__name__} layer is not merged here "
                         "(Linear layers only); target Linear modules with use_dora, or turn use_dora off.")
    magnitude = layer.lora_magnitude_vector[adapter]
    fan_in_fan_out = getattr(layer, "fan_in_fan_out", False)
    flip = (lambda t: t.T) if fan_in_fan_out else (lambda t: t)  # peft's `transpose(t, fan_in_fan_out)`
    m = magnitude.weight.full_tensor() if _is_dtensor(magnitude.weight) else magnitude.weight
    norm = magnitude.get_weight_norm(base, flip(delta), scaling=1).detach()  # (out,)
    return flip((m.detach().to(norm.dtype) / norm).view(-1, 1)).to(base.dtype) * (base + delta)


def hf_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights under the transformers names vLLM's `load_weights` expects, one tensor at a time, each
    gathered whole when the model is sharded (collective then). For a peft LoRA model: each adapted weight plus
    its active adapters' delta (the policy itself is not merged, so training goes on untouched; a LoRA layer's
    weights are gathered together), without the adapter tensors and with peft's `base_layer` / `modules_to_save`
    names undone."""
    if not is_peft(model):
        yield from whole_tensors(model)
        return
    base = model.get_base_model()  # the transformers model with peft's layers inside it: no "base_model.model."
    kind = sharding(base)
    modules = dict(base.named_modules())
    entries = base.state_dict(keep_vars=True)
    once = _Once(entries)
    for name, tensor in entries.items():
        if "lora_" in name or ".original_module." in name:
            continue  # adapter matrices; the frozen copy a modules_to_save wrapper keeps
        layer = modules.get(name.removesuffix(".base_layer.weight"))
        if name.endswith(".base_layer.weight") and hasattr(layer, "get_delta_weight") and not layer.merged:
            value = _gathered_whole(list(layer.parameters()), tensor, kind, layer)
        else:
            value = once(tensor, lambda: _gathered_whole([tensor], tensor, kind))
        name = name.replace(".base_layer.", ".").replace("_checkpoint_wrapped_module.", "")
        for adapter in model.peft_config:
            name = name.replace(f".modules_to_save.{adapter}.", ".")
        yield name, value
