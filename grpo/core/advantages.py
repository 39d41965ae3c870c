"""Group-relative advantages: outcome (one reward per completion) and process (one reward per reasoning step).

Notation: B prompts, G completions per prompt (the group), T completion tokens, K_i steps in completion i.

Outcome supervision (DeepSeekMath, arXiv:2402.03300, section 4.1.2):
    A_i = (r_i - mean(r_group)) / (std(r_group) + eps)           broadcast to every token of completion i.
Process supervision (same paper, section 4.1.3):
    r~_i^(j) = (r_i^(j) - mean(R)) / (std(R) + eps)               R = every step reward of the group
    A_{i,t}  = sum over steps j of completion i that end at or after t of r~_i^(j)

Conventions shared by both (see the numbered departures in grpo/core/__init__.py):
  * std is Bessel-corrected (`unbiased=True`) by default, as in TRL; the paper does not say which.
  * `eps` (default 1e-4, TRL's value) is added to the std so a tiny spread cannot blow advantages up.
  * A NaN reward means "does not apply" (TRL's convention for a reward function returning None): it is left out
    of the statistics and gets advantage 0.
  * A group with fewer than two usable rewards, or whose usable rewards are all equal, carries no signal and gets
    advantage 0 everywhere (never NaN or inf, even with eps=0).
"""

from __future__ import annotations

import torch
from torch import Tensor

ADVANTAGE_SCALES = ("group", "batch", "none")
"""Allowed values of `group_advantages(scale=...)`."""


def _segment_stats(values: Tensor, segment: Tensor, num_segments: int, unbiased: bool) -> tuple[Tensor, ...]:
    """Mean, std and "carries signal" flag of each segment, ignoring NaN values.

    values (S,) floats, possibly NaN; segment (S,) int64 in [0, num_segments) saying which segment each value is in.
    Returns mean (num_segments,), std (num_segments,), informative (num_segments,) bool. A segment is informative
    when it has at least two non-NaN values and they are not all equal; callers give the others advantage 0.
    """
    valid = ~torch.isnan(values)
    clean = torch.where(valid, values, torch.zeros_like(values))
    zeros = torch.zeros(num_segments, dtype=values.dtype, device=values.device)
    count = zeros.index_add(0, segment, valid.to(values.dtype))  # (num_segments,)
    total = zeros.index_add(0, segment, clean)
    mean = total / count.clamp(min=1)
    centered = torch.where(valid, clean - mean[segment], torch.zeros_like(clean))
    sq_sum = zeros.index_add(0, segment, centered * centered)
    dof = count - 1 if unbiased else count
    std = (sq_sum / dof.clamp(min=1)).sqrt()
    # "All equal" is tested exactly with max == min: a variance test would miss rewards like [0.1, 0.1, 0.1],
    # whose float mean differs from 0.1 in the last bit and would give advantages of ~1e-4 instead of 0.
    inf = float("inf")
    high = torch.full_like(count, -inf).scatter_reduce(0, segment, torch.where(valid, clean, -inf), reduce="amax")
    low = torch.full_like(count, inf).scatter_reduce(0, segment, torch.where(valid, clean, inf), reduce="amin")
    informative = (count >= 2) & (high > low)
    return mean, std, informative


def group_advantages(rewards: Tensor, scale: str = "group", eps: float = 1e-4, unbiased: bool = True) -> Tensor:
    """Outcome advantages `(r - mean_group) / (std + eps)` for rewards of shape (B, G).

    Args:
        rewards: (B, G) one scalar reward per completion, row b holding the G completions of prompt b.
            NaN marks "no reward applies": that entry is excluded from the statistics and gets advantage 0.
        scale: what to divide by after subtracting the group mean.
            "group" (default, the paper): the std of the group.
            "batch": the std of all non-NaN rewards of the batch around the batch mean (TRL's `scale_rewards="batch"`);
                the mean subtracted is still the group's own.
            "none": nothing, `A = r - mean_group` (Dr. GRPO, arXiv:2503.20783; also the tutorials' baseline form).
        eps: added to the std before dividing; ignored by scale="none".
        unbiased: Bessel-corrected std (divide by n-1) when True, population std (divide by n) when False.

    Returns:
        (B, G) advantages, same dtype as `rewards` (float32 for integer or half input). Groups with fewer than two
        non-NaN rewards, or whose non-NaN rewards are all equal, get 0 everywhere.
    """
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"group_advantages: scale={scale!r} is not one of {ADVANTAGE_SCALES}")
    if rewards.dim() != 2:
        raise ValueError(f"group_advantages: rewards must have shape (B, G), got {tuple(rewards.shape)}")
    if not rewards.is_floating_point() or rewards.dtype in (torch.float16, torch.bfloat16):
        rewards = rewards.float()  # counts and sums need more precision than half floats give
    num_groups, group_size = rewards.shape
    flat = rewards.reshape(-1)  # (B*G,)
    group_of = torch.arange(num_groups, device=rewards.device).repeat_interleave(group_size)  # (B*G,)
    mean, std, informative = _segment_stats(flat, group_of, num_groups, unbiased)  # each (B,)

    centered = rewards - mean[:, None]  # (B, G)
    if scale == "group":
        advantages = centered / (std[:, None] + eps)
    elif scale == "batch":
        _, batch_std, _ = _segment_stats(flat, torch.zeros_like(group_of), 1, unbiased)  # (1,)
        advantages = centered / (batch_std + eps)
    else:
        advantages = centered
    # NaN rewards and groups without signal get exactly 0 (this also removes any NaN/inf the division made).
    keep = informative[:, None] & ~torch.isnan(rewards)  # (B, G)
    return torch.where(keep, advantages, torch.zeros_like(advantages))


