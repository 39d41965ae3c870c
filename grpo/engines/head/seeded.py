"""`hidden_loss` given estimates of the log-probs (the sampler's own): `_HiddenLossSeeded` (see grpo/engines/head/loss.py).

No buffer of logits: one pass over vocabulary tiles of all positions, each position's logits shifted by its estimated
log-sum-exp, and a second pass over just the positions whose estimates were off (`_correct_seeded`). Notation as in
grpo/engines/head/logprobs.py: N sequences, T positions, V vocabulary, H hidden size.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from grpo.engines.head.tiles import (_head_forward, _HeadGrads, _logits_into, _loss_and_grad, _Rows, _saved_grads,
                                     _tile_targets, _upcast)


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
