"""From sampled completions to a training batch: decode, score, compute advantages, pad into tensors.

Shapes: B prompts per step, G completions per prompt, N = B*G / processes rows on this process, P prompt
width (left-padded), T completion width (right-padded).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from grpo.generation import left_pad


@dataclass
class RolloutBatch:
    """One step's rows on this process, ready for the update."""

    input_ids: torch.Tensor  # (N, P+T)
    attention_mask: torch.Tensor  # (N, P+T)
    completion_mask: torch.Tensor  # (N, T) float, 1 on completion tokens that enter the loss
    advantages: torch.Tensor  # (N,) outcome, or (N, T) with process supervision
    old_logp: torch.Tensor | None = None  # (N, T) when num_iterations > 1
    # (N, T): the sampler's log-probs of the completion tokens (0 past each row's end), where they estimate the
    # update's (GRPOTrainer.sampling_estimates); None otherwise
    sampling_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None  # (N, T) when beta > 0
    metrics: dict[str, float] = field(default_factory=dict)
    samples: list[dict] = field(default_factory=list)

    @property
    def completion_width(self) -> int:
        return self.completion_mask.shape[1]


@dataclass
class Sampled:
    """Scored completions of whole groups on this process: everything a step knows before its advantages.

    Rows are grouped: rows g*G .. g*G+G-1 are the G completions of one prompt (on one process).
    """

    prompts: list
    prompt_ids: list[list[int]]
    columns: dict[str, list]
    completion_ids: list[list[int]]  # as generated, EOS kept
    truncated: list[bool]
    texts: list[str]  # decoded, EOS stripped
    completions: list  # texts in the prompts' form (str or assistant message)
    total: list[float]  # weighted reward per row
    per_func: dict[str, list[float | None]]
    errors: dict[str, int]
    timeouts: dict[str, int]
    logprobs: list[list[float]] | None = None  # the sampler's, per completion token (None if it gave none)

    def select(self, rows: list[int]) -> "Sampled":
        pick = lambda xs: [xs[i] for i in rows]  # noqa: E731
        return Sampled(pick(self.prompts), pick(self.prompt_ids), {k: pick(v) for k, v in self.columns.items()},
                       pick(self.completion_ids), pick(self.truncated), pick(self.texts), pick(self.completions),
                       pick(self.total), {k: pick(v) for k, v in self.per_func.items()}, self.errors, self.timeouts,
                       None if self.logprobs is None else pick(self.logprobs))

    @staticmethod
    def concat(parts: list["Sampled"]) -> "Sampled":
        first = parts[0]
        join = lambda name: [x for p in parts for x in getattr(p, name)]  # noqa: E731
        add = lambda name: {k: sum(getattr(p, name).get(k, 0) for p in parts)  # noqa: E731
                            for k in getattr(first, name)}
        return Sampled(join("prompts"), join("prompt_ids"),
                       {k: [x for p in parts for x in p.columns[k]] for k in first.columns},
                       join("completion_ids"), join("truncated"), join("texts"), join("completions"), join("total"),
                       {k: [x for p in parts for x in p.per_func[k]] for k in first.per_func}, add("errors"),
                       add("timeouts"), join("logprobs") if all(p.logprobs is not None for p in parts) else None)


def strip_eos(ids: list[int], eos_ids: set[int]) -> list[int]:
    return ids[:-1] if ids and ids[-1] in eos_ids else ids


def as_completion(prompt, text: str):
    """Reward functions get completions in the prompt's form: text, or a list with one assistant message."""
    return [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text


def pack(prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int,
         keep: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Concatenate left-padded prompts and right-padded completions: ids (N, P+T), attention (N, P+T), mask (N, T).

    `keep[i]` False leaves row i's completion out of the loss (a truncated completion when
    mask_truncated_completions is on), while it still takes part in the forward pass.
    """
    p_ids, p_mask = left_pad(prompt_ids, pad_id)
    width = max(1, max(len(c) for c in completion_ids))
    c_ids = torch.full((len(completion_ids), width), pad_id, dtype=torch.long)
    c_mask = torch.zeros((len(completion_ids), width), dtype=torch.long)
    for i, c in enumerate(completion_ids):
        if c:
            c_ids[i, :len(c)] = torch.tensor(c, dtype=torch.long)
            c_mask[i, :len(c)] = 1
    loss_mask = c_mask.float() * torch.tensor(keep, dtype=torch.float32)[:, None]
    return torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1), loss_mask


def char_to_token_ends(tokenizer, ids: list[int], char_ends: list[int]) -> list[int]:
    """Map exclusive character end offsets in decode(ids) to inclusive token indices.

    A step ending at character c ends at the first token t whose decoded prefix ids[:t+1] reaches c characters;
    binary search keeps it at O(log T) decodes per step.
    """
    out = []
    for c in char_ends:
        lo, hi = 0, len(ids) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if len(tokenizer.decode(ids[:mid + 1], skip_special_tokens=False)) >= c:
                hi = mid
            else:
                lo = mid + 1
        out.append(max(lo, 0))
    return out


def group_stats(rewards: torch.Tensor) -> dict[str, float]:
    """Metrics of the (B, G) reward matrix: the fraction of groups with no signal (all rewards equal)."""
    std = torch.nan_to_num(rewards, nan=0.0).std(dim=1)
    return {"groups/zero_std_frac": float((std < 1e-6).float().mean())}
