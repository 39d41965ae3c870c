"""Expert parallelism (EP): each MoE layer's experts split over the processes of an expert-parallel group, composed
with data parallelism (Megatron's expert_model_parallel_size; transformers' `DistributedConfig(ep_size)`).

The processes form groups of `size` consecutive ranks (`expert_group`); process j of a group holds experts
[j*E/size, (j+1)*E/size) of every layer (`split_experts`), every other weight whole. Each process keeps its own
rows (data parallelism). In each MoE layer, after the router chose each token's experts (`ep_forward`):

    (token, expert) pairs sorted by the expert's process  --all_to_all-->  the pairs this process's experts run
    the experts' outputs                                   --all_to_all-->  back to the token's process, weighted
                                                                            and summed over the token's k experts

Both exchanges are autograd functions whose backward is the reverse exchange, so an expert's gradient is the sum
over its group's tokens and the routing weights' gradient reaches the router. The split sizes go to the host once
per layer (all_to_all_single takes lists; transformers' AllToAllEP does the same): a host sync per MoE layer.

Every forward is collective within the group, so every process must run the same forwards: the update already
runs the same number of micro-batches on every process (grpo.training.update.micro_batches), and the sampler steps
until every process's rows have stopped (`grpo.engines.sharding.all_processes_stopped`, chosen by
`grpo.engines.select.make_sampler` when `is_split`).

Beyond the forward (`ExpertParallel`): DDP leaves the expert shards out of its all-reduce (each process's shard is
its own); their gradient is summed over the processes that hold the same shard (one per group) and divided by the
processes (the loss is scaled by them for DDP's mean, grpo.engines.policy); the gradient norm for clipping adds
every shard's; `whole_experts` gathers every expert for saving (on the main process) and for loading model files
(a checkpoint and final/ are ordinary model directories); each process's optimizer state of its shard travels in
the checkpoint's per-process part (`optimizer_part`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Experts modules that run (hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k)) with every parameter
# stacked over the experts on dim 0 (transformers 5.24's modeling files; gpt-oss's takes other arguments).
SPLITTABLE = ("Qwen3MoeExperts", "Qwen2MoeExperts", "OlmoeExperts", "MixtralExperts")


@dataclass(frozen=True)
class ExpertGroup:
    """This process's expert-parallel group (`size` processes, this one `rank` in it) and the group of processes
    holding the same experts as this one (`replicas`, one per EP group; None when there is one group)."""

    group: object
    replicas: object
    rank: int
    size: int
    processes: int


def expert_group(rank: int, processes: int, size: int) -> ExpertGroup:
    """The EP group of consecutive ranks [k*size, (k+1)*size) holding process `rank`, and its replicas (ranks j,
    j+size, ...). Collective: every process creates every group, in the same order."""
    mine = replicas = None
    for start in range(0, processes, size):
        group = dist.new_group(list(range(start, start + size)))
        mine = group if start <= rank < start + size else mine
    if processes > size:
        for j in range(size):
            group = dist.new_group(list(range(j, processes, size)))
            replicas = group if rank % size == j else replicas
    return ExpertGroup(mine, replicas, rank % size, size, processes)


def experts_modules(model) -> list[torch.nn.Module]:
    """The model's stacked-experts modules (any class with `num_experts` and a 3-D `gate_up_proj`)."""
    return [m for m in model.modules() if hasattr(m, "num_experts") and getattr(m, "gate_up_proj", None) is not None
            and m.gate_up_proj.dim() == 3]


def is_split(model) -> bool:
    """Whether `model`'s experts are split over an expert-parallel group (its forwards are collective)."""
    return any(getattr(m, "_grpo_ep", None) is not None for m in model.modules())


