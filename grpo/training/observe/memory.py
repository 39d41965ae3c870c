"""Peak accelerator memory per optimizer step, for the step's metrics (`memory/peak_gib`).

CUDA only: the most memory the caching allocator handed to tensors on this process's device between the step's
start and its end (`torch.cuda.max_memory_allocated`, its peak reset at each step's start), in GiB. Both calls read
the allocator's counters on the host: no synchronisation with the device. Nothing on the CPU, where the allocator
keeps no such counter (the process's resident memory is the operating system's to report). A rollout worker in its
own process (`max_staleness` > 0) and a vLLM server are other processes: their memory is not in this figure.
"""

from __future__ import annotations

import torch


def reset_peak_memory(device: torch.device) -> None:
    """Start counting this step's peak on `device` (nothing on a device without a CUDA allocator)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_metrics(device: torch.device) -> dict[str, float]:
    """{"memory/peak_gib": the peak since reset_peak_memory(device)} on CUDA; {} elsewhere."""
    if device.type != "cuda":
        return {}
    return {"memory/peak_gib": torch.cuda.max_memory_allocated(device) / 2**30}
