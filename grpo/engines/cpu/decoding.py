"""The CPU engine's one-token steps of sampling, without the per-call overhead of a general `transformers` forward.

Sampling a completion of T tokens is T forward passes of one token per row. For small models on CPUs the cost of
such a pass is mostly not arithmetic: a general forward builds masks and dispatches through many layers of Python
for each layer. Checked token for token against the stock forward in tests/test_decoding.py:

* `LeanDecoder`: the decode step of Llama-style decoders (Llama, Qwen2, Mistral without sliding windows) written out
  directly over a `grpo.engines.kv_cache.preallocated_cache`: per layer RMSNorm, q/k/v projections, rotary
  embedding, attention over the cache, output projection, RMSNorm and MLP. Linear projections run from stacked
  (in, out) copies of their weights (a LoRA-wrapped one's with its adapters folded in: base + B A x scaling, as TRL
  does before handing weights to vLLM), with RMSNorm and the rotary embedding written out in the operation order of
  these models' transformers code (so bit-identical to it); projections that do not fold into one matrix (DoRA,
  adapter biases) run as the model's own modules. The prompt is still encoded by the model's own forward, so
  padding and long prompts keep transformers' handling.
* `LeanDecoder.compiled`: the same step as one C call per token (native.py, csrc/lean_step.c), where it applies.
* `packed_head`: the sampling LM head, packed once per rollout.

`LeanDecoder.supports(model)` decides; other models keep the stock forward.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

import torch
import torch.nn.functional as F

from grpo.engines.cpu import native
from grpo.engines.cpu.layers import layer_products, plain_layer, plain_linears, stacked_bias

LEAN_MODEL_TYPES = ("llama", "qwen2", "mistral")
"""Model types whose decoder layers are exactly: pre-norm attention with rotary q/k, pre-norm gated MLP."""

_FUSE_BYTES = 256 * 2**20
"""Decoder layers larger than this (bytes) are not copied into (in, out) matrices (see _Fused): the copies are made
once per rollout and would double the layers' memory."""


