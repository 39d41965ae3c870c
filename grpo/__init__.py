"""grpo: Group Relative Policy Optimization for language models.

    from grpo import GRPOConfig, GRPOTrainer

Names are imported lazily so that `import grpo.core` pulls in torch alone.
"""

import logging

__version__ = "0.1.0"
__all__ = ["GRPOConfig", "GRPOTrainer"]

# accelerate imports DeepSpeed wherever it is installed (unwrap_model, extract_model_from_parallel), and that import
# logs "Setting accelerator to CPU ..." on every machine without CUDA, where grpo runs on the CPU anyway. A filter,
# not a level: DeepSpeed sets its logger's level when it creates it. Its other messages still print.
logging.getLogger("DeepSpeed").addFilter(
    lambda record: not record.getMessage().startswith("Setting accelerator to CPU"))


def __getattr__(name: str):
    if name == "GRPOConfig":
        from grpo.config import GRPOConfig

        return GRPOConfig
    if name == "GRPOTrainer":
        from grpo.training.trainer import GRPOTrainer

        return GRPOTrainer
    raise AttributeError(f"module 'grpo' has no attribute {name!r}")
