"""The KV cache pieces shared by sampling and the reference pass, for any `transformers` causal LM on any device.

* `preallocated_cache`: a `transformers` cache whose layers write each step into buffers sized for the whole
  rollout and expose a view of the filled prefix (transformers' `DynamicLayer` copies the whole cache at every
  token with `torch.cat`).
* `distinct_rows` / `expand_cache`: a group's G rows share one prompt, which is encoded once and its cache copied.
"""

from __future__ import annotations

import functools
import inspect

import torch


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded rows: 0 at each row's first real token."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def preallocated_cache(model, capacity: int):
    """A cache for `model` whose layers hold `capacity` positions (prompt + completion), or None when the model's
    cache is not made of plain full-attention layers (sliding windows, linear attention, ...), which keep
    transformers' own cache."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                shape = (*key_states.shape[:2], capacity, key_states.shape[3])
                dtype = compute_dtype(key_states)
                self.key_buffer = key_states.new_empty(shape, dtype=dtype)
                self.value_buffer = value_states.new_empty((*shape[:3], value_states.shape[3]), dtype=dtype)
                self.length = 0
            end = self.length + key_states.shape[-2]
            if end > capacity:
                raise RuntimeError(f"preallocated_cache: {end} positions exceed the capacity {capacity}")
            self.key_buffer[:, :, self.length:end] = key_states
            self.value_buffer[:, :, self.length:end] = value_states
            self.length = end
            self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
            return self.keys, self.values

    try:
        cache = DynamicCache(config=model.config)
    except Exception:  # a config transformers cannot read layer types from: keep its default cache
        return None
    if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    cache.layers = [PreallocatedLayer() for _ in cache.layers]
    return cache


def compute_dtype(states: torch.Tensor) -> torch.dtype:
    """The dtype a cache keeps `states` in: autocast's when it is on for their device (fp32 weights under bf16
    autocast give fp32 keys, RoPE's fp32 cos/sin promoting them, and bf16 values: a bf16 cache holds both at half the
    memory, and attention, which autocast runs in bf16, no longer casts the whole key cache at every token,
    gpu_review2 N9), else their own."""
    kind = states.device.type
    if states.is_floating_point() and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return states.dtype


def distinct_rows(rows: list[list[int]]) -> tuple[list[int], list[int]]:
    """(first, copies): the index of each distinct row's first occurrence, and for every row the position in
    `first` of the row equal to it."""
    seen: dict[tuple[int, ...], int] = {}
    first, copies = [], []
    for i, row in enumerate(rows):
        key = tuple(row)
        if key not in seen:
            seen[key] = len(first)
            first.append(i)
        copies.append(seen[key])
    return first, copies


def expand_cache(cache, copies: torch.Tensor) -> None:
    """Make a prefilled `preallocated_cache` of R rows one of len(copies) rows, row i a copy of row copies[i]: the
    prompts of a group are encoded once and copied to its G completions (sampling's prefill, the reference pass)."""
    for layer in cache.layers:
        layer.key_buffer = layer.key_buffer.index_select(0, copies)
        layer.value_buffer = layer.value_buffer.index_select(0, copies)
        layer.keys = layer.key_buffer[:, :, :layer.length]
        layer.values = layer.value_buffer[:, :, :layer.length]


def keep_cache_rows(cache, keep: torch.Tensor) -> None:
    """Make a `preallocated_cache` of R rows one of len(keep) rows, row i being old row keep[i], in place: the rows
    move to the front of the same buffers (which stay where they are, for code that points into them), so a rollout
    stops computing rows that have ended. `keep` is increasing, so no row is overwritten before it is read."""
    k = keep.shape[0]
    for layer in cache.layers:
        for name in ("key_buffer", "value_buffer"):
            buffer = getattr(layer, name)
            buffer[:k] = buffer.index_select(0, keep)
            setattr(layer, name, buffer[:k])
        layer.keys = layer.key_buffer[:, :, :layer.length]
        layer.values = layer.value_buffer[:, :, :layer.length]


def cache_args(module, cache) -> dict:
    """The keyword that hands `cache` to `module`'s forward: `cache` from transformers 5.24 (the old name,
    past_key_values, prints a FutureWarning in every grpo command and goes in 5.40), past_key_values before it and
    for wrappers whose forward takes **kwargs."""
    return {_cache_keyword(type(module)): cache}


@functools.lru_cache(maxsize=None)
def _cache_keyword(cls) -> str:
    try:
        return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"
    except (TypeError, ValueError, AttributeError):
        return "past_key_values"


def returned_cache(out):
    """The cache a forward returned (transformers 5.24 names it `cache`, reading past_key_values warns)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values
