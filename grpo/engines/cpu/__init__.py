"""The CPU engine: compiled and fused paths for training a float32 model in one process on the CPU.

`CPUSampler` (the rollout) and `CPUBackend` (the update) compute what the transformers engine computes, up to float32
rounding, faster on a CPU; see README.md beside this file for what each path saves and when it applies.
"""

from grpo.engines.cpu.backend import CPUBackend
from grpo.engines.cpu.sampler import CPUSampler

__all__ = ["CPUBackend", "CPUSampler"]
