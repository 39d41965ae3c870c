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
* `hidden_loss` goes one step further for a loss that is a sum over rows: it forms the loss's gradient in the same
  pass as the log-probs, so the head is applied three times per position instead of four: through a buffer of
  whole rows' logits, or, given estimates of the log-probs (the sampler's own), with no buffer, each position's
  logits shifted by its estimated log-sum-exp.

Log-probs are computed and returned in float32 (float64 for float64 input): the ratio exp(logp - old_logp) is
sensitive to bf16 rounding.
"""

from __future__ import annotations

import math
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
        hidden, weight, bias, tokens, lse, entropy = ctx.saved_tensors
        size = hidden.shape[-1]
        h_all, y_all = hidden.reshape(-1, size), tokens.reshape(-1)
        g = _over_temperature(grad_logp, ctx.temperature)
        g = torch.zeros_like(lse) if g is None else g.reshape(-1).to(lse.dtype)
        g_entropy = _over_temperature(grad_entropy, ctx.temperature)
        g_entropy = None if g_entropy is None else g_entropy.reshape(-1).to(lse.dtype)
        grads = _HeadGrads(h_all, weight, bias, ctx.needs_input_grad[:3], ctx.weight is not None)
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


def _loss_and_grad(row_loss, logp: Tensor, rows: slice) -> tuple[Tensor, Tensor]:
    """row_loss(logp (r, T), rows) and its gradient d loss / d logp, flat (r * T,) in logp's dtype; both detached."""
    leaf = logp.detach().requires_grad_()
    with torch.enable_grad():
        loss = row_loss(leaf, rows)
    (g,) = torch.autograd.grad(loss, leaf, allow_unused=True)
    g = torch.zeros_like(leaf) if g is None else g
    return loss.detach(), g.reshape(-1).to(logp.dtype)


def _saved_grads(ctx, grad_loss: Tensor) -> list:
    """The gradients a one-pass loss saved during forward, scaled by the incoming grad_loss."""
    if ctx.weight_in_place_guard and float(grad_loss) != 1.0:
        raise RuntimeError("hidden_loss(weight_grad_in_place=True): the weight's gradient was added to .grad "
                           "during forward, so backward must start from this loss with gradient 1 "
                           "(loss.backward()); scale row_loss instead.")
    return [None if g is None else (g if float(grad_loss) == 1.0 else g * grad_loss) for g in ctx.grads]


