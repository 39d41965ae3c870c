"""Ulysses sequence parallelism: one packed micro-batch's tokens split over the processes of a sequence-parallel
(SP) group, attention done head-parallel (DeepSpeed-Ulysses, arXiv 2309.14509; verl's `ulysses.py` and DeepSpeed's
`DistributedAttention` do the same).

Each of the SP ranks holds a contiguous 1/SP slice of the packed row (`shard`), with the global position ids of its
tokens, so rotary embeddings see the positions of the one-process pass. Everything but attention is per token and
runs on the slice alone. Inside each attention layer (`ulysses_attention`, registered with transformers'
`AttentionInterface` so any model that looks its attention up in `ALL_ATTENTION_FUNCTIONS` takes it):

    q, k, v (1, heads, L/SP, d) --all_to_all--> (1, heads/SP, L, d)   every token, this rank's heads
    attention per packed sequence (causal, its boundaries from `cu_seq_lens`)
    out (1, heads/SP, L, d) --all_to_all--> (1, L/SP, heads, d)        this rank's tokens, every head

The all_to_all is an autograd function whose backward is the inverse all_to_all, so gradients reach the ranks whose
tokens produced each key and value. The scored tokens' log-probs of each slice are then gathered over the group
(`gather_tokens`, whose backward keeps this rank's part), every rank computes the micro-batch's whole loss, and the
sum over the group of each rank's parameter gradients is the one-process gradient: DDP over all processes, with the
loss scaled by the number of processes (`TransformersBackend.backward`), sums them.

Key/value heads: split over the group when their count is a multiple of SP; fewer than SP (SP a multiple of them)
are repeated first, each rank receiving the one its query heads use (verl's `repeat_kv` before the all_to_all).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from grpo.engines.packing import PackedRows

NAME = "grpo_ulysses"  # the attention implementation's name in transformers' registry


@dataclass(frozen=True)
class SequenceGroup:
    """This process's sequence-parallel group: `size` processes, this one `rank` in it (`group` None: size 1)."""

    group: object
    rank: int
    size: int

    # What the transformers backend (grpo.engines.policy) calls, so that it needs no import of this module.
    def check_heads(self, config) -> None:
        check_heads(config, self.size)

    def installed(self, model):
        return installed(model)

    def logprobs(self, model, packed: PackedRows, temperature: float, with_entropy: bool = False,
                 entropy_grad: bool = False, tile_kernels=None):
        return sequence_parallel_logprobs(model, packed, self, temperature, with_entropy, entropy_grad, tile_kernels)


def sequence_group(accelerator, sp_size: int):
    """This process's sequence-parallel group: consecutive ranks [k*sp_size, (k+1)*sp_size). Collective: every
    process creates every group, in the same order."""
    rank = accelerator.process_index
    mine = None
    for start in range(0, accelerator.num_processes, sp_size):
        group = torch.distributed.new_group(list(range(start, start + sp_size)))
        if start <= rank < start + sp_size:
            mine = group
    return SequenceGroup(mine, rank % sp_size, sp_size)


@dataclass(frozen=True)
class UlyssesShard:
    """What every attention layer needs to run this rank's slice head-parallel (passed as a forward kwarg)."""

    sp: SequenceGroup
    cu_seq_lens: tuple[int, ...]  # boundaries of the packed sequences in the padded global row (Python ints)


