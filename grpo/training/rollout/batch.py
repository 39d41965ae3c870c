"""A rollout's records: the request (`SampleRequest`), what sampling and scoring gave (`Sampled`), the padded
training batch (`RolloutBatch`), and the helpers that lay rows into tensors.

Shapes: N rows on this process, P prompt width (left-padded), T completion width (right-padded). Batches stay on
the CPU; the update moves each micro-batch to the model's device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from grpo.agents.recording import concat_extra_rows, select_extra_rows
from grpo.engines.images import RowImages
from grpo.engines.sampling import left_pad


@dataclass
class RolloutBatch:
    """One step's rows on this process, ready for the update."""

    input_ids: torch.Tensor  # (N, P+T)
    attention_mask: torch.Tensor  # (N, P+T)
    completion_mask: torch.Tensor  # (N, T) float, 1 on completion tokens that enter the loss
    advantages: torch.Tensor  # (N,) outcome, or (N, T) with process supervision
    old_logp: torch.Tensor | None = None  # (N, T) when num_iterations > 1, on the model's device
    # (N, T): the rollout engine's log-probs of the completion tokens (0 past each row's end); None if it gave none
    sampling_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None  # (N, T) when beta > 0, on the model's device
    metrics: dict[str, float] = field(default_factory=dict)
    samples: list[dict] = field(default_factory=list)
    index: int = 0  # which rollout of the run (seeds its sampling and the order of its optimizer steps)
    plans: list | None = None  # its optimizer steps (grpo.training.update.steps.StepPlan), planned on the CPU; not saved
    images: list | None = None  # (N,) each row's image features (grpo.training.data.vision.RowImages), with image data
    routes: torch.Tensor | None = None  # (N, P+T, layers, k) uint8: an MoE model's experts per token (engines.moe)

    def __post_init__(self):
        if self.images is not None:  # (a checkpoint keeps each row's features as a dict)
            self.images = [r if isinstance(r, RowImages) else RowImages(r["features"], tuple(r["token_types"]))
                           for r in self.images]

    @property
    def completion_width(self) -> int:
        return self.completion_mask.shape[1]

    def tensors(self) -> dict:
        """What a checkpoint taken while this rollout still feeds optimizer steps keeps of it."""
        names = ("input_ids", "attention_mask", "completion_mask", "advantages", "old_logp", "sampling_logp",
                 "ref_logp", "routes")
        return {**{n: None if getattr(self, n) is None else getattr(self, n).cpu() for n in names},
                "metrics": self.metrics, "samples": self.samples, "index": self.index,
                **({"images": [{"features": r.features, "token_types": list(r.token_types)} for r in self.images]}
                   if self.images else {})}


@dataclass
class SampleRequest:
    """What generating one round of a rollout needs on this process: its rows' prompts and their sampling seeds
    (drawn in the trainer's process, in rollout order, so a rollout worker gets exactly what it would sample)."""

    prompts: list
    prompt_ids: list[list[int]]
    columns: dict[str, list]
    seeds: list[int]
    rows: list[int] | None = None  # their indices in the prompt set (a vision task's pixels are looked up by them)


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
    model_mask: list[list[int]] | None = None  # multi-turn: 1 on the model's own completion tokens, 0 on tools'
    agent_stats: list[dict[str, int]] | None = None  # multi-turn: turns, tool calls and errors of each row
    images: list | None = None  # each row's image features (grpo.training.data.vision.RowImages), with image data
    # an agent's episodes (grpo.agents.episodes): more training rows, (row, prompt_ids, ids, model_mask, logprobs)
    extra_rows: list[tuple] | None = None
    routes: list | None = None  # an MoE model's experts per token of each row (grpo.engines.moe.RouteRecorder)

    def select(self, rows: list[int]) -> "Sampled":
        values = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "extra_rows" and value is not None:
                values[f.name] = select_extra_rows(value, rows)
            elif value is None or f.name in _COUNTS:
                values[f.name] = value
            elif f.name in _PER_ROW_MAPS:
                values[f.name] = {k: [v[i] for i in rows] for k, v in value.items()}
            else:
                values[f.name] = [value[i] for i in rows]
        return Sampled(**values)

    @staticmethod
    def concat(parts: list["Sampled"]) -> "Sampled":
        values = {}
        for f in dataclasses.fields(Sampled):
            each = [getattr(p, f.name) for p in parts]
            if f.name in _COUNTS:
                values[f.name] = {k: sum(v.get(k, 0) for v in each) for k in each[0]}
            elif f.name == "extra_rows":
                values[f.name] = concat_extra_rows(each, [len(p.total) for p in parts])
            elif any(v is None for v in each):
                values[f.name] = None
            elif f.name in _PER_ROW_MAPS:
                values[f.name] = {k: [x for v in each for x in v[k]] for k in each[0]}
            else:
                values[f.name] = [x for v in each for x in v]
        return Sampled(**values)


_PER_ROW_MAPS = ("columns", "per_func")  # name -> one value per row
_COUNTS = ("errors", "timeouts")  # name -> a count for the whole batch


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


def pad_rows(rows: list[list[int]], width: int) -> torch.Tensor:
    """(N, width) float tensor of the rows, right-padded with 0 (cut at width)."""
    out = torch.zeros((len(rows), width))
    for i, row in enumerate(rows):
        out[i, :min(len(row), width)] = torch.tensor(row[:width], dtype=torch.float32)
    return out


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
