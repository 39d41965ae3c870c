"""From scored completions to the training batch's parts: outcome advantages over every process's groups, process
advantages from step rewards, the padded tensors the update takes, an MoE rollout's routes laid out as the rows'
ids, and the rows of the samples/ log. Functions of what they read (grpo.training.rollout.rollouts puts them
together); the records and padding helpers are in grpo.training.rollout.batch.
"""

from __future__ import annotations

import numpy as np
import torch

from grpo.agents.metrics import sample_stats
from grpo.core import decoupled_advantages, group_advantages, mix_advantages, process_advantages
from grpo.engines.moe import batch_routes
from grpo.training.data.vision import sample_images
from grpo.training.rollout.batch import Sampled, char_to_token_ends, pack, pad_rows
from grpo.training.setup.processes import Processes


def outcome_advantages(cfg, procs: Processes, s: Sampled, rewards_runner, G: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(every process's rewards as (groups, G), this process's rows' outcome advantages (n_local,)): group
    advantages of the weighted total, or GDPO's per-reward normalization then the weighted sum (the only use of the
    reward runner's `weights`: a benchmark or a user may score with a plain function)."""
    n_local = len(s.total)
    rewards = procs.gather(torch.tensor(s.total, dtype=torch.float32)).view(-1, G)
    mine = slice(procs.rank * n_local, (procs.rank + 1) * n_local)
    if cfg.multi_objective_aggregation == "normalize_then_sum":
        per_func = torch.tensor([[float("nan") if v is None else v for v in s.per_func[n]] for n in s.per_func],
                                dtype=torch.float32).T  # (n_local, K)
        per_func = procs.gather(per_func).view(-1, G, per_func.shape[1])
        outcome = decoupled_advantages(per_func, torch.tensor(rewards_runner.weights), eps=cfg.advantage_eps,
                                       unbiased=cfg.unbiased_std).view(-1)[mine]
    else:
        outcome = group_advantages(rewards, scale=cfg.scale_rewards, eps=cfg.advantage_eps,
                                   unbiased=cfg.unbiased_std).view(-1)[mine]
    return rewards, outcome


def rollout_tensors(s: Sampled, mask_truncated: bool, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows as the update takes them: ids (N, P+T), attention (N, P+T), loss mask (N, T)."""
    extra = s.extra_rows or []
    keep = [not (mask_truncated and t) for t in s.truncated] + [True] * len(extra)
    input_ids, attention, cmask = pack(s.prompt_ids + [e[1] for e in extra], s.completion_ids + [e[2] for e in extra],
                                       pad_id, keep)
    if s.model_mask is not None:  # tool answers take part in the forward pass, not in the loss
        cmask *= pad_rows(s.model_mask + [e[3] for e in extra], cmask.shape[1])
    return input_ids, attention, cmask


def rollout_routes(s: Sampled, attention: torch.Tensor, cmask: torch.Tensor) -> torch.Tensor | None:
    """An MoE rollout's recorded experts laid out as the rows' ids (grpo.engines.moe.batch_routes), or None."""
    if s.routes is None:
        return None
    return batch_routes(s.routes, [len(q) for q in s.prompt_ids], attention.shape[1] - cmask.shape[1],
                        attention.shape[1])


def sample_rows(s: Sampled, outcome, logged_columns: dict[str, list], unique_prompts: bool) -> list[dict]:
    """Sample completions for the samples/ log: the first 16 rows (one per distinct prompt with
    log_unique_prompts), with each reward, the advantage and the columns reward functions logged."""
    rows, seen = [], set()
    for i, (p, t, r, a) in enumerate(zip(s.prompts, s.texts, s.total, outcome)):
        text = p if isinstance(p, str) else p[-1]["content"]
        if unique_prompts and text in seen:
            continue
        seen.add(text)
        extra = {k: v[i] for k, v in logged_columns.items() if i < len(v)}
        rows.append({"prompt": text, "completion": t, "reward": r, "advantage": float(a),
                     **(sample_images(s.prompts, s.columns, i) if s.images is not None else {}),
                     **{f"reward/{k}": v[i] for k, v in s.per_func.items()}, **extra,
                     **(sample_stats(s.agent_stats[i]) if s.agent_stats is not None else {})})
    return rows[:16]


def step_advantages(cfg, procs: Processes, tokenizer, step_rewards, G: int, s: Sampled, ids: list[list[int]],
                    outcome: torch.Tensor, cmask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Step rewards -> token positions -> DeepSeekMath 4.1.3 process advantages, mixed with the outcome ones."""
    step_scores: list[list[float]] = [[] for _ in ids]
    step_ends: list[list[int]] = [[] for _ in ids]
    for func in step_rewards:
        result = func(prompts=s.prompts, completions=s.completions, **s.columns)
        for i, steps in enumerate(result):
            if steps:
                chars, scores = zip(*steps)
                step_scores[i] += list(scores)
                step_ends[i] += char_to_token_ends(tokenizer, ids[i], list(chars))
    scores_all, ends_all = procs.gather_objects(step_scores), procs.gather_objects(step_ends)
    T = cmask.shape[1]
    n_local = len(ids)
    mask_all = torch.zeros(len(scores_all), T)
    lengths = procs.gather(cmask.sum(1))
    for r in range(len(scores_all)):  # every row's mask, rebuilt from its length (all ranks' rows)
        mask_all[r, :int(min(lengths[r], T))] = 1.0
    process = process_advantages(scores_all, ends_all, mask_all, G, eps=cfg.advantage_eps,
                                 unbiased=cfg.unbiased_std)[procs.rank * n_local:(procs.rank + 1) * n_local]
    mixed = mix_advantages(outcome, process, cmask, outcome_weight=cfg.outcome_weight,
                           process_weight=cfg.process_weight)
    flat = [x for row in step_scores for x in row]
    first_wrong = [any(x <= 0 for x in row) for row in step_scores]
    return mixed, {"reward/step/mean": float(np.mean(flat)) if flat else 0.0,
                   "reward/step/count": float(len(flat)) / max(1, len(ids)),
                   "reward/step/first_wrong_found_frac": float(np.mean(first_wrong)) if first_wrong else 0.0}
