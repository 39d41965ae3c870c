"""grpo: Group Relative Policy Optimization for language models.

    from grpo import GRPOConfig, GRPOTrainer

Names are imported lazily so that `import grpo.core` pulls in torch alone.
"""

__version__ = "0.1.0"
__all__ = ["GRPOConfig", "GRPOTrainer"]


def __getattr__(name: str):
    if name == "GRPOConfig":
        from grpo.config import GRPOConfig

        return GRPOConfig
    if name == "GRPOTrainer":
        from grpo.training.trainer import GRPOTrainer

        return GRPOTrainer
    raise AttributeError(f"module 'grpo' has no attribute {name!r}")
