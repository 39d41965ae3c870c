"""Activation offload: what the update's forward saves for backward waits in host memory instead of the device's.

A long completion's update keeps, per layer, activations that grow with its tokens until backward uses them. With
`activation_offloading: true` (TRL's key for SFT and DPO; verl's `enable_activation_offload`) the update's forward
runs under saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`, the mechanism of torch's `save_on_cpu`,
torchtune's and TRL's `OffloadActivations` and verl's offload): each tensor autograd saves on an accelerator is
copied to pinned host memory as it is saved, and copied back when backward unpacks it. The device then holds the
activations of the operations running at that moment, not those of the whole pass.

Left where they are: parameters and views of them (their memory is on the device anyway; an FSDP2 layer's
gathered weights are parameters too), and tensors under `MIN_BYTES` (the copy's overhead is more than it saves).
With gradient checkpointing the layers save only their inputs, through the checkpoint's own saved tensors, and those
move too: per-layer input offload, verl's pairing of the two. Both copies are asynchronous on the current stream
(pinned memory): the device's allocator does not hand a freed block to later work before the copy that reads it.

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


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """A context manager: tensors saved for backward inside it move to host memory until backward needs them.

    `model`: its parameters stay on the device (checked by storage, so their views do too). Use around the forward
    only; the saved tensors carry their unpacking with them, so backward may run after the block has closed."""

    def __init__(self, model: torch.nn.Module | None = None, min_bytes: int = MIN_BYTES):
        self.min_bytes = min_bytes
        self.weights = set() if model is None else {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.stats = OffloadStats()
        super().__init__(self.pack, self.unpack)

    def eligible(self, tensor: torch.Tensor) -> bool:
        """Whether a saved tensor is one to keep in host memory: big enough and not a parameter (wherever it is)."""
        return (tensor.numel() * tensor.element_size() >= self.min_bytes and not _is_parameter(tensor)
                and tensor.untyped_storage().data_ptr() not in self.weights)

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
        pin = tensor.device.type == "cuda"
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin)
        host.copy_(tensor, non_blocking=pin)  # (a dense copy: a saved view does not keep its whole base on the host)
        return tensor.device, host

    @staticmethod
    def _on_host(tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    @staticmethod
    def unpack(packed):
        """The unpack hook: the saved tensor, back on its device."""
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=host.is_pinned())
