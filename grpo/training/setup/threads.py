"""The torch thread count of a training process when `num_threads` is null: the machine's usable CPUs, shared.

torch's own default is one thread per core of the machine, whatever else runs there. On a 2-core machine the
README's Python example (a 1M-parameter model) took 5 min 18 s with it and 14 s with one thread: a small model's
operators are too short for a second thread to pay its synchronisation, and a thread that shares its core with
another process (a second rank, the rollout worker, a reward pool) stalls every operator of the step. So:

- `OMP_NUM_THREADS` set (torchrun sets 1 when it starts several processes): torch's count stands, as asked;
- decoder layers of at most SMALL_LAYER_BYTES: 1 thread (per-operator overhead, not arithmetic, bounds their
  steps; the CPU engine's C decoding step is single-threaded below the same size: grpo.engines.cpu.native);
- otherwise the usable CPUs (this process's affinity, within a cgroup's CPU quota) divided among the processes
  this run starts on the machine: LOCAL_WORLD_SIZE ranks, each with its rollout worker when max_staleness > 0.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

SMALL_LAYER_BYTES = 32 * 2**20  # (grpo.engines.cpu.native._ANY_THREADS_BYTES: measured there, 17 MB layers)


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask, capped by a cgroup v2 CPU quota (a container's
    `--cpus`), which the mask does not show."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # (no affinity call on this platform)
        count = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            count = min(count, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return count


def layer_bytes(model) -> int:
    """The mean size of one decoder layer in bytes (all parameters over num_hidden_layers, embeddings included)."""
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", None) or getattr(getattr(config, "text_config", None),
                                                                   "num_hidden_layers", None) or 1
    return sum(p.numel() * p.element_size() for p in model.parameters()) // layers


def auto_threads(model, processes: int) -> int:
    """The thread count for `model` in one of `processes` busy processes on this machine (the module's rules)."""
    if layer_bytes(model) <= SMALL_LAYER_BYTES:
        return 1
    return max(1, usable_cpus() // max(1, processes))


def set_threads(num_threads: int | None, model, max_staleness: int = 0) -> int:
    """torch's intra-op threads for this process: `num_threads`, or when None the module's choice. Returns the
    count."""
    if num_threads is None and "OMP_NUM_THREADS" not in os.environ:
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        num_threads = auto_threads(model, ranks * (2 if max_staleness > 0 else 1))
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    return torch.get_num_threads()
