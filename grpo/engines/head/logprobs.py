"""Per-token log-probs and entropies without holding a float32 copy of all the logits.

Notation: N sequences, T positions, V vocabulary, H hidden size. The naive way,
`logits.float().log_softmax(-1).gather(...)`, keeps an (N, T, V) float32 tensor alive (and autograd saves it for
backward); with V ~ 150k that is ~600 MB per 1,000 positions. Here every function walks over chunks of positions,
casting one chunk to float32 at a time, and a custom autograd Function recomputes each chunk in backward instead of
saving it. Peak extra memory is a few (chunk, V) float32 tensors.

* `token_logprobs` / `token_entropy` start from logits the model already produced (N, T, V).
* `hidden_logprobs` starts one step earlier, from the final hidden states and the LM-head weight, so the (N, T, V)
  logits never exist at all, not even in the model's dtype (the idea behind Unsloth's and Liger's fused heads). It
  walks over the vocabulary too, in cache-sized tiles with a running log-sum-exp (as flash attention does).
* `hidden_loss` (grpo/engines/head/loss.py) goes one step further for a loss that is a sum over rows: it forms the
  loss's gradient in the same pass as the log-probs. Both walk the LM head's tiles of grpo/engines/head/tiles.py.

Log-probs are computed and returned in float32 (float64 for float64 input): the ratio exp(logp - old_logp) is
sensitive to bf16 rounding.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from grpo.engines.head.tiles import _auto_block, _head_block, _head_forward, _HeadGrads, _logits_into, _upcast

_CHUNK_ELEMENTS = 2**26
"""float32 elements per chunk (256 MiB) when `chunk_size=None`: chunk_size = max(1, _CHUNK_ELEMENTS // V)."""

def _chunks(rows: int, cols: int, positions: int) -> Iterator[tuple[slice, slice]]:
    """(row slice, column slice) pairs covering an (rows, cols) grid, each with at most `positions` cells.

    Whole rows are grouped when a row fits in a chunk, otherwise each row is cut into column pieces. Slicing only
    the two leading dimensions keeps `logits[rs, cs]` a view even when logits is itself a slice of a bigger tensor.
    """
    if rows == 0 or cols == 0:
        return
    if cols <= positions:
        step = positions // cols
        for r0 in range(0, rows, step):
            yield slice(r0, r0 + step), slice(None)
    else:
        for r in range(rows):
            for c0 in range(0, cols, positions):
                yield slice(r, r + 1), slice(c0, c0 + positions)


def _chunk_forward(x: Tensor, tokens: Tensor | None, with_entropy: bool) -> tuple[Tensor | None, Tensor | None]:
    """Log-prob of `tokens` and entropy under softmax(x) for one chunk.

    x: (..., V) float32 temperature-scaled logits; tokens: (...) int64 or None (then no log-prob).
    Returns logp (...) or None, entropy (...) or None.
    """
    lse = torch.logsumexp(x, dim=-1)  # (...)
    logp = x.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse if tokens is not None else None
    entropy = None
    if with_entropy:
        probs = torch.exp(x - lse.unsqueeze(-1))  # (..., V)
        # xlogy(p, p) = p log p with 0 log 0 = 0, so -inf logits (masked vocabulary) do not give NaN.
        entropy = -torch.special.xlogy(probs, probs).sum(-1)
    return logp, entropy


def _chunk_backward(x: Tensor, tokens: Tensor | None, grad_logp: Tensor | None, grad_entropy: Tensor | None) -> Tensor:
    """d(loss)/dx (..., V) for one chunk, given d(loss)/d(logp) and d(loss)/d(entropy), each (...) or None.

    With p = softmax(x):  d logp_k / dx = onehot(k) - p,   and  dH / dx_j = -p_j (log p_j + H)
    (from H = -sum_j p_j log p_j and dp_i/dx_j = p_i (delta_ij - p_j)).
    """
    probs = torch.softmax(x, dim=-1)  # (..., V)
    if grad_logp is None:
        grad = torch.zeros_like(x)
    else:
        grad = probs * -grad_logp.unsqueeze(-1)
        grad.scatter_add_(-1, tokens.unsqueeze(-1), grad_logp.unsqueeze(-1))
    if grad_entropy is not None:
        p_log_p = torch.special.xlogy(probs, probs)  # (..., V), 0 where p == 0
        entropy = -p_log_p.sum(-1, keepdim=True)
        grad -= grad_entropy.unsqueeze(-1) * (p_log_p + probs * entropy)
    return grad


def _scaled(logits: Tensor, temperature: float) -> Tensor:
    """(..., V) logits / temperature in the upcast dtype (no extra copy when already float32 and temperature 1)."""
    x = logits.to(_upcast(logits.dtype))
    return x if temperature == 1.0 else x / temperature


def _over_temperature(grad: Tensor | None, temperature: float) -> Tensor | None:
    """Chain rule through x = logits / temperature, applied to the small (N, T) upstream gradient instead of the
    (N, T, V) result: d/d(logits) = (1 / temperature) d/dx, and _chunk_backward is linear in its upstream grads."""
    return None if grad is None else grad / temperature


def _part(tensor: Tensor | None, rs: slice, cs: slice) -> Tensor | None:
    return None if tensor is None else tensor[rs, cs]


class _LogitsLogprob(torch.autograd.Function):
    """(logits (N, T, V), tokens (N, T) or None) -> (logp (N, T) or None, entropy (N, T) or None), chunked.

    Backward saves only the caller's logits (no float32 copy) and recomputes each chunk's softmax.
    """

    @staticmethod
    def forward(ctx, logits, tokens, temperature, positions, with_entropy):
        ctx.set_materialize_grads(False)  # an unused output (e.g. entropy) gets grad None, and its work is skipped
        rows, cols = logits.shape[:2]
        dtype = _upcast(logits.dtype)
        logp = torch.zeros((rows, cols), dtype=dtype, device=logits.device) if tokens is not None else None
        entropy = torch.zeros((rows, cols), dtype=dtype, device=logits.device) if with_entropy else None
        for rs, cs in _chunks(rows, cols, positions):
            x = _scaled(logits[rs, cs], temperature)  # (r, c, V): the only float32 copy alive
            chunk_logp, chunk_entropy = _chunk_forward(x, _part(tokens, rs, cs), with_entropy)
            if logp is not None:
                logp[rs, cs] = chunk_logp
            if entropy is not None:
                entropy[rs, cs] = chunk_entropy
        ctx.save_for_backward(logits, tokens)
        ctx.temperature, ctx.positions = temperature, positions
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        logits, tokens = ctx.saved_tensors
        grad_logp = _over_temperature(grad_logp, ctx.temperature)
        grad_entropy = _over_temperature(grad_entropy, ctx.temperature)
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # chunks fill all of it
        for rs, cs in _chunks(logits.shape[0], logits.shape[1], ctx.positions):
            x = _scaled(logits[rs, cs], ctx.temperature)
            grad_logits[rs, cs] = _chunk_backward(x, _part(tokens, rs, cs), _part(grad_logp, rs, cs),
                                                  _part(grad_entropy, rs, cs))
        return grad_logits, None, None, None, None


def _autocast_state(device: torch.device) -> tuple[str, torch.dtype, bool]:
    """torch.autocast's (device type, dtype, enabled) as the forward runs: backward recomputes the head's logit tiles
    under it again (torch.amp.custom_bwd's rule, for whichever device the tensors are on), so they are the logits
    the forward normalised whatever state backward runs in (torch runs it outside autocast)."""
    return device.type, torch.get_autocast_dtype(device.type), torch.is_autocast_enabled(device.type)


class _HiddenLogprob(torch.autograd.Function):
    """(hidden (N, T, H), weight (V, H), bias (V,) or None, tokens (N, T)) -> (logp (N, T), entropy (N, T) or None).

    Applies the LM head to `positions` positions and `block` vocabulary rows at a time: each (positions, block)
    logit tile is small enough to stay in cache, and the matrix multiplies keep a wide inner dimension, which is
    what makes them fast on CPUs (a (positions, V) slab of a 150k vocabulary runs at about half the speed).
    Forward keeps a running log-sum-exp per position; backward recomputes each tile from the saved log-sum-exp, so
    neither the (N, T, V) logits nor their softmax is ever kept. Gradients are produced only for inputs that need
    them (a frozen LM head under LoRA gets no weight gradient, which saves a (V, H) buffer).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, temperature, positions, block, with_entropy, grad_in_place,
                kernels):
        ctx.set_materialize_grads(False)
        ctx.weight, ctx.kernels = weight if grad_in_place else None, kernels
        ctx.autocast = _autocast_state(hidden.device)
        rows, cols, size = hidden.shape
        h_all, y_all = hidden.reshape(-1, size), tokens.reshape(-1)
        dtype = _upcast(hidden.dtype)
        lse = torch.empty(h_all.shape[0], dtype=dtype, device=hidden.device)
        logp = torch.empty_like(lse)
        entropy = torch.empty_like(lse) if with_entropy else None
        for p0 in range(0, h_all.shape[0], positions):
            part = slice(p0, p0 + positions)
            lse[part], logp[part], chunk_entropy = _head_forward(h_all[part], weight, bias, y_all[part], temperature,
                                                                 block, with_entropy, kernels)
            if entropy is not None:
                entropy[part] = chunk_entropy
        ctx.save_for_backward(hidden, weight, bias, tokens, lse, entropy)
        ctx.temperature, ctx.positions, ctx.block = temperature, positions, block
        logp = logp.reshape(rows, cols)
        return logp, entropy.reshape(rows, cols) if entropy is not None else None

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        """With p = softmax(x): d logp_y / dx = onehot(y) - p and dH / dx_j = -p_j (log p_j + H), so per tile
        d(loss)/dx = -p (g + g_H (log p + H)), plus g at the target column, added once at the end."""
        with torch.autocast(*ctx.autocast):
            return _HiddenLogprob._backward(ctx, grad_logp, grad_entropy)

    @staticmethod
    def _backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, tokens, lse, entropy = ctx.saved_tensors
        size = hidden.shape[-1]
        h_all, y_all = hidden.reshape(-1, size), tokens.reshape(-1)
        g = _over_temperature(grad_logp, ctx.temperature)
        g = torch.zeros_like(lse) if g is None else g.reshape(-1).to(lse.dtype)
        g_entropy = _over_temperature(grad_entropy, ctx.temperature)
        g_entropy = None if g_entropy is None else g_entropy.reshape(-1).to(lse.dtype)
        # In place, the gradient goes into the parameter's own .grad: ctx.weight is that parameter, while the saved
        # `weight` may be another tensor object over its memory (under saved-tensor hooks: activation offload, torch's
        # save_on_cpu), whose .grad autograd never reads; writing there dropped the head's gradient.
        grads = _HeadGrads(h_all, weight if ctx.weight is None else ctx.weight, bias, ctx.needs_input_grad[:3],
                           ctx.weight is not None)
        tile = None if ctx.kernels is None else h_all.new_empty(min(ctx.positions, h_all.shape[0]),
                                                                min(ctx.block, weight.shape[0]))
        for p0 in range(0, h_all.shape[0], ctx.positions):
            part = slice(p0, p0 + ctx.positions)
            h, chunk_lse, chunk_g = h_all[part], lse[part].unsqueeze(1), g[part].unsqueeze(1)
            per_row = (lse[part], g[part], *((None, None) if g_entropy is None else (g_entropy[part], entropy[part])))
            for v0 in range(0, weight.shape[0], ctx.block):
                if ctx.kernels is not None:  # the same d loss / d logits, in one call
                    grad_x = ctx.kernels.tile_grad(_logits_into(tile[:h.shape[0]], h, weight, bias, v0, 1.0),
                                                   1.0 / ctx.temperature, *per_row)
                else:
                    x = _head_block(h, weight, bias, v0, ctx.block, ctx.temperature)  # (m, b)
                    log_p = x.sub_(chunk_lse)
                    p = torch.exp(log_p)
                    if g_entropy is None:
                        factor = chunk_g
                    else:  # log p of a -inf logit floored where p is 0 anyway, so p * factor is 0, not 0 * -inf
                        factor = log_p.clamp_(min=-1e4).add_(entropy[part].unsqueeze(1)).mul_(
                            g_entropy[part].unsqueeze(1)).add_(chunk_g)
                    grad_x = p.mul_(factor).neg_().to(weight.dtype)  # (m, b), without the target column's +g
                grads.add_tile(part, h, grad_x, slice(v0, v0 + grad_x.shape[1]), first_chunk=p0 == 0)
        grads.add_targets(slice(None), h_all, y_all, g)
        return (*grads.result(hidden.shape), None, None, None, None, None, None, None)


def _check_args(name: str, leading: torch.Size, tokens: Tensor | None, temperature: float, chunk_size) -> None:
    """Raise ValueError naming function `name` if tokens (expected shape `leading`), temperature or chunk_size
    do not fit."""
    if tokens is not None and tokens.shape != leading:
        raise ValueError(f"{name}: tokens must have shape (N, T) = {tuple(leading)}, got {tuple(tokens.shape)}")
    if tokens is not None and tokens.is_floating_point():
        raise ValueError(f"{name}: tokens must be integer token ids, got dtype {tokens.dtype}")
    if not temperature > 0:
        raise ValueError(f"{name}: temperature must be > 0, got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"{name}: chunk_size must be a positive number of positions or None, got {chunk_size}")


def _check_token_range(name: str, tokens: Tensor, vocab: int) -> None:
    """Raise ValueError naming `name` if a token id is outside [0, vocab) (e.g. -100 padding): the tiled head would
    otherwise read a wrong logit instead of failing. On an accelerator the check runs on the device (a device-side
    assertion), so the host does not wait for it."""
    if tokens.device.type != "cpu":
        if tokens.numel():
            torch._assert_async(((tokens >= 0) & (tokens < vocab)).all(), f"{name}: token ids must be in [0, {vocab})")
        return
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise ValueError(f"{name}: token ids must be in [0, {vocab}), got min {int(tokens.min())} and max "
                         f"{int(tokens.max())}; replace padding ids (e.g. -100) by a real id and mask them out")


def _positions(chunk_size: int | None, vocab: int) -> int:
    """Positions per chunk: the caller's chunk_size, or as many as fit in _CHUNK_ELEMENTS float32 values."""
    return chunk_size if chunk_size is not None else max(1, _CHUNK_ELEMENTS // max(vocab, 1))


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0, chunk_size: int | None = None) -> Tensor:
    """log softmax(logits / temperature)[token] at every position, differentiable w.r.t. logits.

    Args:
        logits: (N, T, V) logits in any float dtype, position t predicting tokens[:, t] (shift before calling).
        tokens: (N, T) int token ids in [0, V).
        temperature: the sampling temperature; dividing by it makes the log-probs those of the sampler.
        chunk_size: positions processed at once; None picks max(1, 2**26 // V).

    Returns:
        (N, T) float32 log-probs (float64 for float64 logits).
    """
    if logits.dim() != 3:
        raise ValueError(f"token_logprobs: logits must be (N, T, V), got {tuple(logits.shape)}")
    _check_args("token_logprobs", logits.shape[:2], tokens, temperature, chunk_size)
    positions = _positions(chunk_size, logits.shape[-1])
    logp, _ = _LogitsLogprob.apply(logits, tokens.long(), temperature, positions, False)
    return logp


def token_entropy(logits: Tensor, chunk_size: int | None = None, temperature: float = 1.0) -> Tensor:
    """Entropy -sum_v p_v log p_v of softmax(logits / temperature) at every position, differentiable.

    Args:
        logits: (N, T, V) logits in any float dtype.
        chunk_size: positions processed at once; None picks max(1, 2**26 // V).
        temperature: as in `token_logprobs`; 1.0 gives the entropy of the model's own distribution.

    Returns:
        (N, T) float32 entropies in nats (float64 for float64 logits).
    """
    if logits.dim() != 3:
        raise ValueError(f"token_entropy: logits must be (N, T, V), got {tuple(logits.shape)}")
    _check_args("token_entropy", logits.shape[:2], None, temperature, chunk_size)
    _, entropy = _LogitsLogprob.apply(logits, None, temperature, _positions(chunk_size, logits.shape[-1]), True)
    return entropy


def hidden_logprobs(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    bias: Tensor | None = None,
    with_entropy: bool = False,
    vocab_block: int | None = None,
    weight_grad_in_place: bool = False,
    kernels=None,
    float32_head: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Token log-probs (and entropies) straight from final hidden states and the LM-head weight.

    Equivalent to `token_logprobs(hidden @ weight.T + bias, tokens, temperature)` (gradients w.r.t. hidden, weight
    and bias included), but the LM head runs on tiles of `chunk_size` positions x `vocab_block` vocabulary rows
    with a running log-sum-exp, and backward recomputes each tile, so memory stays O(chunk_size * vocab_block)
    instead of O(N * T * V).

    Args:
        hidden: (N, T, H) final hidden states (after the last norm), position t predicting tokens[:, t].
        weight: (V, H) LM-head weight (tied embeddings included), same dtype as hidden.
        tokens: (N, T) int token ids in [0, V).
        temperature: the sampling temperature.
        chunk_size: positions per chunk.
        bias: (V,) LM-head bias, or None.
        with_entropy: also return the (N, T) entropy of softmax(logits / temperature).
        vocab_block: vocabulary rows per tile; None picks max(256, 2**19 // chunk positions) on CPU (a 2 MiB float32
            tile, which fits a core's L2 cache) and max(256, 2**24 // chunk positions) on GPU.
        weight_grad_in_place: backward adds the weight's gradient straight into `weight.grad` (creating it if None)
            instead of returning it, so no second (V, H) buffer is made when gradients accumulate over micro-batches.
            Only for a leaf parameter trained with `.backward()` and no gradient hooks on it (not DDP, not
            `torch.autograd.grad`, which would see no gradient for the weight).
        kernels: None, or an object doing each float32 tile's elementwise work in one call, with the torch code's
            results up to rounding: `tile_stats(x, inv_t, y, v0, target, run_max, s, s2)` folds an unscaled
            (m, b) logit tile of vocabulary rows v0 .. v0+b into the running statistics of `_head_forward` (in
            place), and `tile_grad(x, inv_t, lse, g, g_entropy, entropy)` turns it into d loss / d logits without
            the target's +g (in place; returns it). grpo.engines.cpu.native.TileKernels is one (compiled C).
        float32_head: the head's products in float32 with autocast off (TRL's cast_lm_head_to_fp32), whatever the
            dtypes of hidden and weight and the caller's autocast: logits of bf16 hidden states are not rounded to
            bf16 before the softmax. Gradients flow back to hidden, weight and bias in their own dtypes.

    Returns:
        (logp, entropy): (N, T) float32 log-probs (float64 for float64 input) and entropies of the same dtype, or
            None for entropy when with_entropy=False.
    """
    if hidden.dim() != 3 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            "hidden_logprobs: need hidden (N, T, H) and weight (V, H), "
            f"got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"hidden_logprobs: bias must be (V,) = {tuple(weight.shape[:1])}, got {tuple(bias.shape)}")
    _check_args("hidden_logprobs", hidden.shape[:2], tokens, temperature, chunk_size)
    _check_token_range("hidden_logprobs", tokens, weight.shape[0])
    if vocab_block is not None and vocab_block < 1:
        raise ValueError(f"hidden_logprobs: vocab_block must be a positive number of rows or None, got {vocab_block}")
    if vocab_block is None:
        vocab_block = _auto_block(min(chunk_size, tokens.numel()), hidden.device)
    if float32_head:  # (the Function keeps autocast off in its backward too: it replays the forward's state)
        in_place = weight_grad_in_place and weight.dtype == torch.float32  # (else .float() is a copy, not the leaf)
        kernels = kernels if hidden.dtype == torch.float32 else None  # (the caller chose them for hidden's dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            return _HiddenLogprob.apply(hidden.float(), weight.float(), None if bias is None else bias.float(),
                                        tokens.long(), temperature, chunk_size, vocab_block, with_entropy, in_place,
                                        kernels)
    return _HiddenLogprob.apply(hidden, weight, bias, tokens.long(), temperature, chunk_size, vocab_block,
                                with_entropy, weight_grad_in_place, kernels)
