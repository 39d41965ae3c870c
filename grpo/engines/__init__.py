"""Rollout engines and update backends behind narrow interfaces (see base.py, policy.py and select.py).

transformers: `sampling.TransformersSampler` and `policy.TransformersBackend`, any model on any device.
cpu:          `cpu.CPUSampler` and `cpu.CPUBackend`, compiled paths for a float32 model in one process on the CPU.
Backends are imported when chosen, so `import grpo.engines` pulls in neither the CPU engine nor any other.
"""