class _HiddenLoss(torch.autograd.Function):
    """(hidden (N, T, H), weight (V, H), bias, tokens (N, T), row_loss) -> (loss, logp (N, T), entropy or None), with
    the gradient computed during forward: see `hidden_loss`. Backward only scales the saved gradients."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, row_loss, temperature, rows_per_chunk, block, with_entropy,
                grad_in_place, kernels, storage):
        rows, cols, size = hidden.shape
        vocab = weight.shape[0]
        dtype = _upcast(hidden.dtype)
        ctx.weight_in_place_guard = ctx.needs_input_grad[1] and grad_in_place
        h_all = hidden.reshape(-1, size)
        grads = _HeadGrads(h_all, weight, bias, ctx.needs_input_grad[:3], grad_in_place, storage)
        tiles = -(-vocab // block)
        buffer = torch.empty((tiles, min(rows_per_chunk, rows) * cols, block), dtype=dtype, device=hidden.device)
        logp_all = torch.empty((rows, cols), dtype=dtype, device=hidden.device)
        entropy_all = torch.empty_like(logp_all) if with_entropy else None
        total = torch.zeros((), dtype=dtype, device=hidden.device)
        for r0 in range(0, rows, rows_per_chunk):
            part = slice(r0, min(r0 + rows_per_chunk, rows))
            flat = slice(part.start * cols, part.stop * cols)  # these rows' positions in h_all
            h, y = h_all[flat], tokens[part].reshape(-1)
            m = h.shape[0]
            x = buffer[:, :m]  # (tiles, m, block): the chunk's logits, tile by tile
            for i in range(tiles):
                _logits_into(x[i], h, weight, bias, i * block, temperature)
            x[-1, :, vocab - (tiles - 1) * block:] = float("-inf")  # the last tile's unused columns, if any
            target = x[y // block, torch.arange(m, device=y.device), y % block]  # (m,)
            row_max = x.amax(dim=(0, 2))  # (m,)
            s = torch.zeros_like(row_max)
            s2 = torch.zeros_like(row_max) if with_entropy else None
            for i in range(tiles):  # x <- exp(x - max), keeping sum e and sum e (x - max)
                shifted = x[i, :, :min(block, vocab - i * block)]
                if kernels is not None:  # the same, in one call
                    kernels.tile_exp(shifted, row_max, s, s2)
                    continue
                shifted.sub_(row_max[:, None])
                if with_entropy:
                    e = torch.exp(shifted)
                    s2 += torch.where(e > 0, e * shifted, 0.0).sum(-1)  # 0 at -inf logits, not 0 * -inf
                    shifted.copy_(e)
                else:
                    e = shifted.exp_()
                s += e.sum(-1)
            log_s = torch.log(s)
            logp = (target - row_max - log_s).reshape(-1, cols)
            entropy = (log_s - s2 / s).reshape(-1, cols) if with_entropy else None
            logp_all[part] = logp
            if entropy is not None:
                entropy_all[part] = entropy
            loss, g = _loss_and_grad(row_loss, logp, part)
            total += loss
            g = _over_temperature(g, temperature)  # d loss / d logp, per position
            scale = (-g / s)[:, None]  # d logp_y / dx_j = onehot - e_j / s
            for i in range(tiles):
                width = min(block, vocab - i * block)
                grad_x = x[i, :, :width].mul_(scale).to(weight.dtype)  # (m, width), without the target's +g
                grads.add_tile(flat, h, grad_x, slice(i * block, i * block + width), first_chunk=r0 == 0)
            grads.add_targets(flat, h, y, g)
        ctx.grads = grads.result(hidden.shape)
        return total, logp_all, entropy_all

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_logp, _grad_entropy):
        return (*_saved_grads(ctx, grad_loss), None, None, None, None, None, None, None, None, None)


_SHIFT_CAP = 2.0
"""The largest exponent x - shift that `_HiddenLossSeeded` takes: a position whose logits rise further above its
shift (its log-prob estimate was > 2 nats too high) gets its log-sum-exp recomputed exactly."""

_STOP_SUM = math.exp(_SHIFT_CAP)
"""e^2: a position whose running sum S passes this in `_HiddenLossSeeded`'s pass (its estimate more than 2 nats too
high) adds nothing more to the weight's gradient there; the correcting pass adds its exact terms."""

_COUPLED_TOLERANCE = 1e-5
"""Where some log-prob estimates are off, `_HiddenLossSeeded` also corrects positions whose loss gradient moved by
more than this fraction of the largest (the loss may couple positions)."""

_TRUSTED_LOG_S = 8.0
"""`_HiddenLossSeeded` takes a position's log-sum-exp from its own sum S when |log S| is at most this (the estimate
within 8 nats of the log-prob: log S carries rounding in proportion to its size); otherwise from a pass of its own."""


def _target_logits(h: Tensor, weight: Tensor, bias: Tensor | None, y: Tensor, temperature: float) -> Tensor:
    """Each position's target logit / temperature (m,), in the upcast dtype."""
    dtype = _upcast(h.dtype)
    x = (h.to(dtype) * weight[y].to(dtype)).sum(-1)
    if bias is not None:
        x = x + bias[y].to(dtype)
    return x / temperature


def _shifted_exp(x: Tensor, shift: Tensor, s: Tensor, s2: Tensor | None, top: Tensor, kernels) -> Tensor:
    """x (m, b) <- exp(min(x - shift, _SHIFT_CAP)) in place (shift (m,)), adding its row sums to s, those of
    exp(...) (x - shift) to s2 (when not None), and folding the rows' max(x - shift), before capping, into top."""
    if kernels is not None:
        kernels.shifted_exp(x, shift, _SHIFT_CAP, s, s2, top)
        return x
    d = x.sub_(shift.unsqueeze(1))
    if d.shape[1]:
        torch.maximum(top, d.amax(1), out=top)
    e = torch.exp(d.clamp_(max=_SHIFT_CAP))
    if s2 is not None:
        s2 += torch.where(e > 0, e * d, 0.0).sum(-1)  # 0 at -inf logits, not 0 * -inf
    s += e.sum(-1)
    return x.copy_(e)