class LeanDecoder:
    """One-token forward steps of a Llama-style `transformers` model over a `preallocated_cache`.

    `hidden(tokens, positions, cache, key_mask)` returns the final normed hidden states (N, H) of the new tokens;
    the caller applies the LM head. key_mask (N, L) bool marks the cached positions each row may attend to (False
    for left padding), or None when every position is real.
    """

    def __init__(self, model):
        self.inner = model.get_decoder()
        # Per layer, the q/k/v projections as one matrix and the MLP's gate/up as another: 4 matrix multiplies
        # instead of 7 per layer, each call costing ~15 us of overhead on top of tiny arithmetic; all stored
        # (in, out) (see _Fused). The weights change at every optimizer step, so a LeanDecoder is made per rollout;
        # the copies are skipped for big models.
        self.layer_bytes = sum(p.numel() * p.element_size() for p in self.inner.layers.parameters())
        big = self.layer_bytes > _FUSE_BYTES
        self.foldable = [not big and plain_linears(layer) for layer in self.inner.layers]
        self._fused: list[_Fused | None] | None = None

    @property
    def fused(self) -> list[_Fused | None]:
        """Per layer, its projections as stacked (in, out) copies (_Fused), or None where they do not fold into
        one matrix each; made on first use (the compiled step packs the weights itself and never asks)."""
        if self._fused is None:
            self._fused = [_fused_weights(layer) if ok else None
                           for layer, ok in zip(self.inner.layers, self.foldable)]
        return self._fused

    @staticmethod
    def supports(model) -> bool:
        config = getattr(model, "config", None)
        if getattr(config, "model_type", None) not in LEAN_MODEL_TYPES or not hasattr(model, "get_decoder"):
            return False
        if getattr(config, "use_sliding_window", False) or (
                config.model_type == "mistral" and getattr(config, "sliding_window", None)):
            return False
        if getattr(config, "_attn_implementation", "sdpa") not in ("sdpa", "eager", "grpo_prefix_sdpa"):
            return False  # (grpo_prefix_sdpa: sdpa but for packed passes, grpo/engines/cpu/attention.py)
        inner = model.get_decoder()
        module = importlib.import_module(type(inner).__module__)
        if not hasattr(module, "apply_rotary_pos_emb") or not all(
                hasattr(inner, k) for k in ("embed_tokens", "rotary_emb", "layers", "norm")):
            return False
        return hasattr(inner.norm, "variance_epsilon") and all(plain_layer(layer) for layer in inner.layers)

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor, cache, key_mask: torch.Tensor | None):
        """tokens, positions: (N, 1) int64. Returns (N, H)."""
        inner = self.inner
        x = inner.embed_tokens(tokens)  # (N, 1, H)
        cos, sin = inner.rotary_emb(x, positions)
        mask = None if key_mask is None else key_mask[:, None, None, :]  # (N, 1, 1, L): broadcast over heads
        n = x.shape[0]
        for i, layer in enumerate(inner.layers):
            attn, mlp, fused = layer.self_attn, layer.mlp, self.fused[i]
            h = _rms_norm(layer.input_layernorm, x)
            d = attn.head_dim
            if fused is None:
                q, k = (_rotate(m(h).view(n, 1, -1, d), cos, sin).transpose(1, 2) for m in (attn.q_proj, attn.k_proj))
                v = attn.v_proj(h).view(n, 1, -1, d).transpose(1, 2)  # (N, heads, 1, d)
            else:  # q and k are side by side in one product: rotate them together
                qkv = _times(h, fused.qkv, fused.qkv_bias)
                split, q_heads = fused.qkv_sizes[0] + fused.qkv_sizes[1], fused.qkv_sizes[0] // d
                qk = _rotate(qkv[..., :split].view(n, 1, -1, d), cos, sin)  # (N, 1, q heads + kv heads, d)
                q, k = qk[:, :, :q_heads].transpose(1, 2), qk[:, :, q_heads:].transpose(1, 2)
                v = qkv[..., split:].view(n, 1, -1, d).transpose(1, 2)
            keys, values = cache.layers[i].update(k, v)  # (N, kv_heads, L, d)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scaling,
                                                 enable_gqa=keys.shape[1] != q.shape[1])
            out = out.transpose(1, 2).reshape(n, 1, -1)
            x = x + (attn.o_proj(out) if fused is None else _times(out, fused.o, fused.o_bias))
            h = _rms_norm(layer.post_attention_layernorm, x)
            if fused is None:
                x = x + mlp.down_proj(mlp.act_fn(mlp.gate_proj(h)) * mlp.up_proj(h))
            else:
                gate, up = _times(h, fused.gate_up, fused.gate_up_bias).chunk(2, dim=-1)
                x = x + _times(mlp.act_fn(gate) * up, fused.down, fused.down_bias)
        return _rms_norm(inner.norm, x)[:, -1]

    def compiled(self, cache, rows: int):
        """The same step as `hidden`, compiled (grpo/engines/cpu/csrc/lean_step.c), for this rollout's `rows` and the
        prefilled `preallocated_cache`; None where it does not apply (see native.CompiledStep.usable)."""
        lib = native.library() if native.CompiledStep.usable(self, cache, rows) else None
        return None if lib is None else native.CompiledStep(lib, self, cache, rows)


class _Fused(NamedTuple):
    """One layer's projections as (in, out) matrices: q/k/v stacked into one (split back by qkv_sizes), o, gate/up
    stacked, and down. At a handful of rows a (rows, in) x (in, out) product runs faster than F.linear's product
    with the (out, in) weight (W1's 16 per token: 1.8 ms against 2.7)."""
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    qkv_sizes: list[int]
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


