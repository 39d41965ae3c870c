"""The micro-batches of the update and the reference pass: which rows go together, and the layout they run in.

An optimizer step's rows (a slice of a rollout's rows, in the order `grpo.training.update.steps.rollout_plan` gives:
`MicroBatches.plan(batch, rows)`) are cut into consecutive micro-batches, each one forward and backward pass:

* by rows: `per_device_train_batch_size` completions each;
* by tokens (`max_tokens_per_micro_batch`, verl's dynamic batch size): each filled with rows while its tokens stay
  within the budget, so a micro-batch of long completions holds few rows and one of short ones many. Tokens are
  what the passes compute: with padding-free passes a micro-batch's prompts (each once per group where prompts are
  shared) and completions; with padded ones its rows x its padded width. A row longer than the budget goes alone.
  Under sequence parallelism the budget is per process: the SP group's processes each hold 1/SP of a micro-batch's
  tokens (grpo.engines.ulysses), so a micro-batch takes up to SP x the budget, and a row of L tokens fits when
  L / SP does: a row longer than one process's budget is split over the group, not sent alone.

Each micro-batch is then packed (`grpo.engines.packing.pack`) when the run's passes are padding-free. The loss of
each is a share of the step's loss (the trainer's normalizers are over the whole step), so any cut gives the one-
batch gradient up to float32 rounding. Under several processes every process runs the same number of micro-batches,
the largest any of them needs (as verl does): sharded models (DeepSpeed, FSDP) communicate in every one of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo.engines.moe import packed_routes
from grpo.engines.packing import Packing, PackedRows, pack
from grpo.engines.policy import MicroBatch


@dataclass
class Plan:
    """One micro-batch: rows `rows` (indices) of the rollout's batch, their completion width (the trailing columns
    that are padding in every row left out), their packed layout (None: padded passes) and the tokens it costs."""

    rows: torch.Tensor
    width: int
    packed: PackedRows | None
    tokens: int

    def __len__(self) -> int:
        return len(self.rows)

    def take(self, t: torch.Tensor | None, device) -> torch.Tensor | None:
        """This micro-batch's part of a per-row (N,) or per-token (N, T) tensor of the batch, on `device`."""
        if t is None:
            return None
        t = t[self.rows]
        return (t[:, :self.width] if t.dim() == 2 else t).to(device)

    def inputs(self, batch, device) -> MicroBatch:
        """The backend's view of this micro-batch: ids, masks, the log-probs known so far and the packed layout."""
        end = batch.input_ids.shape[1] - (batch.completion_width - self.width)
        return MicroBatch(batch.input_ids[self.rows, :end].to(device), batch.attention_mask[self.rows, :end].to(device),
                          self.width, old_logp=self.take(batch.old_logp, device),
                          sampling_logp=self.take(batch.sampling_logp, device),
                          packed=None if self.packed is None else self.packed.to(device),
                          images=None if batch.images is None else [batch.images[r] for r in self.rows.tolist()],
                          routes=None if batch.routes is None or self.packed is None else
                          packed_routes(batch.routes[self.rows, :end], self.packed.source).to(device))


