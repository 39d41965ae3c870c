"""Fused elementwise operators for training Llama-family decoders on the CPU.

A decoder layer's matrix products are a few large operators; what lies between them is many small ones, each
reading and writing a whole activation: the gated MLP's silu(g) * u is 2 operators forward and 3 backward (and keeps
silu(g) for backward besides g and u), each RMSNorm ~6 forward and ~10 backward. `fuse_decoder_ops(model)` runs
both as one compiled pass forward and one backward (csrc/layer_ops.c, built with the decode step by native.py),
for float32 CPU activations; anything else (a GPU, bfloat16, no C compiler) takes the module's own forward, and
`unfuse_decoder_ops` gives every module its own forward back. The results equal transformers' up to float32
rounding (tests/test_fused.py).
"""

from __future__ import annotations

import types

import torch

from grpo.engines.cpu import native


class _SwiGLU(torch.autograd.Function):
    """(g, u) -> silu(g) * u, the gated MLP's activation; saves g and u."""

    @staticmethod
    def forward(ctx, g, u):
        lib = native.library()
        g, u = g.contiguous(), u.contiguous()
        h = torch.empty_like(g)
        lib.lean_swiglu(g.numel(), g.data_ptr(), u.data_ptr(), h.data_ptr())
        ctx.save_for_backward(g, u)
        return h

    @staticmethod
    def backward(ctx, dh):
        lib = native.library()
        g, u = ctx.saved_tensors
        dh = dh.contiguous()
        dg, du = torch.empty_like(g), torch.empty_like(u)
        lib.lean_swiglu_grad(g.numel(), dh.data_ptr(), g.data_ptr(), u.data_ptr(), dg.data_ptr(), du.data_ptr())
        return dg, du


class _RMSNorm(torch.autograd.Function):
    """(x (..., H), weight (H,), eps) -> weight * x / sqrt(mean(x^2) + eps) over the last dimension; saves x, the
    weight and each row's 1 / sqrt(mean(x^2) + eps)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        lib = native.library()
        size = x.shape[-1]
        rows = x.reshape(-1, size).contiguous()
        weight = weight.contiguous()
        y = torch.empty_like(rows)
        inv = torch.empty(rows.shape[0], dtype=torch.float32)
        lib.lean_rms_norm(rows.shape[0], size, rows.data_ptr(), weight.data_ptr(), eps, y.data_ptr(), inv.data_ptr())
        ctx.save_for_backward(rows, weight, inv)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        lib = native.library()
        rows, weight, inv = ctx.saved_tensors
        dy = dy.reshape(rows.shape).contiguous()
        dx, dw = torch.empty_like(rows), torch.zeros_like(weight)
        lib.lean_rms_norm_grad(rows.shape[0], rows.shape[1], dy.data_ptr(), rows.data_ptr(), weight.data_ptr(),
                               inv.data_ptr(), dx.data_ptr(), dw.data_ptr())
        return dx.view(ctx.shape), dw if ctx.needs_input_grad[1] else None, None


def _cpu32(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def _mlp_forward(self, x):
    g, u = self.gate_proj(x), self.up_proj(x)
    if not _cpu32(g, u):
        return self.down_proj(self.act_fn(g) * u)
    return self.down_proj(_SwiGLU.apply(g, u))


def _norm_forward(self, x):
    if not _cpu32(x, self.weight):
        return self._grpo_unfused_forward(x)
    return _RMSNorm.apply(x, self.weight, float(self.variance_epsilon))


def fuse_decoder_ops(model) -> int:
    """Switch the gated MLPs and RMSNorms of a Llama-family model (`decoding.LeanDecoder.supports`, SiLU) to the
    fused operators, in place (their weights and what they compute stay; the saved model is unchanged). Returns how
    many modules were switched: 0 without a C compiler or for another architecture."""
    from grpo.engines.cpu.decoding import LeanDecoder

    config = getattr(model, "config", None)
    if (native.library() is None or not LeanDecoder.supports(model)
            or getattr(config, "hidden_act", None) not in ("silu", "swish")):
        return 0
    inner = model.get_decoder()
    count = 0
    for norm in [inner.norm] + [n for layer in inner.layers for n in (layer.input_layernorm,
                                                                          layer.post_attention_layernorm)]:
        if "_grpo_unfused_forward" not in vars(norm):
            norm._grpo_unfused_forward = norm.forward
            norm.forward = types.MethodType(_norm_forward, norm)
            count += 1
    for layer in inner.layers:
        if "_grpo_unfused_forward" not in vars(layer.mlp):
            layer.mlp._grpo_unfused_forward = layer.mlp.forward
            layer.mlp.forward = types.MethodType(_mlp_forward, layer.mlp)
            count += 1
    return count


def unfuse_decoder_ops(model) -> int:
    """Undo `fuse_decoder_ops`: every switched module gets its own forward back. Returns how many were restored."""
    count = 0
    for module in model.modules():
        forward = vars(module).pop("_grpo_unfused_forward", None)
        if forward is not None:
            vars(module).pop("forward", None)  # the instance's switched forward; the class's applies again
            count += 1
    return count
