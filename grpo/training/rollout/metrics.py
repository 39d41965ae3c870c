"""A rollout's metrics over every process's rows: rewards (total and per function, with their errors and timeouts),
advantages, completion lengths and truncation, group statistics, and what reward functions logged with TRL's
log_metric. Collective on several processes (each gathers)."""

from __future__ import annotations

import torch

from grpo.training.rollout.batch import Sampled, group_stats
from grpo.training.setup.processes import Processes


def rollout_metrics(scored: Sampled, rewards: torch.Tensor, outcome: torch.Tensor, gather) -> dict[str, float]:
    """`rewards`: every process's (groups, G); `outcome`: this process's rows' advantages; `gather`: Processes'."""
    # the model's own tokens (tool answers left out), as TRL counts completion lengths
    lengths = [len(c) for c in scored.completion_ids] if scored.model_mask is None else [
        sum(m) for m in scored.model_mask]
    lengths_all = gather(torch.tensor(lengths, dtype=torch.float32))
    truncated = gather(torch.tensor(scored.truncated, dtype=torch.float32))
    scored_rows = rewards[~torch.isnan(rewards)]
    ended = lengths_all[truncated == 0]
    ended = ended if ended.numel() else torch.zeros(1)
    m = {"reward/total": float(scored_rows.mean()) if scored_rows.numel() else float("nan"),
         "reward/total/std": float(scored_rows.std()) if scored_rows.numel() > 1 else 0.0,
         "advantage/mean": float(outcome.mean()), "advantage/std": float(outcome.std()),
         "completion/mean_length": float(lengths_all.mean()), "completion/max_length": float(lengths_all.max()),
         "completion/min_length": float(lengths_all.min()), "completion/truncated_frac": float(truncated.mean()),
         "completion/mean_terminated_length": float(ended.mean()),
         "completion/min_terminated_length": float(ended.min()),
         "completion/max_terminated_length": float(ended.max()),
         "completion/tokens": float(gather(torch.tensor(  # every token, tool answers included (TRL's num_tokens)
             [len(p) + len(c) for p, c in zip(scored.prompt_ids, scored.completion_ids)],
             dtype=torch.float32)).sum())}
    for name, values in scored.per_func.items():
        vals = gather(torch.tensor([float("nan") if v is None else float(v) for v in values]))
        applied = vals[~vals.isnan()]
        m[f"reward/{name}"] = float(vals.nanmean())
        m[f"reward/{name}/std"] = float(applied.std()) if applied.numel() > 1 else float("nan")
        m[f"reward/{name}/none_frac"] = float(vals.isnan().float().mean())  # "does not apply" to these rows
    for name, count in scored.errors.items():
        m[f"reward/errors/{name}"] = float(count)
        m[f"reward/error_frac/{name}"] = count / max(1, len(scored.per_func[name]))  # (health: reward_errors)
    for name, count in scored.timeouts.items():
        m[f"reward/timeouts/{name}"] = float(count)
    m.update(group_stats(rewards))
    return m


def reward_logs(procs: Processes, logged: dict[str, list[float]]) -> dict[str, float]:
    """What reward functions logged with log_metric, averaged over every call on every process (TRL's)."""
    names = sorted(set(procs.gather_objects(sorted(logged))) | set(logged))
    out = {}
    for name in names:
        values = logged.get(name, [])
        stats = procs.gather(torch.tensor([[sum(values), len(values)]], dtype=torch.float64)).sum(0)
        out[name] = float(stats[0] / stats[1]) if stats[1] > 0 else float("nan")
    return out
