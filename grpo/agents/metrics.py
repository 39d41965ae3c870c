"""Per-step metrics of multi-turn rollouts, over the completions of every process.

    tools/calls_per_completion   tool calls per completion (well-formed or not)
    tools/call_rate              fraction of completions with at least one tool call
    tools/failure_frac           failed calls / calls (TRL's tools/failure_frequency)
    tools/errors/<kind>          failed calls of each kind in the step: malformed, unknown_tool, bad_arguments,
                                 raised, timeout
    tools/turns_per_completion   model turns per completion
    tools/model_token_frac       the model's own tokens / all completion tokens (the rest are tool answers)
"""

from __future__ import annotations

from typing import Callable

import torch

from grpo.agents.tools import ERROR_KINDS


def agent_metrics(stats: list[dict[str, int]], model_mask: list[list[int]],
                  gather: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
    """`stats`: per row, turns, calls and errors by kind (grpo.agents.loop.Trajectories.stats); `gather` joins a
    per-row tensor of every process."""
    keys = ["turns", "calls", *ERROR_KINDS]
    table = gather(torch.tensor([[float(s.get(k, 0)) for k in keys] for s in stats]))  # (N all, K)
    tokens = gather(torch.tensor([[float(sum(m)), float(len(m))] for m in model_mask]))  # (N all, 2)
    column = {k: table[:, j] for j, k in enumerate(keys)}
    calls = float(column["calls"].sum())
    errors = sum(float(column[k].sum()) for k in ERROR_KINDS)
    faults = float(column["raised"].sum() + column["timeout"].sum())
    out = {"tools/calls_per_completion": float(column["calls"].mean()),
           "tools/call_rate": float((column["calls"] > 0).float().mean()),
           "tools/failure_frac": errors / calls if calls else 0.0,
           "tools/fault_frac": faults / calls if calls else 0.0,  # (the tools' own: raised or timed out)
           "tools/turns_per_completion": float(column["turns"].mean()),
           "tools/model_token_frac": float(tokens[:, 0].sum() / tokens[:, 1].sum().clamp(min=1))}
    out.update({f"tools/errors/{k}": float(column[k].sum()) for k in ERROR_KINDS})
    return out


def sample_stats(stats: dict[str, int]) -> dict[str, int]:
    """One completion's counts for its samples/ row: turns, tool calls, failed tool calls."""
    return {"turns": stats.get("turns", 0), "tool_calls": stats.get("calls", 0),
            "tool_errors": sum(stats.get(k, 0) for k in ERROR_KINDS)}