def decoupled_advantages(rewards: Tensor, weights: Tensor, eps: float = 1e-4, unbiased: bool = True) -> Tensor:
    """GDPO's "normalize then sum" (arXiv:2601.05242; TRL's multi_objective_aggregation="normalize_then_sum").

    Each reward function k is normalized within its group, r~_k = (r_k - mean_group) / (std_group + eps); the
    weighted sum s = sum_k w_k r~_k is then normalized over the whole batch, A = (s - mean(s)) / (std(s) + eps).

    Args:
        rewards: (B, G, K) one reward per completion and function; NaN where the function does not apply (it adds
            nothing to that completion's sum). A completion with NaN for every function has no sum: it is left out
            of the batch statistics and gets advantage 0.
        weights: (K,) the functions' weights.
        eps, unbiased: as in `group_advantages` (its "no signal" convention too: a function whose group has fewer
            than two usable rewards, or all equal ones, contributes 0 to that group).

    Returns:
        (B, G) advantages.
    """
    if rewards.dim() != 3 or weights.shape != rewards.shape[2:]:
        raise ValueError(f"decoupled_advantages: need rewards (B, G, K) and weights (K,), got "
                         f"{tuple(rewards.shape)} and {tuple(weights.shape)}")
    rewards = rewards.float()
    num_groups, group_size, funcs = rewards.shape
    per_func = torch.stack([group_advantages(rewards[:, :, k], "group", eps, unbiased) for k in range(funcs)], -1)
    total = (per_func * weights.to(per_func.dtype)).sum(-1)  # (B, G); NaN rewards gave 0 above
    scorable = ~torch.isnan(rewards).all(-1)  # (B, G)
    flat = torch.where(scorable, total, torch.full_like(total, float("nan"))).reshape(-1)
    mean, std, informative = _segment_stats(flat, torch.zeros(flat.shape[0], dtype=torch.long,
                                                              device=flat.device), 1, unbiased)
    advantages = (total - mean) / (std + eps)
    keep = scorable & informative
    return torch.where(keep, advantages, torch.zeros_like(advantages))


def _check_steps(step_rewards: list, step_ends: list, mask: Tensor, group_size: int) -> None:
    """Raise ValueError naming the offending row if the process-supervision inputs do not fit together."""
    if mask.dim() != 2:
        raise ValueError(f"process_advantages: mask must have shape (B*G, T), got {tuple(mask.shape)}")
    rows = mask.shape[0]
    if group_size < 1 or rows % group_size != 0:
        raise ValueError(f"process_advantages: {rows} mask rows cannot be split into groups of group_size={group_size}")
    if len(step_rewards) != rows or len(step_ends) != rows:
        raise ValueError(
            f"process_advantages: need one list per completion ({rows} rows of mask), "
            f"got {len(step_rewards)} step_rewards and {len(step_ends)} step_ends lists"
        )
    for row, (rewards, ends) in enumerate(zip(step_rewards, step_ends)):
        if len(rewards) != len(ends):
            raise ValueError(
                f"process_advantages: completion {row} has {len(rewards)} step rewards but {len(ends)} step ends; "
                "give one inclusive end-token index per step"
            )
        if any(int(end) < 0 for end in ends):
            raise ValueError(f"process_advantages: completion {row} has a negative step end {list(ends)}")