def check_heads(config, size: int) -> None:
    """Refuse a model whose attention heads cannot be split over `size` processes, naming the setting."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads % size:
        raise ValueError(f"sequence_parallel_size={size}: the model's {heads} attention heads do not split over it; "
                         "choose a divisor of the head count.")
    if kv % size and size % kv:
        raise ValueError(f"sequence_parallel_size={size}: the model's {kv} key/value heads neither split over it nor "
                         "divide it (to be repeated); choose a divisor or multiple of the key/value head count.")
    if _sliding(config):
        raise ValueError(f"sequence_parallel_size={size}: the model has sliding-window attention layers, which the "
                         "Ulysses attention does not window; use sequence_parallel_size: 1.")


def _sliding(config) -> bool:
    kinds = getattr(config, "layer_types", None) or ()
    return any(k != "full_attention" for k in kinds) or bool(getattr(config, "use_sliding_window", False)
                                                             and getattr(config, "sliding_window", None))


class _AllToAll(torch.autograd.Function):
    """Split `x` into SP chunks along `scatter`, send chunk s to rank s, concatenate what arrives along `gather`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scatter: int, gather: int, group) -> torch.Tensor:
        ctx.scatter, ctx.gather, ctx.group = scatter, gather, group
        return _all_to_all(x, scatter, gather, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.gather, ctx.scatter, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, scatter: int, gather: int, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    send = torch.stack(x.chunk(size, dim=scatter)).contiguous()  # (SP, ...): chunk s goes to rank s
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather)


def all_to_all(x: torch.Tensor, scatter: int, gather: int, sp: SequenceGroup) -> torch.Tensor:
    """Differentiable all_to_all over the SP group (identity for a group of one)."""
    return x if sp.size == 1 else _AllToAll.apply(x, scatter, gather, sp.group)


def ulysses_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, grpo_ulysses=None,
                      **kwargs):
    """transformers' attention signature: query (1, heads, L/SP, d), key and value (1, kv_heads, L/SP, d) of this
    rank's slice -> (output (1, L/SP, heads, d), None). Without `grpo_ulysses` (a pass that is not sequence-parallel:
    generation, a padded pass) it is sdpa's own function."""
    if grpo_ulysses is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    sp = grpo_ulysses.sp
    kind = query.device.type
    if torch.is_autocast_enabled(kind):  # (RoPE's fp32 cos/sin leave q and k fp32: half the bytes over the wire, and
        dtype = torch.get_autocast_dtype(kind)  # the attention, which autocast runs in this dtype, casts no more)
        query, key, value = (t.to(dtype) for t in (query, key, value))
    kv = key.shape[1]
    if kv < sp.size:  # each rank gets the key/value head its query heads share
        key, value = (t.repeat_interleave(sp.size // kv, dim=1) for t in (key, value))
    q, k, v = (all_to_all(t, 1, 2, sp) for t in (query, key, value))  # (1, heads/SP, L, d)
    p = dropout if module.training else 0.0
    gqa = q.shape[1] != k.shape[1]
    bounds = grpo_ulysses.cu_seq_lens
    # One causal attention per packed sequence: no (L, L) mask, and sdpa's flash kernel (CPU and CUDA) applies. (One
    # varlen call would save a launch per sequence per layer; torch's varlen_attn changed its causal argument between
    # 2.11 and 2.13 and runs on CUDA only, and flash_attn's is not installed where the GPU check runs.)
    out = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], dropout_p=p, is_causal=True, scale=scaling, enable_gqa=gqa)
        for a, b in zip(bounds[:-1], bounds[1:])], dim=2)  # (1, heads/SP, L, d)
    out = all_to_all(out, 2, 1, sp)  # (1, heads, L/SP, d)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, ulysses_attention)
    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:  # non-SP passes mask as sdpa does
        AttentionMaskInterface.register(NAME, sdpa_mask)


_register()


@contextlib.contextmanager
def installed(model):
    """Run `model`'s attention through `ulysses_attention` inside the block (forward and backward, so gradient
    checkpointing's recomputation takes it too); the model's own implementation is restored after. Refuses a model
    whose attention is not sdpa (the function falls back to sdpa outside SP passes)."""
    from grpo.engines.packing import _base_model

    config = _base_model(model).config
    before = config._attn_implementation
    if before not in ("sdpa", NAME):
        raise ValueError(f"sequence_parallel_size > 1 runs attention as sdpa per packed sequence; the model's "
                         f"attn_implementation is {before!r}: set attn_implementation: sdpa.")
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before