class _HiddenLossSeeded(torch.autograd.Function):
    """`hidden_loss` given estimates of the log-probs: one pass over vocabulary tiles of all positions, each tile's
    logits shifted by the estimated log-sum-exp instead of held until the exact one is known. See `hidden_loss`."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, row_loss, estimate, temperature, block, with_entropy,
                grad_in_place, tolerance, kernels, storage):
        rows, cols, size = hidden.shape
        dtype = _upcast(hidden.dtype)
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        ctx.weight_in_place_guard = need_weight and grad_in_place
        h, y = hidden.reshape(-1, size), tokens.reshape(-1)
        m = h.shape[0]
        grads = _HeadGrads(h, weight, None, (False, need_weight, False), grad_in_place, storage)
        bias_grad = torch.zeros_like(bias) if need_bias else None
        # A non-finite estimate becomes 0, too high for any token but the likeliest: handled as a far-off one; so
        # does a positive one, which no log-prob is.
        est = torch.nan_to_num(estimate.reshape(-1).to(dtype), nan=0.0, posinf=0.0, neginf=0.0).clamp_(max=0.0)
        # Shift each position's logits x by L = x_target - estimate: L is the log-sum-exp when the estimate is the
        # log-prob, so q = exp(x - L) is the softmax; in general q = p S with S = sum q = exp(lse - L).
        target = _target_logits(h, weight, bias, y, temperature)
        shift = (target - est).contiguous()
        # The tiles of a bfloat16 or float16 head are rounded to it before scoring: there each target logit is
        # taken from its tile, as the other paths do, rather than from the float32 product above.
        tile_target = target.clone() if h.dtype not in (torch.float32, torch.float64) else None
        _, g_hat = _loss_and_grad(row_loss, est.reshape(rows, cols), slice(0, rows))
        # d loss / d logits = coef_hat q off the target column, were S = 1; 0 where the loss's gradient at the
        # estimate is not finite (the correcting pass then adds the whole exact term).
        raw = -g_hat / temperature
        coef_hat = torch.nan_to_num(raw, nan=0.0, posinf=0.0, neginf=0.0)
        changed = coef_hat != raw  # the correcting pass takes these positions whatever their estimates
        adding = grads.weight is not None or bias_grad is not None
        h_hat = h * coef_hat.unsqueeze(1).to(h.dtype) if grads.weight is not None else None
        coef_add = coef_hat.clone()  # coef_hat, or 0 for a row from its stop on
        vocab = weight.shape[0]
        stop = torch.full((m,), vocab, dtype=torch.long, device=h.device)
        s = torch.zeros(m, dtype=dtype, device=h.device)
        s2 = torch.zeros_like(s) if with_entropy else None
        top = torch.full_like(s, float("-inf"))
        sum_qw = torch.zeros((m, size), dtype=dtype, device=h.device) if need_hidden else None  # sum_v q_v W_v
        tile = torch.empty((m, min(block, vocab)), dtype=dtype, device=h.device)
        for v0 in range(0, vocab, block):
            x = _logits_into(tile, h, weight, bias, v0, temperature)
            if tile_target is not None:
                tile_target = _tile_targets(x, y, v0, tile_target)
            q = _shifted_exp(x, shift, s, s2, top, kernels)
            rows_v = slice(v0, v0 + q.shape[1])
            if sum_qw is not None:
                sum_qw.addmm_(q, weight[rows_v].to(dtype))
            if adding:
                # A row whose sum passes e^2 (its estimate > 2 nats too high: every q ~ p S is inflated) adds
                # nothing from this tile on, so the correcting pass never cancels large terms.
                over = (s > _STOP_SUM) & (stop == vocab)
                if bool(over.any()):
                    stop[over], coef_add[over] = v0, 0.0
                    if h_hat is not None:
                        h_hat[over] = 0.0
            if h_hat is not None:
                grads.add_tile(slice(None), h_hat, q.to(weight.dtype), rows_v, first_chunk=True)
            if bias_grad is not None:
                bias_grad[rows_v] += (q.T @ coef_add).to(bias.dtype)
        log_s = torch.log(s)
        lse, logp = shift + log_s, est - log_s  # logp = target - lse, without the rounding of lse
        if tile_target is not None:
            logp = tile_target - lse
            target = tile_target
        entropy = log_s - s2 / s if with_entropy else None
        # Positions whose S is not to be trusted (a capped exponent, an estimate > 8 nats off, NaN): their exact
        # log-sum-exp (and entropy) from a pass over their rows only.
        bad = ~((top <= _SHIFT_CAP) & (log_s.abs() <= _TRUSTED_LOG_S))
        if bool(bad.any()):
            (idx,) = bad.nonzero(as_tuple=True)
            lse[idx], _, bad_entropy = _head_forward(h[idx], weight, bias, y[idx], temperature, block,
                                                     with_entropy, kernels)
            logp[idx], log_s[idx] = target[idx] - lse[idx], lse[idx] - shift[idx]
            if entropy is not None:
                entropy[idx] = bad_entropy
        loss, g = _loss_and_grad(row_loss, logp.reshape(rows, cols), slice(0, rows))
        coef = g / temperature  # d loss / d logits = coef (onehot - p)
        p_scale = torch.where(bad, 0.0, torch.exp(-log_s))  # p = q / S where S is trusted (others: see below)
        # The weight's gradient so far is sum coef_hat q h over positions; exact is -sum coef p h. A second pass goes
        # over the positions where the two may differ (below) and the untrusted ones whose hidden gradient needs
        # sum p W.
        live = (coef != 0) | (coef_hat != 0)
        fix = bad & live if (adding or need_hidden) else torch.zeros_like(bad)
        if adding and m:
            # Positions whose estimate is the log-prob up to rounding (within `tolerance` nats) took their loss
            # gradient at what is, to float32, the log-prob; the others need the second pass, and, as a loss may
            # couple positions (a row's mean, a sequence-level ratio), so do any whose coefficient moved by more
            # than _COUPLED_TOLERANCE of the largest.
            off = ~((est - logp).abs() <= tolerance)
            fix |= live & ((stop < vocab) | off | changed)
            if bool(off.any()):
                gap = (-coef * p_scale - coef_hat).abs()
                fix |= live & (gap > _COUPLED_TOLERANCE * float(coef.abs().max()))
        sum_pw = sum_qw * p_scale.unsqueeze(1) if need_hidden else None
        if bool(fix.any()):
            (idx,) = fix.nonzero(as_tuple=True)
            idx_pw = _correct_seeded(h[idx], weight, bias, temperature, block, shift[idx], lse[idx], coef[idx],
                                     coef_hat[idx], stop[idx], grads if need_weight else None, bias_grad,
                                     need_hidden and bool(bad[idx].any()), kernels)
            if idx_pw is not None:
                sum_pw[idx] = idx_pw
        grads.add_targets(slice(None), h, y, coef)
        if bias_grad is not None:
            bias_grad.index_add_(0, y, coef.to(bias.dtype))
        grad_hidden = None
        if need_hidden:  # coef (W_target - sum_v p_v W_v)
            grad_hidden = (coef.unsqueeze(1) * (weight[y].to(dtype) - sum_pw)).to(hidden.dtype).reshape(hidden.shape)
        ctx.grads = (grad_hidden, grads.result(hidden.shape)[1], bias_grad)
        return loss, logp.reshape(rows, cols), None if entropy is None else entropy.reshape(rows, cols)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_logp, _grad_entropy):
        return (*_saved_grads(ctx, grad_loss), None, None, None, None, None, None, None, None, None, None)


def _correct_seeded(h, weight, bias, temperature, block, shift, lse, coef, coef_hat, stop, grads, bias_grad, want_pw,
                    kernels):
    """The second pass of `_HiddenLossSeeded` over the positions h (k, H) that need it: each tile's logits again,
    p = exp(x - lse) and the first pass's q; adds (-coef p - coef_hat q)^T h to the weight gradient (when `grads`;
    the q term only for vocabulary rows before each position's `stop`, as the first pass added it) and the column
    sums to `bias_grad` (when not None), and returns sum_v p_v W_v (k, H) when `want_pw`."""
    dtype = lse.dtype
    sum_pw = torch.zeros(h.shape, dtype=dtype, device=h.device) if want_pw else None
    tile = torch.empty((h.shape[0], min(block, weight.shape[0])), dtype=dtype, device=h.device)
    unused, unused_top = torch.zeros_like(lse), torch.zeros_like(lse)
    for v0 in range(0, weight.shape[0], block):
        x = _logits_into(tile, h, weight, bias, v0, temperature)
        rows_v = slice(v0, v0 + x.shape[1])
        p = torch.exp(x - lse.unsqueeze(1))
        if sum_pw is not None:
            sum_pw.addmm_(p, weight[rows_v].to(dtype))
        if grads is None and bias_grad is None:
            continue
        q = _shifted_exp(x, shift, unused, None, unused_top, kernels)  # the first pass's q
        added = torch.where(stop > v0, coef_hat, 0.0)
        grad_x = p.mul_(-coef.unsqueeze(1)).sub_(q.mul_(added.unsqueeze(1)))
        if grads is not None:
            grads.add_tile(slice(None), h, grad_x.to(weight.dtype), rows_v, first_chunk=False)
        if bias_grad is not None:
            bias_grad[rows_v] += grad_x.sum(0).to(bias_grad.dtype)
    return sum_pw


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
    otherwise read a wrong logit instead of failing."""
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
            the target's +g (in place; returns it). grpo.native.TileKernels is one (compiled C).

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
    return _HiddenLogprob.apply(hidden, weight, bias, tokens.long(), temperature, chunk_size, vocab_block,
                                with_entropy, weight_grad_in_place, kernels)