def process_advantages(
    step_rewards: list[list[float]],
    step_ends: list[list[int]],
    mask: Tensor,
    group_size: int,
    eps: float = 1e-4,
    unbiased: bool = True,
) -> Tensor:
    """Per-token advantages from step-level rewards (DeepSeekMath section 4.1.3).

    All step rewards of a group's G completions are normalized together, `(r - mean(R)) / (std(R) + eps)`, with the
    same std/eps/NaN conventions as `group_advantages`. The advantage of token t of completion i is then the sum of
    its normalized step rewards whose step ends at or after t ("reward to go" over steps).

    Args:
        step_rewards: B*G lists (completion i = row i of `mask`, groups are consecutive runs of `group_size` rows);
            list i holds the K_i step rewards of completion i. K_i may differ between completions and may be 0.
            A NaN step reward is left out of the statistics and contributes nothing.
        step_ends: B*G lists of K_i inclusive end-token indices (0-based positions in the completion), in any order.
            A step that ends past the last valid token of its completion (or past T) counts as ending at that last
            valid token: it then covers every valid token, exactly as if it ended there.
        mask: (B*G, T) bool or 0/1; True on completion tokens.
        group_size: G.
        eps, unbiased: as in `group_advantages`.

    Returns:
        (B*G, T) float32 advantages on mask's device, 0 outside the mask. A group with fewer than two step rewards in
        total, or whose step rewards are all equal, gets 0 everywhere.
    """
    _check_steps(step_rewards, step_ends, mask, group_size)
    rows, length = mask.shape
    device = mask.device
    if length == 0:
        return torch.zeros(rows, 0, dtype=torch.float32, device=device)
    steps_per_row = torch.tensor([len(r) for r in step_rewards], dtype=torch.long, device=device)  # (B*G,)
    row_of_step = torch.arange(rows, device=device).repeat_interleave(steps_per_row)  # (S,) S = total steps
    rewards = torch.tensor([float(r) for row in step_rewards for r in row], dtype=torch.float32, device=device)
    ends = torch.tensor([int(e) for row in step_ends for e in row], dtype=torch.long, device=device)  # (S,)

    group_of_step = row_of_step // group_size  # (S,)
    mean, std, informative = _segment_stats(rewards, group_of_step, rows // group_size, unbiased)
    normalized = (rewards - mean[group_of_step]) / (std[group_of_step] + eps)  # (S,)
    keep = informative[group_of_step] & ~torch.isnan(rewards)
    normalized = torch.where(keep, normalized, torch.zeros_like(normalized))

    # Put each step's normalized reward on its end token, then a reversed cumulative sum along T gives, at t,
    # the sum over steps ending at or after t. Clamping an end to T-1 does not change any valid token's sum,
    # and multiplying by the mask zeroes the rest, which is what "counts as the last valid token" means.
    at_end = torch.zeros(rows, length, dtype=torch.float32, device=device)  # (B*G, T)
    at_end.index_put_((row_of_step, ends.clamp(max=length - 1)), normalized, accumulate=True)
    to_go = at_end.flip(-1).cumsum(-1).flip(-1)  # (B*G, T)
    return to_go * mask.to(torch.float32)


def mix_advantages(
    outcome: Tensor,
    process: Tensor,
    mask: Tensor,
    outcome_weight: float = 1.0,
    process_weight: float = 1.0,
) -> Tensor:
    """Weighted sum of outcome and process advantages, per token: `w_o * A_outcome_i + w_p * A_process_{i,t}`.

    Args:
        outcome: (B*G,) or (B, G) outcome advantages (e.g. from `group_advantages`), broadcast over tokens.
        process: (B*G, T) token advantages (e.g. from `process_advantages`).
        mask: (B*G, T) bool or 0/1; True on completion tokens.
        outcome_weight, process_weight: the two weights.

    Returns:
        (B*G, T) advantages, 0 outside the mask.
    """
    if process.dim() != 2 or mask.shape != process.shape:
        raise ValueError(
            "mix_advantages: process and mask must both be (B*G, T), "
            f"got {tuple(process.shape)} and {tuple(mask.shape)}"
        )
    if outcome.numel() != process.shape[0]:
        raise ValueError(
            f"mix_advantages: outcome has {outcome.numel()} entries but process has {process.shape[0]} rows; "
            "pass one outcome advantage per completion"
        )
    mixed = outcome_weight * outcome.reshape(-1, 1).to(process.dtype) + process_weight * process  # (B*G, T)
    return mixed * mask.to(process.dtype)
