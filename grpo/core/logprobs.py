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
* `hidden_loss` (grpo/core/head_loss.py, on this module's tiles) goes one step further for a loss that is a sum
  over rows: it forms the loss's gradient in the same pass as the log-probs.

Log-probs are computed and returned in float32 (float64 for float64 input): the ratio exp(logp - old_logp) is
sensitive to bf16 rounding.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

_CHUNK_ELEMENTS = 2**26
"""float32 elements per chunk (256 MiB) when `chunk_size=None`: chunk_size = max(1, _CHUNK_ELEMENTS // V)."""

_TILE_ELEMENTS = 2**19
"""float32 logits per (positions x vocabulary rows) tile when `vocab_block=None`: 2 MiB, a CPU core's L2 cache."""

_GPU_TILE_ELEMENTS = 2**24
"""The same on a GPU (64 MiB), where each tile costs kernel launches and there is no small cache to fit."""


def _auto_block(positions: int, device: torch.device) -> int:
    """Vocabulary rows per tile for `positions` positions when the caller gives none."""
    budget = _TILE_ELEMENTS if device.type == "cpu" else _GPU_TILE_ELEMENTS
    return max(256, budget // max(1, positions))


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


def _upcast(dtype: torch.dtype) -> torch.dtype:
    """The dtype chunks are computed in: float32, or float64 when the input is float64."""
    return torch.promote_types(dtype, torch.float32)


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


def _head_block(h: Tensor, weight: Tensor, bias: Tensor | None, v0: int, width: int, temperature: float) -> Tensor:
    """Logits / temperature of vocabulary rows v0 .. v0+width for positions h (m, H): a fresh (m, width) tensor in the
    upcast dtype, safe to modify in place."""
    x = F.linear(h, weight[v0:v0 + width], None if bias is None else bias[v0:v0 + width])
    x = x.to(_upcast(x.dtype))
    return x.div_(temperature) if temperature != 1.0 else x


def _tile_targets(x: Tensor, y: Tensor, v0: int, target: Tensor | None) -> Tensor:
    """`target` with x[i, y[i] - v0] in the rows whose token is in this tile (x: vocabulary rows v0 .. v0+width of
    every position); None starts a fresh one. A gather, with no host synchronization."""
    width = x.shape[1]
    local = y - v0
    picked = x.gather(1, local.clamp(0, width - 1).unsqueeze(1)).squeeze(1)
    return picked if target is None else torch.where((local >= 0) & (local < width), picked, target)


def _head_forward(h: Tensor, weight: Tensor, bias: Tensor | None, y: Tensor, temperature: float, block: int,
                  with_entropy: bool, kernels=None) -> tuple[Tensor, Tensor, Tensor | None]:
    """(lse, logp, entropy or None), each (m,), for positions h (m, H) and targets y (m,), one vocabulary block of
    logits at a time with a running (online) log-sum-exp, as flash attention does for its softmax.

    Per row, with M the running max, s = sum exp(x - M) and s2 = sum exp(x - M) (x - M); when the max moves from M
    to M', both are rescaled by exp(M - M') and s2 also gains (M - M') s. At the end lse = M + log s and the
    entropy is H = lse - sum p x = log s - s2 / s.
    """
    vocab = weight.shape[0]
    target = running_max = s = s2 = None
    if kernels is not None:  # the same statistics, each tile's elementwise work in one call
        m = h.shape[0]
        target, running_max = h.new_zeros(m), h.new_full((m,), float("-inf"))
        s, s2 = h.new_zeros(m), h.new_zeros(m) if with_entropy else None
        tile = h.new_empty(m, min(block, vocab))
        for v0 in range(0, vocab, block):
            kernels.tile_stats(_logits_into(tile, h, weight, bias, v0, 1.0), 1.0 / temperature, y, v0, target,
                               running_max, s, s2)
    else:
        for v0 in range(0, vocab, block):
            x = _head_block(h, weight, bias, v0, block, temperature)  # (m, b)
            target = _tile_targets(x, y, v0, target)
            block_max = x.amax(-1)
            new_max = block_max if running_max is None else torch.maximum(running_max, block_max)
            # A row whose logits so far are all -inf (a filtered vocabulary) adds nothing: subtract 0, not -inf.
            x.sub_(torch.where(new_max == float("-inf"), 0.0, new_max).unsqueeze(1))  # x - M'
            e = torch.exp(x)
            e_x = torch.where(e > 0, e * x, 0.0) if with_entropy else None  # 0 at -inf logits, not 0 * -inf
            if running_max is None:
                s = e.sum(-1)
                s2 = e_x.sum(-1) if with_entropy else None
            else:
                empty = running_max == float("-inf")  # s = s2 = 0 so far: nothing to rescale
                shift = torch.where(empty, 0.0, running_max - new_max)  # <= 0
                scale = torch.where(empty, 0.0, torch.exp(shift))
                if with_entropy:
                    s2 = scale * (s2 + shift * s) + e_x.sum(-1)
                s = scale * s + e.sum(-1)
            running_max = new_max
    log_s = torch.log(s)
    lse = running_max + log_s
    entropy = log_s - s2 / s if with_entropy else None
    return lse, target - lse, entropy


def _autocast_state(device: torch.device) -> tuple[str, torch.dtype, bool]:
    """torch.autocast's (device type, dtype, enabled) as the forward runs: backward recomputes the head's logit tiles
    under it again (torch.amp.custom_bwd's rule, for whichever device the tensors are on), so they are the logits
    the forward normalised whatever state backward runs in (torch runs it outside autocast)."""
    return device.type, torch.get_autocast_dtype(device.type), torch.is_autocast_enabled(device.type)


class _HeadGrads:
    """The gradients of the tiled head, filled tile by tile: hidden (count, H) flat, weight (V, H), bias (V,).

    Each tile contributes its -p (...) part (`add_tile`); the onehot(target) part is added per position
    (`add_targets`). With `in_place`, the weight's gradient goes straight into `weight.grad` (made on first use, in
    `storage` when given), so accumulating over micro-batches needs no second (V, H) buffer.
    """

    def __init__(self, h_all: Tensor, weight: Tensor, bias: Tensor | None, needs, in_place: bool,
                 storage: Tensor | None = None):
        need_hidden, need_weight, need_bias = needs
        self.w = weight
        self.param = weight if need_weight and in_place else None
        self.hidden = torch.zeros_like(h_all) if need_hidden else None
        self.bias = torch.zeros_like(bias) if need_bias else None
        self.fresh = False  # an uninitialized buffer that the first chunk of positions overwrites
        if self.param is not None and weight.grad is not None:
            self.weight = weight.grad
        elif need_weight and h_all.shape[0] > 0:
            self.weight, self.fresh = torch.empty_like(weight) if storage is None else storage, True
        else:
            self.weight = torch.zeros_like(weight) if need_weight else None

    def add_tile(self, part: slice, h: Tensor, grad_x: Tensor, rows_v: slice, first_chunk: bool) -> None:
        """grad_x (m, width): d loss / d logits of positions `part` (inputs h) and vocabulary rows `rows_v`."""
        if self.hidden is not None:
            self.hidden[part].addmm_(grad_x, self.w[rows_v])
        if self.weight is not None:
            if self.fresh and first_chunk:
                torch.mm(grad_x.T, h, out=self.weight[rows_v])
            else:
                self.weight[rows_v].addmm_(grad_x.T, h)
        if self.bias is not None:
            self.bias[rows_v] += grad_x.sum(0)

    def add_targets(self, part: slice, h: Tensor, y: Tensor, g: Tensor) -> None:
        """The onehot(y) part of d logp_y / dx, times g (m,): +g at each position's target column."""
        g_target = g.to(self.w.dtype).unsqueeze(1)
        if self.hidden is not None:
            self.hidden[part] += g_target * self.w[y]
        if self.weight is not None:
            self.weight.index_add_(0, y, g_target * h)
        if self.bias is not None:
            self.bias.index_add_(0, y, g_target.squeeze(1))

    def result(self, hidden_shape) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """(hidden, weight, bias) gradients to return; the weight's is None when it is already in .grad."""
        grad_hidden = None if self.hidden is None else self.hidden.reshape(hidden_shape)
        if self.param is None:
            return grad_hidden, self.weight, self.bias
        if self.param.grad is None:
            self.param.grad = self.weight
        return grad_hidden, None, self.bias


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


def _logits_into(out: Tensor, h: Tensor, weight: Tensor, bias: Tensor | None, v0: int, temperature: float) -> Tensor:
    """Write the logits / temperature of vocabulary rows v0 .. v0+width into out (m, block) (width = what is left of
    the vocabulary, at most block): straight from the matrix multiply when dtypes allow, else through a copy.
    Returns out[:, :width]."""
    width = min(out.shape[1], weight.shape[0] - v0)
    rows = slice(v0, v0 + width)
    if width == out.shape[1] and out.dtype == weight.dtype == h.dtype:
        if bias is None:
            torch.mm(h, weight[rows].T, out=out)
        else:
            torch.addmm(bias[rows], h, weight[rows].T, out=out)
        if temperature != 1.0:
            out.div_(temperature)
    else:
        out[:, :width] = _head_block(h, weight, bias, v0, width, temperature)
    return out[:, :width]


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