class _Exchange(torch.autograd.Function):
    """all_to_all of rows with uneven splits; backward: the reverse exchange of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], receive: list[int], group) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.group = send, receive, group
        return _exchange(x, send, receive, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.receive, ctx.send, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send: list[int], receive: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(receive), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), receive, send, group=group)  # (NCCL: contiguous, on x's device)
    return out


def ep_forward(module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """An experts module's forward over its EP group: `hidden` (T, H) this process's tokens, `index` (T, k) their
    experts (global ids), `weights` (T, k) their routing weights. Returns (T, H) as the whole module's forward."""
    ep, total = module._grpo_ep
    local = total // ep.size
    T, k = index.shape
    flat = index.reshape(-1)
    owner = torch.div(flat, local, rounding_mode="floor")
    order = torch.argsort(owner, stable=True)  # the (token, expert) pairs grouped by the process running them
    send_counts = torch.bincount(owner, minlength=ep.size)
    receive_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(receive_counts, send_counts, group=ep.group)
    counts = torch.stack([send_counts, receive_counts]).cpu()  # (one host sync: the splits are lists)
    send, receive = counts[0].tolist(), counts[1].tolist()
    token = torch.div(order, k, rounding_mode="floor")
    rows = _Exchange.apply(hidden.index_select(0, token), send, receive, ep.group)
    experts = _exchange((flat.index_select(0, order) - owner.index_select(0, order) * local)[:, None], send,
                        receive, ep.group)
    if rows.shape[0]:  # the experts' own forward (any implementation) on local ids, each pair weighted 1
        out = type(module).forward(module, rows, experts, torch.ones_like(experts, dtype=rows.dtype))
    else:  # (kept in the graph: the backward's exchange must run on every process)
        out = rows * 0
    back = _Exchange.apply(out, receive, send, ep.group)
    pair_weights = weights.reshape(-1).index_select(0, order)  # (in their own dtype, as the experts' forward)
    return torch.zeros_like(hidden).index_add_(0, token, (back * pair_weights[:, None]).to(hidden.dtype))


def split_experts(model, ep: ExpertGroup) -> list[torch.nn.Parameter]:
    """Keep this process's experts of every MoE layer of `model` (its shard: dim 0 of each stacked parameter) and
    route the layer's forward over the group. Returns the shards' parameters (the same objects, smaller)."""
    from grpo.config import ConfigError

    shards = []
    for module in experts_modules(model):
        name, total = type(module).__name__, module.num_experts
        if name not in SPLITTABLE:
            raise ConfigError(f"expert_parallel_size: {name} is not an experts module grpo splits "
                              f"({', '.join(SPLITTABLE)}); set expert_parallel_size: 1.")
        if total % ep.size:
            raise ConfigError(f"expert_parallel_size: {ep.size} does not divide the model's {total} experts per "
                              f"layer; use a divisor of {total}.")
        local = total // ep.size
        for p in module._parameters.values():
            p.data = p.data[ep.rank * local:(ep.rank + 1) * local].clone()
            shards.append(p)
        module.num_experts, module._grpo_ep = local, (ep, total)
        module.forward = lambda h, i, w, m=module: ep_forward(m, h, i, w)
    return shards


@contextlib.contextmanager
def whole_experts(model, main_only: bool = False):
    """Every expert of every split layer of `model` gathered for the block, in host memory (for saving or loading
    model files; on a GPU one tensor's experts at a time are whole there): on every process, or with `main_only`
    (a save) on the main process alone (its group's processes send their shards; the other groups, replicas of
    them, send nothing). After it, this process's shard is taken back from them (what the block loaded, if it
    loaded) onto its device. Parameters keep their identity (the optimizer's). Collective; nothing for a model whose
    experts are not split."""
    split = [m for m in model.modules() if getattr(m, "_grpo_ep", None) is not None]
    rank = dist.get_rank() if split else 0
    gathered, devices = [], {}
    for module in split:
        ep, total = module._grpo_ep
        if main_only and rank >= ep.size:  # (not the main process's group)
            continue
        for p in module._parameters.values():
            parts = [torch.empty_like(p.data) for _ in range(ep.size)] if not main_only or rank == 0 else None
            if main_only:
                dist.gather(p.data.contiguous(), parts, dst=0, group=ep.group)
            else:
                dist.all_gather(parts, p.data.contiguous(), group=ep.group)
            if parts is not None:
                devices[id(p)] = p.device
                p.data = torch.cat([part.cpu() for part in parts])
        if parts is not None:
            module.num_experts = total
            gathered.append(module)
    try:
        yield
    finally:
        for module in gathered:
            ep, total = module._grpo_ep
            local = total // ep.size
            for p in module._parameters.values():
                p.data = p.data[ep.rank * local:(ep.rank + 1) * local].to(devices[id(p)], copy=True)
            module.num_experts = local


