"""Per-token log-probs and entropies without holding a float32 copy of all the logits.

Notation: N sequences, T positions, V vocabulary, H hidden size. The naive way,
`logits.float().log_softmax(-1).gather(...)`, keeps an (N, T, V) float32 tensor alive (and autograd saves it for
backward); with V ~ 150k that is ~600 MB per 1,000 positions. Here every function walks over chunks of positions,
casting one chunk to float32 at a time, and a custom autograd Function recomputes each chunk in backward instead of
saving it. Peak extra memory is a few (chunk, V) float32 tensors.

* `token_logprobs` / `token_entropy` start from logits the model already produced (N, T, V).
* `hidden_logprobs` starts one step earlier, from the final hidden states and the LM-head weight, so the (N, T, V)
  logits never exist at all, not even in the model's dtype (the idea behind Unsloth's and Liger's fused heads).

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


class _HiddenLogprob(torch.autograd.Function):
    """(hidden (N, T, H), weight (V, H), bias (V,) or None, tokens (N, T)) -> (logp (N, T), entropy (N, T) or None).

    Applies the LM head one chunk of positions at a time; backward recomputes each chunk's logits, so neither the
    (N, T, V) logits nor their float32 softmax is ever kept. Gradients are produced only for inputs that need them
    (a frozen LM head under LoRA gets no weight gradient, which saves a (V, H) buffer).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, temperature, positions, with_entropy):
        ctx.set_materialize_grads(False)
        rows, cols = tokens.shape
        logp = torch.zeros((rows, cols), dtype=_upcast(hidden.dtype), device=hidden.device)
        entropy = torch.zeros_like(logp) if with_entropy else None
        for rs, cs in _chunks(rows, cols, positions):
            x = _scaled(F.linear(hidden[rs, cs], weight, bias), temperature)  # (r, c, V)
            chunk_logp, chunk_entropy = _chunk_forward(x, tokens[rs, cs], with_entropy)
            logp[rs, cs] = chunk_logp
            if entropy is not None:
                entropy[rs, cs] = chunk_entropy
        ctx.save_for_backward(hidden, weight, bias, tokens)
        ctx.temperature, ctx.positions = temperature, positions
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, tokens = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        grad_bias = torch.zeros_like(bias) if need_bias else None
        grad_logp = _over_temperature(grad_logp, ctx.temperature)
        grad_entropy = _over_temperature(grad_entropy, ctx.temperature)
        for rs, cs in _chunks(tokens.shape[0], tokens.shape[1], ctx.positions):
            h = hidden[rs, cs]  # (r, c, H)
            x = _scaled(F.linear(h, weight, bias), ctx.temperature)  # (r, c, V)
            grad_x = _chunk_backward(x, tokens[rs, cs], _part(grad_logp, rs, cs), _part(grad_entropy, rs, cs))
            grad_logits = grad_x.to(weight.dtype)  # (r, c, V)
            if need_hidden:
                grad_hidden[rs, cs] = grad_logits @ weight  # (r, c, H)
            if need_weight:
                grad_weight.addmm_(grad_logits.flatten(0, 1).T, h.flatten(0, 1))  # (V, H)
            if need_bias:
                grad_bias += grad_logits.flatten(0, 1).sum(0)  # (V,)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


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
) -> tuple[Tensor, Tensor | None]:
    """Token log-probs (and entropies) straight from final hidden states and the LM-head weight.

    Equivalent to `token_logprobs(hidden @ weight.T + bias, tokens, temperature)` (gradients w.r.t. hidden, weight
    and bias included), but the LM head runs on `chunk_size` positions at a time and backward recomputes each
    chunk's logits, so memory stays O(chunk_size * V) instead of O(N * T * V).

    Args:
        hidden: (N, T, H) final hidden states (after the last norm), position t predicting tokens[:, t].
        weight: (V, H) LM-head weight (tied embeddings included), same dtype as hidden.
        tokens: (N, T) int token ids in [0, V).
        temperature: the sampling temperature.
        chunk_size: positions per chunk.
        bias: (V,) LM-head bias, or None.
        with_entropy: also return the (N, T) entropy of softmax(logits / temperature).

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
    return _HiddenLogprob.apply(hidden, weight, bias, tokens.long(), temperature, chunk_size, with_entropy)
