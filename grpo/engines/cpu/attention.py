"""The CPU engine's attention for packed micro-batches with shared prompts: each group's prompt attends to itself and
each completion to its prompt and itself, with no dense mask over the whole row.

With transformers' own attention a packed row needs a dense (L, L) mask, and attention then costs L^2 whatever
the mask hides: rows must stay short (`grpo.engines.packing.pair_cost`), and the products pay for the padding at
their ends. Here a micro-batch packs into one row with no padding, and attention runs as two batched calls of
`scaled_dot_product_attention`: the units' prompts (U, P) with a causal mask, and the completions (C, T) against
their unit's prompt and themselves, (C, P + T) keys. For the default job that is ~10^5 query-key pairs against
~2.7 x 10^5 for the rows of a dense mask.

`use_prefix_attention(model)` switches a model's attention implementation to this one (`NAME`): sdpa for every call
that carries no prefix index (sampling, eval, padded passes, with sdpa's masks), the grouped path for packed passes
(`grpo.engines.packing.Packing.mask == "prefix"`, whose `PackedRows.attention_kwargs` carry the index). Undone by
`restore_attention`. Exactly the padded pass's attention up to float32 rounding (tests/test_packing.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from grpo.engines.packing import PrefixIndex

NAME = "grpo_prefix_sdpa"


def prefix_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                     grpo_prefix: PrefixIndex | None = None, **kwargs):
    """transformers' attention-function signature: query (1, H, N, d), key and value (1, KVH, N, d) of one packed
    row -> (1, N, H, d), None. Without `grpo_prefix`: sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if grpo_prefix is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"{NAME}: a packed micro-batch is one row, got {query.shape[0]}")
    idx = grpo_prefix
    q, k, v = query[0], key[0], value[0]  # (H, N, d), (KVH, N, d)
    gqa = q.shape[0] != k.shape[0]

    def rows(x, positions):  # (heads, N, d), (B, T) -> (B, heads, T, d)
        return x.index_select(1, positions.reshape(-1)).view(x.shape[0], *positions.shape, -1).transpose(0, 1)

    def attend(q_pos, k_pos, mask):  # -> (B * Tq, H, d), the rows' queries in order
        out = F.scaled_dot_product_attention(rows(q, q_pos), rows(k, k_pos), rows(v, k_pos), attn_mask=mask,
                                             dropout_p=dropout, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).reshape(-1, *out.shape[1:2], out.shape[-1])

    parts = [attend(idx.prompt_q, idx.prompt_q, idx.prompt_mask).index_select(0, idx.prompt_take)]
    if idx.comp_q.shape[0]:
        parts.append(attend(idx.comp_q, idx.comp_k, idx.comp_mask).index_select(0, idx.comp_take))
    return torch.cat(parts).index_select(0, idx.order)[None], None  # (1, N, H, d)


def use_prefix_attention(model) -> bool:
    """Switch `model`'s attention from sdpa to NAME (registered with transformers on first use); True if switched.
    Only sdpa models with full-attention layers switch (the packing that uses it shares prompts only there)."""
    from grpo.engines.packing import _layer_kinds

    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa" or _layer_kinds(config) != {"full"}:
        return False
    _register()
    config._attn_implementation = NAME
    return True


def restore_attention(model) -> None:
    """Undo `use_prefix_attention`."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == NAME:
        config._attn_implementation = "sdpa"


def switched(model) -> bool:
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == NAME


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, prefix_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # calls without a prefix index get sdpa's masks