def hidden_loss(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    row_loss,
    temperature: float = 1.0,
    bias: Tensor | None = None,
    with_entropy: bool = False,
    rows_per_chunk: int = 1,
    vocab_block: int | None = None,
    weight_grad_in_place: bool = False,
    kernels=None,
    logp_estimate: Tensor | None = None,
    tolerance: float = 1e-5,
    weight_grad_storage: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """A loss of the token log-probs and its gradient, in one pass over the LM head instead of two.

    `hidden_logprobs` followed by a loss applies the head four times per position (forward; in backward the
    recomputed logits and the two gradient products). When the loss is a sum over rows, the gradient of each row's
    loss with respect to its log-probs is known as soon as the row's log-probs are: here each chunk of
    `rows_per_chunk` whole rows has its (rows x T, V) logits computed once into a buffer, its loss and
    d loss / d logp taken by autograd on the small (rows, T) log-prob tensor, and the gradient tiles formed in place
    from the buffer: three applications of the head. Backward only scales the saved gradients.

    Args:
        hidden: (N, T, H) final hidden states, position t predicting tokens[:, t].
        weight: (V, H) LM-head weight; bias: (V,) or None.
        tokens: (N, T) int token ids.
        row_loss: f(logp (r, T), rows: slice) -> scalar tensor, the loss of rows `rows` (the loss must be the sum
            of these over row chunks, as policy_loss is for any aggregation when given a normalizer).
        temperature: the sampling temperature.
        with_entropy: also return the (N, T) entropies (detached).
        rows_per_chunk: rows whose logits are held at once: the buffer is rows_per_chunk x T x V values.
        vocab_block: vocabulary rows per tile (None: as in `hidden_logprobs`).
        weight_grad_in_place: add the weight's gradient straight into `weight.grad` during forward (no (V, H)
            buffer); backward must then start from this loss with gradient 1 (a plain `loss.backward()`).
        kernels: as in `hidden_logprobs`; here its `tile_exp(x, row_max, s, s2)` turns a float32 buffer tile into
            exp(x - row_max) in place and adds the row sums of e and e (x - row_max) to s and s2, and
            `shifted_exp(x, shift, cap, s, s2, top)` does the same with exp(min(x - shift, cap)) and folds the
            rows' max(x - shift) into top.
        logp_estimate: (N, T) estimates of the log-probs, e.g. the sampler's own log-probs of the tokens when the
            weights have not changed since sampling. Then there is no buffer: one pass over vocabulary tiles of all
            positions shifts each position's logits by x_target - estimate (its log-sum-exp, were the estimate
            exact) and forms q = exp(x - shift) = p S, their sums S, and from the same tiles sum q W (the hidden
            states' gradient, exact once S is known) and the weight's gradient with d loss / d logp taken at the
            estimate. The log-probs, entropies, loss and hidden gradient are exact. So is the weight's gradient
            where every estimate is the log-prob up to rounding (within `tolerance`): its coefficients are then the
            loss's gradient at log-probs within 1e-5 nats of the computed ones, whose own float32 rounding is
            ~1e-6 (the sampler's measured 1e-6 to 2e-6 from the update's on the benchmark's models). Positions
            whose estimates are further off, and those whose loss gradient they moved, get a second pass over
            just them that corrects the weight's gradient (two head products for them); where an estimate is more
            than 2 nats too high or 8 off (a non-finite one counts as such), their log-sum-exp is first recomputed
            (one more). With good estimates the head is applied three times per position, twice for a frozen head.
            `row_loss` is called twice, at the estimates and at the exact log-probs. With a loss that couples
            positions through the log-probs themselves (a sequence-level ratio whose old log-probs are not the
            estimates), an estimate tens of nats off moves the first-pass terms of the positions coupled to it,
            and their correction then loses precision in proportion: pass estimates that are close.
        tolerance: with logp_estimate, how far (nats) an estimate may be from the log-prob and count as exact
            (0: every position whose estimate differs at all is corrected).
        weight_grad_storage: with weight_grad_in_place, a contiguous tensor of the weight's shape, dtype and device
            that becomes `weight.grad` when that is None (its contents are overwritten): memory the caller keeps
            between steps, so that a large head's gradient does not touch fresh pages each time (a page fault per
            4 KiB: ~40-90 ms for the 155 MB head of a 151k vocabulary).

    Returns:
        (loss, logp, entropy): the scalar loss (differentiable w.r.t. hidden, weight and bias), the (N, T)
        log-probs and entropies (or None), both detached.
    """
    if hidden.dim() != 3 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError("hidden_loss: need hidden (N, T, H) and weight (V, H), "
                         f"got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    _check_args("hidden_loss", hidden.shape[:2], tokens, temperature, None)
    _check_token_range("hidden_loss", tokens, weight.shape[0])
    if rows_per_chunk < 1:
        raise ValueError(f"hidden_loss: rows_per_chunk must be a positive number of rows, got {rows_per_chunk}")
    if vocab_block is not None and vocab_block < 1:
        raise ValueError(f"hidden_loss: vocab_block must be a positive number of rows or None, got {vocab_block}")
    if weight_grad_storage is not None and (
            not weight_grad_in_place or weight_grad_storage.shape != weight.shape
            or weight_grad_storage.dtype != weight.dtype or weight_grad_storage.device != weight.device
            or not weight_grad_storage.is_contiguous()):
        raise ValueError(f"hidden_loss: weight_grad_storage must be a contiguous tensor of the weight's shape "
                         f"{tuple(weight.shape)}, dtype {weight.dtype} and device {weight.device}, given with "
                         f"weight_grad_in_place=True; got {tuple(weight_grad_storage.shape)} "
                         f"{weight_grad_storage.dtype} on {weight_grad_storage.device} "
                         f"(weight_grad_in_place={weight_grad_in_place})")
    if not torch.is_grad_enabled():  # no gradient recorded: compute none (and leave weight.grad alone)
        hidden, weight = hidden.detach(), weight.detach()
        bias = None if bias is None else bias.detach()
    if logp_estimate is not None:
        if logp_estimate.shape != tokens.shape:
            raise ValueError(f"hidden_loss: logp_estimate must have the tokens' shape {tuple(tokens.shape)}, got "
                             f"{tuple(logp_estimate.shape)}")
        if not tolerance >= 0:
            raise ValueError(f"hidden_loss: tolerance must be >= 0, got {tolerance}")
        block = vocab_block or _auto_block(max(1, tokens.numel()), hidden.device)
        loss, logp, entropy = _HiddenLossSeeded.apply(hidden, weight, bias, tokens.long(), row_loss,
                                                      logp_estimate.detach(), temperature, min(block, weight.shape[0]),
                                                      with_entropy, weight_grad_in_place, tolerance, kernels,
                                                      weight_grad_storage)
        return loss, logp.detach(), None if entropy is None else entropy.detach()
    positions = max(1, rows_per_chunk * tokens.shape[1])
    block = vocab_block or _auto_block(positions, hidden.device)
    loss, logp, entropy = _HiddenLoss.apply(hidden, weight, bias, tokens.long(), row_loss, temperature,
                                            rows_per_chunk, min(block, weight.shape[0]), with_entropy,
                                            weight_grad_in_place, kernels, weight_grad_storage)
    return loss, logp.detach(), None if entropy is None else entropy.detach()

