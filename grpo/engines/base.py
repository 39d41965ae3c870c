"""The rollout interface: prompt token ids, sampling settings and per-row seeds in; completions out.

Every rollout engine (`grpo.engines.sampling.TransformersSampler`, the CPU engine's `CPUSampler`, a scripted one
for tests, vLLM later) implements `generate`, and `update_weights` when it holds a copy of the policy's weights
that must follow the optimizer. Each row draws from its own random stream, seeded by the caller from the run seed,
the step and the row's global index, so a completion does not depend on which other rows share its batch or process:
1 and N processes sample the same completions, and a resumed run needs no generator state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch


@dataclass
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def unfiltered(self) -> bool:
        """Whether tokens are drawn from the tempered distribution itself (no top-k/top-p/min-p/penalty)."""
        return (self.temperature > 0 and self.top_k == 0 and self.top_p == 1.0 and self.min_p == 0.0
                and self.repetition_penalty == 1.0)


@dataclass
class Completions:
    """Generated token ids, one list per prompt row; EOS is kept when the row stopped on it."""

    ids: list[list[int]]
    truncated: list[bool]  # True when the row hit max_new_tokens without EOS
    logprobs: list[list[float]] | None = None  # per token, under the distribution actually sampled from
    # an MoE model's experts per token (prompt + completion tokens, layers, top-k) uint8 (grpo.engines.moe)
    routes: list[torch.Tensor] | None = None


class RolloutEngine(Protocol):
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, seeds: list[int]) -> Completions: ...


def update_weights(engine, model) -> None:
    """Tell `engine` the policy's weights changed (after an optimizer step): an engine that samples from its own copy
    of the weights (vLLM) loads them; one that samples from the policy itself has no `update_weights`."""
    update = getattr(engine, "update_weights", None)
    if update is not None:
        update(model)


def sleep(engine) -> None:
    """Let `engine` free its device memory while the update runs (vLLM's sleep mode), where it can."""
    getattr(engine, "sleep", lambda: None)()


def wake(engine) -> None:
    """Take back what `sleep` freed, before the next rollout."""
    getattr(engine, "wake", lambda: None)()


def row_seed(seed: int, step: int, row: int) -> int:
    """The sampling seed of one completion: a function of the run seed, the step and the row's global index."""
    return (seed * 1_000_003 + step * 65_537 + row) % (2**63 - 1)


class ScriptedGenerator:
    """Completions from a function `complete(prompt_ids, rng) -> list[int]`, for tests and dry runs.

    The function sees the prompt ids and the row's own seeded generator; a row that ends with an id in `eos_ids`
    counts as finished, anything else as truncated.
    """

    def __init__(self, complete: Callable[[list[int], torch.Generator], list[int]], eos_ids: list[int]):
        self.complete, self.eos_ids = complete, set(eos_ids)

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, seeds: list[int]) -> Completions:
        ids = [list(self.complete(p, torch.Generator().manual_seed(s)))[:params.max_new_tokens]
               for p, s in zip(prompt_ids, seeds)]
        return Completions(ids, [not (r and r[-1] in self.eos_ids) for r in ids])