class MicroBatches:
    """Plans micro-batches of `rows` completions, or of at most `max_tokens` tokens per process when that is set,
    packed with `packing` (None: padded, for the reason `why`). `procs`: the run's processes
    (`grpo.training.setup.processes.Processes`); `split`: the sequence-parallel size, the processes that share each
    micro-batch's tokens."""

    def __init__(self, rows: int, max_tokens: int | None, packing: Packing | None, procs, why: str = "",
                 split: int = 1):
        self.rows, self.max_tokens, self.packing, self.procs, self.why = rows, max_tokens, packing, procs, why
        self.split = split

    def describe(self) -> str:
        """A line for the run's start: how the passes run."""
        size = f"up to {self.max_tokens} tokens" if self.max_tokens else f"{self.rows} completions"
        if self.max_tokens and self.split > 1:
            size += f" per process ({self.max_tokens * self.split} over the {self.split} that share one)"
        layout = self.packing.describe() if self.packing is not None else f"padded ({self.why})"
        return f"{layout}; micro-batches of {size}"

    def plan(self, batch, rows: torch.Tensor | None = None) -> list[Plan]:
        """The micro-batches of rows `rows` (indices, in order; None: all) of `batch` (a `RolloutBatch`). Collective
        with a token budget on several processes: every process calls it for the same step."""
        order = list(range(batch.input_ids.shape[0])) if rows is None else rows.tolist()
        costs = _RowCosts(batch, self.packing is not None and self.packing.shared_prompts, self.packing is None)
        if self.max_tokens is None:
            cuts = [order[s:s + self.rows] for s in range(0, len(order), self.rows)]
        else:
            # Each of the `split` processes holds ceil(C / split) of a micro-batch's C tokens (its row padded to a
            # multiple of split): within the budget exactly when C <= budget x split.
            cuts = costs.greedy(order, self.max_tokens * self.split)
            if self.procs.world > 1:  # the same number on every process: the largest any needs
                wanted = int(self.procs.gather(torch.tensor([len(cuts)])).max())
                cuts = costs.exactly(order, wanted) if wanted > len(cuts) else cuts
        return [self._plan(batch, costs, cut) for cut in cuts]

    def _plan(self, batch, costs: "_RowCosts", cut: list[int]) -> Plan:
        width = max(1, max(costs.completion[r] for r in cut))
        rows = torch.tensor(cut, dtype=torch.long)
        packed = None
        if self.packing is not None:
            end = batch.input_ids.shape[1] - (batch.completion_width - width)
            packed = pack(batch.input_ids[rows, :end], batch.attention_mask[rows, :end], width, self.packing)
        return Plan(rows, width, packed, costs.cost(cut))


class _RowCosts:
    """What rows cost the passes, in tokens: packed, a row's completion (less its last token, which the model does
    not see) and its prompt unless a row before it in the micro-batch has the same one (shared prompts); padded, a
    micro-batch's rows x (prompt width + its completion width - 1)."""

    def __init__(self, batch, shared: bool, padded: bool):
        width = batch.completion_width
        self.prompt_width = batch.input_ids.shape[1] - width
        self.prompt = batch.attention_mask[:, :self.prompt_width].sum(1).tolist()
        self.completion = batch.attention_mask[:, self.prompt_width:].sum(1).tolist()
        self.shared, self.padded = shared, padded
        if shared:
            keys = torch.cat([batch.input_ids[:, :self.prompt_width], batch.attention_mask[:, :self.prompt_width]], 1)
            self.key = [tuple(row) for row in keys.tolist()]

    def cost(self, rows: list[int]) -> int:
        if self.padded:
            return len(rows) * (self.prompt_width + max(1, max(self.completion[r] for r in rows)) - 1)
        seen: set[tuple] = set()
        total = 0
        for r in rows:
            total += max(self.completion[r] - 1, 0)
            if not self.shared or self.key[r] not in seen:
                total += self.prompt[r]
                if self.shared:
                    seen.add(self.key[r])
        return total

    def greedy(self, rows: list[int], budget: int) -> list[list[int]]:
        """Consecutive micro-batches of `rows`, each taking rows while its cost stays within `budget` (at least
        one row)."""
        cuts, cut, seen, total, widest = [], [], set(), 0, 1  # (the cost of `cut` kept as rows join it)
        for r in rows:
            if self.padded:
                new = (len(cut) + 1) * (self.prompt_width + max(widest, self.completion[r]) - 1)
            else:
                shared = self.shared and self.key[r] in seen
                new = total + max(self.completion[r] - 1, 0) + (0 if shared else self.prompt[r])
            if cut and new > budget:
                cuts.append(cut)
                cut, seen, widest, new = [], set(), 1, self.cost([r])
            cut.append(r)
            total, widest = new, max(widest, self.completion[r])
            if self.shared:
                seen.add(self.key[r])
        if cut:
            cuts.append(cut)
        return cuts

    def exactly(self, rows: list[int], count: int) -> list[list[int]]:
        """`count` consecutive micro-batches whose largest cost is as small as greedy cuts make it
        (count <= len(rows))."""
        low, high = max(self.cost([r]) for r in rows), self.cost(rows)
        while low < high:  # the smallest budget that greedy cuts into at most `count` micro-batches
            mid = (low + high) // 2
            low, high = (low, mid) if len(self.greedy(rows, mid)) <= count else (mid + 1, high)
        cuts = self.greedy(rows, low)
        while len(cuts) < count:  # fewer: halve the micro-batch with the most rows
            i = max(range(len(cuts)), key=lambda k: len(cuts[k]))
            half = len(cuts[i]) // 2
            cuts[i:i + 1] = [cuts[i][:half], cuts[i][half:]]
        return cuts
