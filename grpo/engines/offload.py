"""Activation offload: what the update's forward saves for backward waits in host memory instead of the device's.

A long completion's update keeps, per layer, activations that grow with its tokens until backward uses them. With
`activation_offloading: true` (TRL's key for SFT and DPO; verl's `enable_activation_offload`) the update's forward
runs under saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`, the mechanism of torch's `save_on_cpu`,
torchtune's and TRL's `OffloadActivations` and verl's offload): each tensor autograd saves on an accelerator is
copied to pinned host memory as it is saved, and copied back when backward unpacks it. The device then holds the
activations of the operations running at that moment, not those of the whole pass.

Left where they are: parameters and views of them (their memory is on the device anyway; an FSDP2 layer's
gathered weights are parameters too; an FSDP2 model's own parameters are DTensors, read through their local shard),
autocast's casts of the weights (fp32 weights under bf16 autocast: the bf16 copy autocast keeps for the pass, 1.7x
the bf16 weights of a Qwen2 if moved), and tensors under `MIN_BYTES` (the copy's overhead is more than it saves).
With gradient checkpointing the layers save only their inputs, through the checkpoint's own saved tensors, and those
move too: per-layer input offload, verl's pairing of the two.

On CUDA the copy to host memory runs on a side stream (TRL's `use_streams`), so it overlaps the forward's next
kernels: the side stream waits for the tensor to be written, the allocator is told the side stream reads the
tensor's block (`record_stream`: not reused before the copy ends), and the copy back in backward, on the compute
stream, waits for the copy's event. Both copies use pinned memory, whose caching allocator does not reuse a block
before the copies that read it end.

On the CPU every tensor is in host memory already: the hooks move nothing and count what they saw (`stats`), so a
CPU run can show that they are applied and that gradients are unchanged, but not the device memory they spare.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_BYTES = 2**16
"""Saved tensors smaller than this (64 KiB) stay on the device: position ids, norms' statistics, small masks."""


@dataclass
class OffloadStats:
    """What the hooks of one `ActivationOffload` saw: saved tensors and their bytes, the part moved to host memory,
    and the bytes that would have moved but were in host memory already (a CPU pass)."""

    saved: int = 0
    saved_bytes: int = 0
    moved: int = 0
    moved_bytes: int = 0
    on_host_bytes: int = 0


def _is_parameter(tensor: torch.Tensor) -> bool:
    """A parameter or a view of one (F.linear saves weight.t(), a view whose base is the parameter)."""
    return isinstance(tensor, torch.nn.Parameter) or isinstance(getattr(tensor, "_base", None), torch.nn.Parameter)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, else the tensor: an FSDP2 parameter is a DTensor, whose own storage cannot be read
    ("Attempted to access the data pointer on an invalid python storage"); TRL's OffloadActivations does the same."""
    return getattr(tensor, "_local_tensor", tensor)


# The autograd nodes a weight's autocast cast reaches its parameter through: the cast, then views of it (F.linear
# saves weight.t() of the cast).
_CAST_OR_VIEW = frozenset({"ToCopyBackward0", "TBackward0", "TransposeBackward0", "ViewBackward0",
                           "PermuteBackward0", "UnsafeViewBackward0", "ExpandBackward0"})


def _cast_of_parameter(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a cast (or a view of a cast) of a trainable parameter: autocast's bf16 copy of an fp32
    weight, which autocast keeps for the whole forward anyway (its cache), so moving it only adds traffic."""
    node = tensor.grad_fn
    for _ in range(4):
        if node is None or type(node).__name__ not in _CAST_OR_VIEW:
            return node is not None and isinstance(getattr(node, "variable", None), torch.nn.Parameter)
        node = node.next_functions[0][0] if node.next_functions else None
    return False


_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device):
    """One copy stream per CUDA device, made once (a stream per micro-batch would take a new one from the pool)."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """A context manager: tensors saved for backward inside it move to host memory until backward needs them.

    `model`: its parameters stay on the device (checked by storage, so their views do too). Use around the forward
    only; the saved tensors carry their unpacking with them, so backward may run after the block has closed."""

    def __init__(self, model: torch.nn.Module | None = None, min_bytes: int = MIN_BYTES):
        self.min_bytes = min_bytes
        params = [] if model is None else list(model.parameters())
        self.weights = {_local(p).untyped_storage().data_ptr() for p in params}
        # a frozen weight's cast has no autograd node to be recognised by: its shape, or its transpose's, does
        self.frozen_shapes = {shape for p in params if not p.requires_grad and p.dim() == 2
                              for shape in (p.shape, p.shape[::-1])}
        self.stats = OffloadStats()
        super().__init__(self.pack, self.unpack)

    def eligible(self, tensor: torch.Tensor) -> bool:
        """Whether a saved tensor is one to keep in host memory: big enough, neither a parameter (wherever it is)
        nor autocast's cast of one."""
        if tensor.numel() * tensor.element_size() < self.min_bytes or _is_parameter(tensor):
            return False
        if _local(tensor).untyped_storage().data_ptr() in self.weights or _cast_of_parameter(tensor):
            return False
        return not (tensor.grad_fn is None and tensor.shape in self.frozen_shapes)

    def pack(self, tensor: torch.Tensor):
        """The pack hook: `tensor` itself, or (its device, a host copy) for an eligible tensor on an accelerator."""
        nbytes = tensor.numel() * tensor.element_size()
        self.stats.saved += 1
        self.stats.saved_bytes += nbytes
        if not self.eligible(tensor):
            return tensor
        if self._on_host(tensor):
            self.stats.on_host_bytes += nbytes
            return tensor
        self.stats.moved += 1
        self.stats.moved_bytes += nbytes
        cuda = self._on_cuda(tensor)
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=cuda)
        if not cuda:
            host.copy_(tensor)  # (a dense copy: a saved view does not keep its whole base on the host)
            return tensor.device, host, None
        side = _side_stream(tensor.device)
        side.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor is written before it is read
        with torch.cuda.stream(side):
            host.copy_(tensor, non_blocking=True)
            copied = side.record_event()
        tensor.record_stream(side)  # its block is not handed to later work before the copy has read it
        return tensor.device, host, copied

    @staticmethod
    def _on_host(tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    @staticmethod
    def _on_cuda(tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda"

    @staticmethod
    def unpack(packed):
        """The unpack hook: the saved tensor, back on its device (on CUDA after the copy out has ended)."""
        if isinstance(packed, torch.Tensor):
            return packed
        device, host, copied = packed
        if copied is not None:
            torch.cuda.current_stream(device).wait_event(copied)
        return host.to(device, non_blocking=host.is_pinned())
