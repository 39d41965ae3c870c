"""A loss of the token log-probs and its gradient in one pass over the LM head: `hidden_loss`.

`hidden_logprobs` (grpo/engines/head/logprobs.py) followed by a loss applies the head four times per position: forward,
then in backward the recomputed logits and the two gradient products. When the loss is a sum over rows, the gradient
of each row's loss with respect to its log-probs is known as soon as the row's log-probs are, so the gradient tiles
can be formed in the same pass, and the head is applied three times (twice for a frozen head). Two ways:

* `_HiddenLoss`: each chunk of whole rows has its logits computed once into a buffer, its loss and d loss / d logp
  taken by autograd on the small (rows, T) log-prob tensor, and the gradient tiles formed in place from the buffer.
* `_HiddenLossSeeded`: given estimates of the log-probs (the sampler's own), no buffer: one pass over vocabulary
  tiles of all positions, each position's logits shifted by its estimated log-sum-exp, and a second pass over just
  the positions whose estimates were off (`_correct_seeded`).

Notation as in grpo/engines/head/logprobs.py: N sequences, T positions, V vocabulary, H hidden size.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from grpo.engines.head.tiles import _auto_block, _head_forward, _HeadGrads, _logits_into, _tile_targets, _upcast
from grpo.engines.head.logprobs import _check_args, _check_token_range, _over_temperature


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


class _HiddenLoss(torch.autograd.Function):
    """(hidden (N, T, H), weight (V, H), bias, tokens (N, T), row_loss) -> (loss, logp (N, T), entropy or None), with
    the gradient computed during forward: see `hidden_loss`. Backward only scales the saved gradients."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, row_loss, temperature, rows_per_chunk, block, with_entropy,
                grad_in_place, kernels, storage, layout):
        grid = _Rows(hidden, layout)
        rows, cols, size = grid.rows, grid.cols, hidden.shape[-1]
        vocab = weight.shape[0]
        dtype = _upcast(hidden.dtype)
        ctx.weight_in_place_guard = ctx.needs_input_grad[1] and grad_in_place
        h_all, y_all = hidden.reshape(-1, size), tokens.reshape(-1)
        grads = _HeadGrads(h_all, weight, bias, ctx.needs_input_grad[:3], grad_in_place, storage)
        tiles = -(-vocab // block)
        buffer = torch.empty((tiles, min(rows_per_chunk, rows) * cols, block), dtype=dtype, device=hidden.device)
        logp_all = torch.zeros((rows, cols), dtype=dtype, device=hidden.device)
        entropy_all = torch.zeros_like(logp_all) if with_entropy else None
        total = torch.zeros((), dtype=dtype, device=hidden.device)
        first = True  # no chunk has written the (fresh) weight gradient yet
        for r0 in range(0, rows, rows_per_chunk):
            part = slice(r0, min(r0 + rows_per_chunk, rows))
            flat = grid.flat(part)  # these rows' positions in h_all
            h, y = h_all[flat], y_all[flat]
            m = h.shape[0]
            if m == 0:  # rows with no positions (empty completions): their loss, which has no gradient here
                total += _loss_and_grad(row_loss, logp_all[part], part)[0]
                continue
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
            logp = grid.to_rows(target - row_max - log_s, part)
            logp_all[part] = logp
            if with_entropy:
                entropy_all[part] = grid.to_rows(log_s - s2 / s, part)
            loss, g = _loss_and_grad(row_loss, logp, part)
            total += loss
            g = _over_temperature(grid.to_flat(g, part), temperature)  # d loss / d logp, per position
            scale = (-g / s)[:, None]  # d logp_y / dx_j = onehot - e_j / s
            for i in range(tiles):
                width = min(block, vocab - i * block)
                grad_x = x[i, :, :width].mul_(scale).to(weight.dtype)  # (m, width), without the target's +g
                grads.add_tile(flat, h, grad_x, slice(i * block, i * block + width), first_chunk=first)
            grads.add_targets(flat, h, y, g)
            first = False
        ctx.grads = grads.result(hidden.shape)
        return total, logp_all, entropy_all

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_logp, _grad_entropy):
        return (*_saved_grads(ctx, grad_loss), None, None, None, None, None, None, None, None, None, None)


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
                grad_in_place, tolerance, kernels, storage, layout):
        grid = _Rows(hidden, layout)
        size, every = hidden.shape[-1], slice(0, grid.rows)
        dtype = _upcast(hidden.dtype)
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        ctx.weight_in_place_guard = need_weight and grad_in_place
        h, y = hidden.reshape(-1, size), tokens.reshape(-1)
        m = h.shape[0]
        grads = _HeadGrads(h, weight, None, (False, need_weight, False), grad_in_place, storage)
        bias_grad = torch.zeros_like(bias) if need_bias else None
        # A non-finite estimate becomes 0, too high for any token but the likeliest: handled as a far-off one; so
        # does a positive one, which no log-prob is.
        est = torch.nan_to_num(grid.to_flat(estimate, every).to(dtype), nan=0.0, posinf=0.0,
                               neginf=0.0).clamp_(max=0.0)
        # Shift each position's logits x by L = x_target - estimate: L is the log-sum-exp when the estimate is the
        # log-prob, so q = exp(x - L) is the softmax; in general q = p S with S = sum q = exp(lse - L).
        target = _target_logits(h, weight, bias, y, temperature)
        shift = (target - est).contiguous()
        # The tiles of a bfloat16 or float16 head are rounded to it before scoring: there each target logit is
        # taken from its tile, as the other paths do, rather than from the float32 product above.
        tile_target = target.clone() if h.dtype not in (torch.float32, torch.float64) else None
        _, g_hat = _loss_and_grad(row_loss, grid.to_rows(est, every), every)
        g_hat = grid.to_flat(g_hat, every)
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
        loss, g = _loss_and_grad(row_loss, grid.to_rows(logp, every), every)
        g = grid.to_flat(g, every)
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
        return loss, grid.to_rows(logp, every), None if entropy is None else grid.to_rows(entropy, every)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_logp, _grad_entropy):
        return (*_saved_grads(ctx, grad_loss), None, None, None, None, None, None, None, None, None, None, None)


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
    layout: Tensor | None = None,
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
        layout: None, or (N, T) bool for ragged rows with their padding removed (a packed pass): hidden is then
            (n_tok, H) and tokens (n_tok,), the positions where layout is True, row-major. row_loss still takes
            (r, T) rows, with 0 where layout is False; logp_estimate is (N, T); the returned logp and entropy are
            (N, T), 0 where layout is False. rows_per_chunk bounds the buffer as for full rows.

    Returns:
        (loss, logp, entropy): the scalar loss (differentiable w.r.t. hidden, weight and bias), the (N, T)
        log-probs and entropies (or None), both detached.
    """
    ragged = layout is not None
    if hidden.dim() != (2 if ragged else 3) or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"hidden_loss: need hidden {'(n_tok, H)' if ragged else '(N, T, H)'} and weight (V, H), "
                         f"got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if ragged and (layout.dim() != 2 or layout.dtype != torch.bool):
        raise ValueError(f"hidden_loss: layout must be an (N, T) bool tensor, got {tuple(layout.shape)} {layout.dtype}")
    if ragged and layout.device.type == "cpu" and int(layout.sum()) != hidden.shape[0]:
        raise ValueError(f"hidden_loss: layout has {int(layout.sum())} True cells but hidden has {hidden.shape[0]} "
                         "positions; they must be equal (one position per real token)")
    _check_args("hidden_loss", hidden.shape[:-1], tokens, temperature, None)
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
    rows_shape = layout.shape if ragged else tokens.shape
    if logp_estimate is not None:
        if logp_estimate.shape != rows_shape:
            raise ValueError(f"hidden_loss: logp_estimate must have the {'layout' if ragged else 'tokens'}' shape "
                             f"{tuple(rows_shape)}, got {tuple(logp_estimate.shape)}")
        if not tolerance >= 0:
            raise ValueError(f"hidden_loss: tolerance must be >= 0, got {tolerance}")
        block = vocab_block or _auto_block(max(1, tokens.numel()), hidden.device)
        loss, logp, entropy = _HiddenLossSeeded.apply(hidden, weight, bias, tokens.long(), row_loss,
                                                      logp_estimate.detach(), temperature, min(block, weight.shape[0]),
                                                      with_entropy, weight_grad_in_place, tolerance, kernels,
                                                      weight_grad_storage, layout)
        return loss, logp.detach(), None if entropy is None else entropy.detach()
    positions = max(1, rows_per_chunk * rows_shape[1])
    block = vocab_block or _auto_block(positions, hidden.device)
    loss, logp, entropy = _HiddenLoss.apply(hidden, weight, bias, tokens.long(), row_loss, temperature,
                                            rows_per_chunk, min(block, weight.shape[0]), with_entropy,
                                            weight_grad_in_place, kernels, weight_grad_storage, layout)
    return loss, logp.detach(), None if entropy is None else entropy.detach()