class ExpertParallel:
    """A run's expert parallelism after `split_experts`: the shards' gradients synchronized and clipped with the
    rest, and their optimizer state per process. `shards`: this process's expert parameters."""

    def __init__(self, ep: ExpertGroup, shards: list[torch.nn.Parameter]):
        self.ep, self.shards = ep, shards
        self._ids = {id(p) for p in shards}

    def sync_gradients(self) -> None:
        """Each shard's gradient summed over the processes holding it and divided by the run's processes: the
        one-process gradient (each process's loss is scaled by the processes, for DDP's mean)."""
        for p in self.shards:
            if not p.requires_grad:
                continue
            if p.grad is None:  # (no token of this step reached this process's experts: their gradient is 0)
                p.grad = torch.zeros_like(p)
            if self.ep.replicas is not None:
                dist.all_reduce(p.grad, group=self.ep.replicas)
            p.grad.div_(self.ep.processes)

    def clip(self, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip every trainable gradient to `max_norm` by the norm over every process's shards and the replicated
        weights, as torch's clip_grad_norm_ takes it (norm of the per-tensor norms); returns that norm."""
        grads = [p.grad for p in params if p.grad is not None]
        own = [g for p, g in zip(params, grads) if id(p) in self._ids]
        rest = [g for p, g in zip(params, grads) if id(p) not in self._ids]
        device = grads[0].device
        norms = torch.stack([torch.linalg.vector_norm(g.float()) for g in own]) if own else \
            torch.zeros(0, device=device)
        every = [torch.empty_like(norms) for _ in range(self.ep.size)]
        dist.all_gather(every, norms, group=self.ep.group)  # (every group's shards have the same count)
        rest_norms = [torch.linalg.vector_norm(g.float()) for g in rest]
        total = torch.linalg.vector_norm(torch.cat([torch.stack(rest_norms) if rest_norms else norms[:0], *every]))
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total

    def optimizer_part(self, optimizer) -> "_ShardOptimizerState":
        """The optimizer's state of this process's shards, for the checkpoint's per-process parts."""
        return _ShardOptimizerState(optimizer, self.shards, self.ep.size)


class _ShardOptimizerState:
    """Stateful: the optimizer state of this process's expert shards (the main process's optimizer state_dict,
    which a checkpoint holds, has only its own shards')."""

    def __init__(self, optimizer, shards: list[torch.nn.Parameter], size: int):
        self.optimizer, self.shards, self.size = optimizer, shards, size

    def state_dict(self) -> dict:
        state = [{k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                  for k, v in self.optimizer.state.get(p, {}).items()} for p in self.shards]
        return {"expert_parallel_size": self.size, "state": state}

    def load_state_dict(self, saved: dict | None) -> None:
        from grpo.config import ConfigError

        if saved is None or saved.get("expert_parallel_size") != self.size:
            found = None if saved is None else saved.get("expert_parallel_size")
            raise ConfigError(f"resume_from_checkpoint: the checkpoint's experts were split {found or 1} way(s), "
                              f"this run's expert_parallel_size is {self.size}; resume with the same.")
        for p, state in zip(self.shards, saved["state"]):
            if state:
                self.optimizer.state[p] = {k: v.to(p.device) if torch.is_tensor(v) and v.dim() else v
                                           for k, v in state.items()}
