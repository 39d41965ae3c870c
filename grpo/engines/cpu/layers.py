"""Which decoder layers the CPU engine's lean and compiled steps reproduce, and the weights each product multiplies by
(a plain linear layer's, or a LoRA-wrapped one's with its adapters folded in). Shared by `decoding` and `native`."""

from __future__ import annotations

import torch


def stacked_bias(pairs: list):
    """The biases of a list of (weight, bias) pairs side by side (zeros for one without), or None if none has
    one."""
    if all(b is None for _, b in pairs):
        return None
    return torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in pairs]).detach()


def plain_layer(layer) -> bool:
    """A decoder layer the lean step reproduces: full attention without q/k norms, a gated MLP, RMSNorms."""
    attn, mlp = layer.self_attn, layer.mlp
    return (not hasattr(attn, "q_norm") and getattr(attn, "sliding_window", None) is None
            and all(hasattr(mlp, k) for k in ("gate_proj", "up_proj", "down_proj", "act_fn"))
            and all(hasattr(norm, "variance_epsilon") for norm in (layer.input_layernorm,
                                                                   layer.post_attention_layernorm)))


def effective_linear(m):
    """(weight (out, in), bias) that module m multiplies its input by: a plain linear layer's own, or a LoRA-wrapped
    linear layer's base weight plus its active adapters' B A x scaling (what its forward computes, up to rounding;
    dropout is off in eval mode, where sampling runs). None for anything else, e.g. DoRA or other LoRA variants,
    adapter biases, or other wrappers: those run as modules."""
    if type(m) is torch.nn.Linear:
        return m.weight, m.bias
    base = getattr(m, "base_layer", None)
    if type(base) is not torch.nn.Linear or not all(hasattr(m, k) for k in ("get_delta_weight", "lora_A", "merged")):
        return None
    if m.merged or m.disable_adapters:
        return base.weight, base.bias  # merged: the adapters are in the base weight; disabled: not applied
    if m.training:
        return None  # adapter dropout would apply
    weight = base.weight
    for name in m.active_adapters:
        if name not in m.lora_A:
            continue
        if (getattr(m, "lora_variant", {}).get(name) is not None or getattr(m, "use_dora", {}).get(name, False)
                or getattr(m, "lora_bias", {}).get(name, False)):
            return None
        weight = weight + m.get_delta_weight(name)
    return weight, base.bias


def plain_linears(layer) -> bool:
    """Whether every projection multiplies by one weight matrix (plain, or LoRA that folds into one)."""
    attn, mlp = layer.self_attn, layer.mlp
    return all(effective_linear(m) is not None for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                                                          mlp.gate_proj, mlp.up_proj, mlp.down_proj))


@torch.no_grad()
def layer_products(layer) -> tuple[list, list, list, list]:
    """A foldable layer's four products as lists of (weight (out, in), bias) pairs whose outputs sit side by side:
    q/k/v, o, gate/up, down."""
    attn, mlp = layer.self_attn, layer.mlp
    return ([effective_linear(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj)], [effective_linear(attn.o_proj)],
            [effective_linear(m) for m in (mlp.gate_proj, mlp.up_proj)], [effective_linear(mlp.down_proj)])
