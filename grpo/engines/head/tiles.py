"""The LM head applied in (positions x vocabulary rows) tiles: the pieces `hidden_logprobs` (grpo/engines/head/logprobs.py)
and `hidden_loss` (grpo/engines/head/loss.py) share. A tile's logits, the target logit picked from it, the running
(online) log-sum-exp and entropy over tiles, and the gradients of hidden, weight and bias accumulated tile by tile;
for `hidden_loss`, a row loss's gradient by autograd (`_loss_and_grad`) and where positions sit in its rows (`_Rows`).

Notation as in grpo/engines/head/logprobs.py: N sequences, T positions, V vocabulary, H hidden size; m positions per tile.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_TILE_ELEMENTS = 2**19
"""float32 logits per (positions x vocabulary rows) tile when `vocab_block=None`: 2 MiB, a CPU core's L2 cache."""

_GPU_TILE_ELEMENTS = 2**24
"""The same on a GPU (64 MiB), where each tile costs kernel launches and there is no small cache to fit."""


def _auto_block(positions: int, device: torch.device) -> int:
    """Vocabulary rows per tile for `positions` positions when the caller gives none."""
    budget = _TILE_ELEMENTS if device.type == "cpu" else _GPU_TILE_ELEMENTS
    return max(256, budget // max(1, positions))


def _upcast(dtype: torch.dtype) -> torch.dtype:
    """The dtype chunks are computed in: float32, or float64 when the input is float64."""
    return torch.promote_types(dtype, torch.float32)


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
    """row_loss(logp (r, T), rows) and its gradient d loss / d logp (r, T) in logp's dtype; both detached."""
    leaf = logp.detach().requires_grad_()
    with torch.enable_grad():
        loss = row_loss(leaf, rows)
    (g,) = torch.autograd.grad(loss, leaf, allow_unused=True)
    g = torch.zeros_like(leaf) if g is None else g
    return loss.detach(), g.to(logp.dtype)


class _Rows:
    """The (N, T) rows that `row_loss` takes, and where the flat positions of the hidden states sit in them: every
    cell, row-major (hidden (N, T, H)), or the True cells of `layout` (N, T), row-major (ragged rows with their
    padding removed: hidden (n_tok, H)); cells outside the layout hold 0."""

    def __init__(self, hidden: Tensor, layout: Tensor | None):
        self.layout = layout
        self.rows, self.cols = hidden.shape[:2] if layout is None else layout.shape
        counts = [self.cols] * self.rows if layout is None else layout.sum(1).tolist()
        self.offsets = [0]
        for c in counts:
            self.offsets.append(self.offsets[-1] + c)

    def flat(self, part: slice) -> slice:
        """The flat positions of rows `part`."""
        return slice(self.offsets[part.start], self.offsets[part.stop])

    def to_rows(self, values: Tensor, part: slice) -> Tensor:
        """(m,) values of rows `part`'s positions -> (r, T) rows."""
        if self.layout is None:
            return values.reshape(-1, self.cols)
        cells = self.layout[part]
        return values.new_zeros(cells.shape).masked_scatter_(cells, values)

    def to_flat(self, rows: Tensor, part: slice) -> Tensor:
        """(r, T) rows `part` -> (m,) values at their positions."""
        return rows.reshape(-1) if self.layout is None else rows[self.layout[part]]


def _saved_grads(ctx, grad_loss: Tensor) -> list:
    """The gradients a one-pass loss saved during forward, scaled by the incoming grad_loss."""
    if ctx.weight_in_place_guard and float(grad_loss) != 1.0:
        raise RuntimeError("hidden_loss(weight_grad_in_place=True): the weight's gradient was added to .grad "
                           "during forward, so backward must start from this loss with gradient 1 "
                           "(loss.backward()); scale row_loss instead.")
    return [None if g is None else (g if float(grad_loss) == 1.0 else g * grad_loss) for g in ctx.grads]
