"""The rollout interface: prompt token ids, sampling settings and per-row seeds in; completions out.

Every rollout engine (`grpo.engines.sampling.TransformersSampler`, the CPU engine's `CPUSampler`, vLLM colocated or
through a server, a scripted one for tests) implements `RolloutEngine`: `generate`, and the capabilities the
trainer calls around it (`update_weights` when it holds a copy of the policy's weights that must follow the
optimizer, `sleep` / `wake`, `generate_together`). Each row draws from its own random stream, seeded by the caller from the run seed,
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
    """Every capability the trainer uses of a rollout engine, declared (no `getattr` probe anywhere):

    generate           this process's rows
    generate_together  every process's rows in one request, called by every process at once (a server's client);
                       an engine in this process generates its own rows
    update_weights     after an optimizer step, for an engine that samples from its own copy of the weights (vLLM)
    sleep / wake       free the engine's device memory while the update runs, and take it back (vLLM's sleep mode)

    `EngineDefaults` gives an engine that samples from the policy itself the four beyond `generate`; `as_engine`
    completes a user's engine that has `generate` alone."""

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, seeds: list[int]) -> Completions: ...

    def generate_together(self, prompt_ids: list[list[int]], params: SamplingParams,
                          seeds: list[int]) -> Completions: ...

    def update_weights(self, model) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...


CAPABILITIES = ("generate_together", "update_weights", "sleep", "wake")


class EngineDefaults:
    """The capabilities beyond `generate` of an engine that samples from the policy itself, in this process: one
    request is its own rows, there is no copy of the weights to load, no memory to lend the update."""

    def generate_together(self, prompt_ids, params, seeds, **rows) -> Completions:
        return self.generate(prompt_ids, params, seeds, **rows)

    def update_weights(self, model) -> None:
        pass

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass


class ReturnsRoutes:
    """An engine that returns an MoE's routes (`Completions.routes`) from a record of its own, vLLM's
    (grpo.engines.vllm_routes): `route_layers` is the MoE layers it records, or None when it does not (then
    `routes_missing` says why, for the refusal of routing replay)."""

    route_layers: int | None = None
    routes_missing: str = "the engine records no routes"


class _Completed(EngineDefaults):
    """A user's engine (`GRPOTrainer(generator=...)`) with the capabilities it lacks taken from EngineDefaults; those
    it has, and its other attributes, are its own."""

    def __init__(self, engine):
        self.engine = engine
        for name in CAPABILITIES:
            if callable(getattr(engine, name, None)):
                setattr(self, name, getattr(engine, name))

    def generate(self, prompt_ids, params, seeds, **rows) -> Completions:
        return self.engine.generate(prompt_ids, params, seeds, **rows)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["engine"], name)


def as_engine(engine) -> RolloutEngine:
    """`engine` itself when it declares every capability (grpo's engines do), else completed (`_Completed`)."""
    if not callable(getattr(engine, "generate", None)):
        raise TypeError(f"generator: {type(engine).__name__} has no generate(prompt_ids, params, seeds) method; a "
                        "rollout engine needs one (grpo.engines.base.RolloutEngine).")
    if all(callable(getattr(engine, name, None)) for name in CAPABILITIES):
        return engine
    return _Completed(engine)


def row_seed(seed: int, step: int, row: int) -> int:
    """The sampling seed of one completion: a function of the run seed, the step and the row's global index."""
    return (seed * 1_000_003 + step * 65_537 + row) % (2**63 - 1)


class ScriptedGenerator(EngineDefaults):
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