@dataclass
class Shard:
    """This rank's part of a one-row packed micro-batch (`shard`)."""

    inputs: dict  # the decoder's keyword arguments for this rank's slice of the row
    local: torch.Tensor  # (n_r,): where in the slice the positions that predict this rank's scored tokens are
    counts: tuple[int, ...]  # scored tokens on each rank's slice
    inverse: torch.Tensor  # (n_tok,): index into the ranks' scored tokens, concatenated, of each scored token
    targets: torch.Tensor  # (n_r,): this rank's scored tokens


def shard(packed: PackedRows, sp: SequenceGroup) -> Shard:
    """Rank `sp.rank`'s slice of a one-row packed micro-batch, computed identically on every rank (no
    communication). The row is padded at its end to a multiple of SP with a sequence of its own, never scored."""
    if packed.input_ids.shape[0] != 1:
        raise ValueError("ulysses.shard: sequence parallelism needs the packed micro-batch in one row "
                         "(a Packing with pair_cost None).")
    # The index arithmetic (boundaries, owners, counts: Python values) on the CPU copy the micro-batch was built as,
    # so a device pass costs no host sync here (gpu_review2 N10); only the results move to the device.
    host = packed.host or packed
    device = packed.input_ids.device
    ids, pos = host.input_ids[0], host.position_ids[0]
    length, at = local_span(ids.shape[0], sp)
    pad = length - ids.shape[0]
    if pad:
        ids = torch.cat([ids, ids.new_full((pad,), int(ids[-1]))])
        pos = torch.cat([pos, torch.arange(pad, dtype=pos.dtype)])
    cu = tuple((pos == 0).nonzero()[:, 0].tolist()) + (length,)
    part = length // sp.size
    owner = host.score_index // part  # (n_tok,): the rank holding each scored token's predicting position
    order = torch.sort(owner, stable=True).indices  # scored tokens, rank by rank
    count = tuple(torch.bincount(owner, minlength=sp.size).tolist())
    lo = sum(count[:sp.rank])
    held = order[lo:lo + count[sp.rank]]
    ids, pos, local, inverse, targets = (t.to(device, non_blocking=True) for t in (
        ids[None, at], pos[None, at], host.score_index[held] - sp.rank * part, torch.argsort(order),
        host.targets[held]))
    inputs = dict(input_ids=ids, position_ids=pos, use_cache=False,
                  # a 4D placeholder mask: transformers passes it on as it is instead of building one per slice
                  attention_mask=torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device),
                  grpo_ulysses=UlyssesShard(sp, cu))
    return Shard(inputs, local, count, inverse, targets)


def local_span(tokens: int, sp: SequenceGroup) -> tuple[int, slice]:
    """A one-row packed micro-batch of `tokens` positions, padded to a multiple of SP (`shard`): its padded length
    and the positions rank `sp.rank` holds."""
    length = -(-tokens // sp.size) * sp.size
    part = length // sp.size
    return length, slice(sp.rank * part, (sp.rank + 1) * part)


def local_rows(x: torch.Tensor, sp: SequenceGroup, fill) -> torch.Tensor:
    """This rank's part of a per-position tensor (tokens, ...) of a one-row packed micro-batch, sliced as `shard`
    slices the tokens (the padding's rows `fill`): an MoE rollout's routes, the aux loss's token weights."""
    length, at = local_span(x.shape[0], sp)
    if length > x.shape[0]:
        x = torch.cat([x, x.new_full((length - x.shape[0], *x.shape[1:]), fill)])
    return x[at]


class _GatherTokens(torch.autograd.Function):
    """Concatenate each rank's (n_r,) values in rank order; backward keeps this rank's part of the gradient (every
    rank computes the same loss from the whole, so the gradient of its own part is already whole on each rank)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, counts: tuple[int, ...], rank: int, group) -> torch.Tensor:
        ctx.lo, ctx.hi = sum(counts[:rank]), sum(counts[:rank + 1])
        padded = torch.cat([x, x.new_zeros((max(counts) - x.shape[0], *x.shape[1:]))]).contiguous()
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([p[:n] for p, n in zip(parts, counts)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.lo:ctx.hi], None, None, None


def gather_rows(x: torch.Tensor, sp: SequenceGroup) -> torch.Tensor:
    """(SP x n, ...) every rank's equal slice (n, ...) of a one-row micro-batch's positions (`local_rows`), in
    order; backward keeps this rank's part, as `gather_tokens` (an MoE's router logits: grpo.engines.moe)."""
    return x if sp.size == 1 else _GatherTokens.apply(x, (x.shape[0],) * sp.size, sp.rank, sp.group)


def gather_tokens(x: torch.Tensor, part: Shard, sp: SequenceGroup) -> torch.Tensor:
    """(n_tok,) values of every scored token, in `PackedRows.score_index` order, from this rank's (n_r,) values."""
    whole = x if sp.size == 1 else _GatherTokens.apply(x, part.counts, sp.rank, sp.group)
    return whole.index_select(0, part.inverse)