def _times(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (N, 1, in) times an (in, out) matrix, plus bias: (N, 1, out)."""
    flat = x.reshape(x.shape[0], -1)
    out = torch.mm(flat, weight_t) if bias is None else torch.addmm(bias, flat, weight_t)
    return out.view(x.shape[0], 1, -1)


@torch.no_grad()
def _fused_weights(layer) -> _Fused:
    qkv, o, gate_up, down = layer_products(layer)

    def stacked(pairs):  # (in, out): the weights side by side
        weight = torch.cat([w for w, _ in pairs]) if len(pairs) > 1 else pairs[0][0]
        return weight.detach().t().contiguous()

    return _Fused(stacked(qkv), stacked_bias(qkv), [w.shape[0] for w, _ in qkv], stacked(o), stacked_bias(o),
                  stacked(gate_up), stacked_bias(gate_up), stacked(down), stacked_bias(down))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (N, 1, heads, d) with cos, sin (N, 1, d), in the operation order of transformers'
    Llama-family `apply_rotary_pos_emb` (x cos + rotate_half(x) sin), so the result is bit-identical. Every model
    type in LEAN_MODEL_TYPES rotates this way; a new one must be checked before it is added there."""
    cos, sin = cos[:, :, None], sin[:, :, None]
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


def _rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """The model's RMSNorm, x / sqrt(mean(x^2) + eps) * weight in float32, in the operation order of transformers'
    Llama-family norms (bit-identical to them; F.rms_norm rounds differently and measured slower here)."""
    xf = x.to(torch.float32)
    return norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)).to(x.dtype)


_SMALL_HEAD = 2**18
"""Output-layer values (1 MiB of float32) up to which sampling multiplies by the weight as it is (`packed_head`)."""


def packed_head(weight: torch.Tensor, bias: torch.Tensor | None, rows: int, space: torch.Tensor | None = None):
    """A function h (rows, H) -> logits (rows, V) equal to F.linear(h, weight, bias) up to rounding, with the
    weight repacked once for this batch size (CPU, float32). With one intra-op thread the compiled head
    (csrc/lean_step.c) streams the weight once per 16 rows: the benchmark's (16, 256) x (256, 151k) product
    takes 9-16 ms (the speed of streaming 155 MB from memory, which moves with the machine) instead of ~25 ms for
    oneDNN's packed product, which is used otherwise (~31 ms for F.linear);
    either repacking costs less than 64 sampled tokens save. The weight changes at every optimizer step, so pack once
    per rollout. The compiled head packs into `space` when given (see native.CompiledHead): ~30 ms for the 155 MB
    head into memory already touched (the trainer hands over its last head gradient's), against 70-90 ms into a fresh
    allocation, most of it page faults. The compiled head needs the library's AVX-512 kernel: its plain-C kernel
    ran 10-20x slower than oneDNN on a CPU without AVX-512 (Zen 3: 476 against 27 ms for W2's head, 1.4 against 0.08
    ms for the default job's 263-token head). A head of at most _SMALL_HEAD values, which stays in cache, takes
    F.linear: as fast, with nothing to pack (oneDNN's packing of the default job's head took ~8 ms per rollout).
    Falls back to F.linear."""
    cpu32 = weight.device.type == "cpu" and weight.dtype == torch.float32
    if weight.numel() <= _SMALL_HEAD:
        return lambda h: F.linear(h, weight, bias)
    lib = native.library() if cpu32 and torch.get_num_threads() == 1 else None
    if lib is not None and lib.lean_wide_vectors():
        return native.CompiledHead(lib, weight, bias, rows, space)
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if not cpu32 or reorder is None or not torch.backends.mkldnn.is_available():
        return lambda h: F.linear(h, weight, bias)
    packed = reorder(weight.detach(), rows)
    linear = torch.ops.mkldnn._linear_pointwise
    return lambda h: linear(h.contiguous(), packed, bias, "none", [], "")
