"""`rollout_func`: a rollout of the user's own, with TRL 1.16's contract.

    def rollout_func(prompts: list, trainer) -> dict:
        return {"prompt_ids": [...], "completion_ids": [...], "logprobs": [...],   # one entry per prompt
                "env_mask": [...],          # optional: per completion token, 1 = the model's own, 0 = not trained
                "my_field": [...]}          # any other key reaches the reward functions as a keyword

`prompts` are this process's rows: each prompt repeated for the G completions of its group, as the dataset gives
it (text or messages); the function returns one completion per row, and renders and tokenizes the prompts itself.
`trainer` is the GRPOTrainer: `trainer.generator` (the rollout engine, `generate(prompt_ids, params, seeds)`),
`trainer.tokenizer`, `trainer.params`, `trainer.cfg`, `trainer.step`. A function that also takes a `seeds` keyword
gets the rows' sampling seeds (a function of the run seed, the step and the row), for runs that repeat.
`logprobs` are the sampler's per-token log-probs (or None): the importance-sampling correction of `use_vllm` reads
them. A completion that does not end with EOS counts as truncated.
"""

from __future__ import annotations

import inspect
from typing import Callable

from grpo.agents.loop import Trajectories
from grpo.config import ConfigError

REQUIRED = ("prompt_ids", "completion_ids", "logprobs")


class CustomRollout:
    def __init__(self, func: Callable, trainer, tokenizer):
        self.func, self.trainer, self.eos = func, trainer, tokenizer.eos_token_id
        try:
            self.takes_seeds = "seeds" in inspect.signature(func).parameters
        except (TypeError, ValueError):
            self.takes_seeds = False

    def generate(self, prompts: list, prompt_ids, columns, params, seeds: list[int]) -> Trajectories:
        output = self.func(prompts, self.trainer, **({"seeds": seeds} if self.takes_seeds else {}))
        if not isinstance(output, dict):
            raise ConfigError(f"rollout_func: must return a dict with {', '.join(REQUIRED)}; got "
                              f"{type(output).__name__}.")
        missing = [k for k in REQUIRED if k not in output]
        if missing:
            raise ConfigError(f"rollout_func: its output has no {missing} (it must return {', '.join(REQUIRED)}).")
        n = len(prompts)
        ids = [list(c) for c in self._rows(output, "completion_ids", n)]
        new_prompt_ids = [list(p) for p in self._rows(output, "prompt_ids", n)]
        logprobs = output["logprobs"]
        if logprobs is not None:
            logprobs = [[0.0 if x is None else float(x) for x in row] for row in self._rows(output, "logprobs", n)]
            self._aligned(logprobs, ids, "logprobs")
        mask = output.get("env_mask")
        if mask is None:
            mask = [[1] * len(c) for c in ids]
        else:
            mask = [[int(bool(x)) for x in row] for row in self._rows(output, "env_mask", n)]
            self._aligned(mask, ids, "env_mask")
        extra = {k: (list(v) if isinstance(v, (list, tuple)) and len(v) == n else [v] * n)
                 for k, v in output.items() if k not in (*REQUIRED, "env_mask", "logprob_token_ids")}
        truncated = [not (c and c[-1] == self.eos) for c in ids]
        stats = [{"turns": 1, "calls": 0} for _ in ids]
        return Trajectories(list(prompts), new_prompt_ids, ids, mask, truncated, logprobs, None, stats, extra)

    @staticmethod
    def _rows(output: dict, key: str, n: int) -> list:
        rows = output[key]
        if not isinstance(rows, (list, tuple)) or len(rows) != n:
            count = len(rows) if isinstance(rows, (list, tuple)) else type(rows).__name__
            raise ConfigError(f"rollout_func: {key!r} has {count} entries for {n} prompts; return one per prompt.")
        return list(rows)

    @staticmethod
    def _aligned(values: list[list], ids: list[list[int]], key: str) -> None:
        for i, (v, c) in enumerate(zip(values, ids)):
            if len(v) != len(c):
                raise ConfigError(f"rollout_func: row {i} has {len(c)} completion ids but {len(v)} {key}; give one "
                                  "per completion token.")