def sequence_parallel_logprobs(model, packed: PackedRows, sp: SequenceGroup, temperature: float,
                               with_entropy: bool = False, entropy_grad: bool = False, tile_kernels=None):
    """`grpo.engines.policy.completion_logprobs` of a one-row packed micro-batch split over the SP group: (n, width)
    log-probs (and entropies) of every row, the same on every rank of the group, differentiable into this rank's
    slice. Call inside `installed(model)`, backward included.

    A plain LM head under one process or DDP (`tiled_head`) scores this rank's tokens in tiles from the decoder's
    hidden states; any other model (FSDP2 or ZeRO-3, whose head is whole only inside the wrapper's forward; a
    LoRA-wrapped head; a logit-scaling model) runs its own forward on the slice and returns logits at this rank's
    scoring positions only (`logits_to_keep` as indices: (1, n_r, V))."""
    from grpo.engines.policy import tiled_head

    part = shard(packed, sp)
    head, inner = tiled_head(model)
    if head is None:
        logp, entropy = _logits_logprobs(model, part, temperature, with_entropy, entropy_grad)
    else:
        logp, entropy = _tiled_logprobs(model, part, head, inner, temperature, with_entropy, tile_kernels)
    logp = packed.unpack(gather_tokens(logp, part, sp))
    if not with_entropy:
        return logp
    entropy = entropy if entropy_grad else entropy.detach()
    return logp, packed.unpack(gather_tokens(entropy, part, sp))


def _tiled_logprobs(model, part: Shard, head, inner, temperature: float, with_entropy: bool, tile_kernels):
    """(n_r,) log-probs (and entropies, or None) of this rank's scored tokens through the tiled head."""
    from grpo.engines.policy import head_logprobs, wrapped_hidden

    hidden = (model.get_decoder()(**part.inputs).last_hidden_state if inner is None
              else wrapped_hidden(model, inner, part.inputs))  # (1, L/SP, H)
    hidden = hidden[0].index_select(0, part.local)[None]  # (1, n_r, H)
    logp, entropy = head_logprobs(hidden, head, inner, part.targets[None], temperature, with_entropy, tile_kernels)
    return logp[0], entropy[0] if with_entropy else None


def _logits_logprobs(model, part: Shard, temperature: float, with_entropy: bool, entropy_grad: bool):
    """(n_r,) log-probs (and entropies, or None) of this rank's scored tokens from the model's own forward: the
    wrapper's hooks (FSDP2's gather and reduce-scatter, ZeRO-3's) run as in any pass."""
    from grpo.engines.policy import logits_logprobs

    logits = model(**part.inputs, logits_to_keep=part.local).logits  # (1, n_r, V)
    logp, entropy = logits_logprobs(logits, part.targets[None], temperature, with_entropy, entropy_grad)
    return logp[0], entropy[0] if with_entropy else None
