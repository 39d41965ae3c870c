"""A loss of the token log-probs and its gradient in one pass over the LM head: `hidden_loss`.

`hidden_logprobs` (grpo/engines/head/logprobs.py) followed by a loss applies the head four times per position: forward,
then in backward the recomputed logits and the two gradient products. When the loss is a sum over rows, the gradient
of each row's loss with respect to its log-probs is known as soon as the row's log-probs are, so the gradient tiles
can be formed in the same pass, and the head is applied three times (twice for a frozen head). Two ways:

* `_HiddenLoss`: each chunk of whole rows has its logits computed once into a buffer, its loss and d loss / d logp
  taken by autograd on the small (rows, T) log-prob tensor, and the gradient tiles formed in place from the buffer.
* `_HiddenLossSeeded`: given estimates of the log-probs (the sampler's own), no buffer: one pass over vocabulary
  tiles of all positions, each position's logits shifted by its estimated log-sum-exp, and a second pass over just
  the positions whose estimates were off (`_correct_seeded`); grpo/engines/head/seeded.py.

Notation as in grpo/engines/head/logprobs.py: N sequences, T positions, V vocabulary, H hidden size.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from grpo.engines.head.logprobs import _check_args, _check_token_range, _over_temperature
from grpo.engines.head.seeded import _HiddenLossSeeded
from grpo.engines.head.tiles import _auto_block, _HeadGrads, _logits_into, _loss_and_grad, _Rows, _saved_grads, _upcast


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
