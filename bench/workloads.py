"""The benchmark's workloads: one model architecture, one batch layout and one set of loss settings each.

Both sides get exactly these numbers (bench/side_grpo.py, bench/side_trl.py). Shapes: B prompts per step,
G completions per prompt, P prompt tokens, T completion tokens, V vocabulary, H hidden size, L layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    name: str
    vocab: int  # V: rows of the model's output layer; the tokenizer has one more token, EOS (see model_files.py)
    hidden: int = 256  # H
    layers: int = 4  # L
    heads: int = 4
    kv_heads: int = 4
    intermediate: int = 1024  # MLP width
    prompts_per_step: int = 2  # B
    num_generations: int = 8  # G
    completion_length: int = 64  # T, forced: no completion can end early
    prompt_length: int = 16  # P, every prompt has exactly this many tokens
    micro_batch: int = 8  # completions per forward/backward pass, both sides (a memory knob, not work)
    beta: float = 0.04
    num_iterations: int = 1  # optimizer updates per rollout batch (mu)
    lora_r: int = 0  # 0: train all weights; else LoRA of this rank on every linear layer but the output layer
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    learning_rate: float = 1e-6
    seed: int = 42
    # 0: EOS lies outside the model's vocabulary, so every completion has exactly T tokens (bench/model_files.py).
    # > 0: EOS is the model's last token, made likelier by this weight (bench/model_files.py), so completions end
    # where the model draws it: ragged, long-tailed lengths, the same distribution on every side.
    eos_weight: float = 0.0

    @property
    def ragged(self) -> bool:
        return self.eos_weight > 0

    @property
    def completions_per_step(self) -> int:
        return self.prompts_per_step * self.num_generations

    @property
    def completion_tokens_per_step(self) -> int:
        return self.completions_per_step * self.completion_length

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_W1 = Workload(name="W1", vocab=100)
WORKLOADS = {
    "W1": _W1,
    # Qwen2's vocabulary size is 151,936; 151,000 puts ~39M of the ~43M parameters in the (tied) embeddings.
    "W2": dataclasses.replace(_W1, name="W2", vocab=151_000),
    "W3": dataclasses.replace(_W1, name="W3", vocab=151_000, num_iterations=2, lora_r=16),
    # Ragged, long-tailed completions, as reasoning runs have. Measured (one rollout of the 64 on this model): 7-256
    # tokens, deciles 7 34 49 62 89 126 182, median 88, mean 117, 11 of 64 cut at 256; a pass padded to the longest
    # row of a micro-batch computes about twice the real tokens.
    "R1": dataclasses.replace(_W1, name="R1", vocab=1000, prompts_per_step=8, completion_length=256,
                              eos_weight=3.0),
    # The GPU check's (bench/gpu_check.py, check D): Qwen2.5-0.5B's shape with random weights (494M parameters),
    # 4 x 8 completions of 256 tokens, micro-batches of 8.
    "Q05": dataclasses.replace(_W1, name="Q05", vocab=151_936, hidden=896, layers=24, heads=14, kv_heads=2,
                               intermediate=4864, prompts_per_step=4, completion_length=256),
    # CI's miniature: the same code paths (reference model, micro-batching, two iterations) in seconds.
    "mini": Workload(name="mini", vocab=100, hidden=32, layers=1, heads=2, kv_heads=2, intermediate=64,
                     prompts_per_step=2, num_generations=2, completion_length=8, prompt_length=8, micro_batch=2,
                     num_iterations=2),
    "mini-ragged": Workload(name="mini-ragged", vocab=100, hidden=32, layers=1, heads=2, kv_heads=2, intermediate=64,
                            prompts_per_step=2, num_generations=2, completion_length=8, prompt_length=8,
                            micro_batch=2, eos_weight=1.0),
}


# The acceptance floors: (JSON key, "min" or "max", bound). Checked and reported, never asserted.
REQUIREMENTS = {
    "W1": [("speedup", "min", 1.5)],
    "W2": [("speedup", "min", 3.0), ("memory_ratio", "max", 0.6), ("grpo_floor_ratio", "max", 1.5)],
    "W3": [("speedup", "min", 2.0)],
}


def prompts(workload: Workload, n: int = 64) -> list[str]:
    """n distinct prompts of exactly P characters (= P tokens with the character tokenizer), so every step has the
    same shapes whatever order a trainer draws them in."""
    stem = "Tell a tale about "[: max(0, workload.prompt_length - 4)]
    out = [(stem + f"{i:04d}").rjust(workload.prompt_length, ".")[-workload.prompt_length:] for i in range(n)]
    if len(set(out)) != n:
        raise ValueError(f"prompts: prompt_length={workload.prompt_length} is too short for {n} distinct prompts.")
    return out


def reward_vowels(completions, **kwargs) -> list[float]:
    """Fraction of vowels in each completion: cheap, the same on both sides, TRL's reward signature."""
    return [sum(c in "aeiou" for c in text) / max(1, len(text)) for text in completions]
