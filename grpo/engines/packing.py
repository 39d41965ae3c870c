"""Padding-free passes: a micro-batch's sequences packed end to end, so the model computes real tokens only.

A micro-batch arrives padded: (n, P+W) ids, prompts left-padded to P, completions right-padded to W. `pack` lays its
real tokens into a few rows of a packed layout instead (`PackedRows`), in one of two ways (`Packing`):

* **sequences**: each prompt and its completion, whole, one after the other; position ids restart at 0 for each.
  transformers recognises packed sequences from the position ids alone (`masking_utils.find_packed_sequence_indices`)
  and builds a block-diagonal causal mask (sdpa, eager, flex attention, sliding windows included), or gives flash
  attention the sequence boundaries (cu_seqlens); no mask is passed. For flash attention `pack` knows the
  boundaries already and hands them over (`PackedRows.attention_kwargs`: cu_seq_lens_q/k, max_length_q/k), so
  transformers does not derive them from the position ids with ~3 host syncs in every layer.
* **shared prompts**: the rows of a micro-batch that share a prompt (a group's G completions) share one copy of it:
  `[prompt | completion 1 | completion 2 | ...]`, each completion's positions continuing from the prompt's end, and a
  4D mask lets a completion's tokens see the prompt and their own earlier tokens only (`PackedRows.attention_mask`).
  The prompt is computed once per group instead of G times; it needs an attention that takes a custom mask.

Either way every completion token sees exactly the keys, at exactly the positions, that it sees in the padded pass,
so the log-probs are the padded pass's up to float32 rounding. The last token of each completion predicts nothing
and is left out, as in the padded pass. Units (a prompt and the completions that follow it) are laid into rows of at
most `Packing.row_tokens` tokens (first fit, longest first): with a dense mask, attention costs rows x length^2, so
bounded rows keep it near the padded pass's while the rest of the model (its products) costs real tokens only.

Shapes: n rows of the micro-batch, W its completion width, R x L the packed rows, n_tok the scored tokens (the real
completion tokens, row-major).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass

import torch

from grpo.engines.kv_cache import distinct_rows

# Attention implementations that take a custom 4D mask as transformers passes it, additive in the attention's dtype.
# Not boolean for sdpa: torch converts a boolean mask to a float copy inside every scaled_dot_product_attention call,
# and each layer keeps its own copy for backward (layers x R x L^2 x 2 bytes in bf16: ~43 GB for 24 layers at 64
# rows of 4k tokens), where an additive mask already in the query's dtype is one tensor all layers share (D13).
# Flex attention gets a BlockMask from transformers' own packed-sequence path instead.
_CUSTOM_MASK = {"sdpa": "additive", "eager": "additive"}


@dataclass(frozen=True)
class Packing:
    """How a run's passes are packed: prompts shared (a custom mask of kind `mask`) or whole sequences (transformers'
    packed-sequence path); `pair_cost`: what one query-key pair of a dense mask costs next to one token through the
    rest of the model, which sets the rows' length (`pack`); None: one row, for flash attention, whose cost is
    linear in its length."""

    shared_prompts: bool
    mask: str | None  # "bool" or "additive" with shared prompts ("prefix": the CPU engine's grouped attention, one
    # row); None: transformers' packed-sequence path; "varlen": that path with the boundaries passed (flash, one row)
    pair_cost: float | None
    reason: str = ""

    def describe(self) -> str:
        kind = "each prompt once per group" if self.shared_prompts else "whole sequences"
        rows = "rows sized by cost" if self.pair_cost else "one row"
        return f"padding-free ({kind}, {rows}; {self.reason})"


ATTENTION_SLOWDOWN = 2.5
"""How much slower per operation a dense-mask attention runs than the model's matrix products. Measured on the
default job's update (CPU, sdpa with a boolean mask): ~2-3x; it sets where longer rows stop paying (`pair_cost`)."""


def pair_cost(config) -> float:
    """One attention query-key pair's cost relative to one token through a layer's products, for a Llama-style
    decoder: QK^T and AV are 4 x heads x head_dim operations per pair (times ATTENTION_SLOWDOWN), the products
    2 x (the q, k, v, o and gated-MLP weights) per token. The default job's model: ~1/410 (rows of a few hundred
    tokens); a 0.5B Qwen2: ~1/3,300."""
    hidden = config.hidden_size
    heads = getattr(config, "num_attention_heads", None) or max(1, hidden // 64)
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    mlp = getattr(config, "intermediate_size", None) or 4 * hidden
    weights = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * mlp
    return 4 * heads * head_dim * ATTENTION_SLOWDOWN / (2 * weights)


def choose_packing(model, enabled: bool = True) -> tuple[Packing | None, str]:
    """The packing the model's attention allows, or None and why not.

    Packed sequences need a model whose forward takes position ids and whose attention transformers masks itself
    (it then recognises packing from the position ids); prompts are shared only with an attention that takes a custom
    mask (sdpa, eager) and layers that are all full attention (a sliding window would be lost in a custom mask).
    Anything else (linear-attention or state-space layers, a custom attention function) keeps the padded pass.
    """
    if not enabled:
        return None, "use_remove_padding: false"
    base = _base_model(model)
    config = getattr(base, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if config is None or "position_ids" not in inspect.signature(base.forward).parameters:
        return None, "the model's forward takes no position ids"
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    if impl not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        return None, f"attention {impl!r} is not one transformers masks packed sequences for"
    layers = _layer_kinds(config)
    if layers is None:
        return None, "its layers are not all attention layers (linear attention or state-space layers)"
    if impl.startswith("flash_attention"):  # varlen kernels: one row, cost linear in its length
        return Packing(False, "varlen", None, f"{impl}: sequence boundaries passed as cu_seq_lens"), ""
    if impl in _CUSTOM_MASK and layers == {"full"}:
        return Packing(True, _CUSTOM_MASK[impl], pair_cost(config), impl), ""
    return Packing(False, None, pair_cost(config), f"{impl}: transformers' packed-sequence mask"), ""


def _base_model(model):
    from accelerate.utils import extract_model_from_parallel

    model = extract_model_from_parallel(model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _layer_kinds(config) -> set[str] | None:
    """{"full"} or {"full", "sliding"}: the kinds of the model's attention layers; None when some layer is not plain
    attention (as transformers' cache reads them from the config)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    try:
        layers = DynamicCache(config=config).layers
    except Exception:  # a config transformers cannot read layer types from
        return None
    kinds = {DynamicLayer: "full", DynamicSlidingWindowLayer: "sliding"}
    if not layers or any(type(layer) not in kinds for layer in layers):
        return None
    return {kinds[type(layer)] for layer in layers}


@dataclass
class PrefixIndex:
    """Where the tokens of a one-row packed layout (N positions) go for the CPU engine's grouped attention
    (grpo/engines/cpu/attention.py): each unit's prompt, and each completion with its prompt's keys before its own.
    Padding cells repeat a real position; as keys they are masked, and their query rows (which see at least
    themselves, so none is all masked) are dropped."""

    prompt_q: torch.Tensor  # (U, P): each unit's prompt positions
    prompt_mask: torch.Tensor  # (U, 1, P, P): causal among the real prompt positions
    prompt_take: torch.Tensor  # (real prompt tokens,): the real cells of (U x P), flattened
    comp_q: torch.Tensor  # (C, T): each completion's positions (those that enter the model)
    comp_k: torch.Tensor  # (C, P + T): its unit's prompt positions, then its own
    comp_mask: torch.Tensor  # (C, 1, T, P + T)
    comp_take: torch.Tensor  # (real completion tokens,): the real cells of (C x T), flattened
    order: torch.Tensor  # (N,): for each position of the row, its place among [real prompt cells, real completion
    # cells] of (U x P) and (C x T) flattened (every position is exactly one of them)

    def to(self, device, non_blocking: bool = False) -> "PrefixIndex":
        return PrefixIndex(*(getattr(self, f.name).to(device, non_blocking=non_blocking)
                             for f in dataclasses.fields(self)))


def prefix_index(spans: list[tuple[int, int, list[tuple[int, int]]]]) -> PrefixIndex:
    """The index of a one-row packed layout from its units: (prompt start, prompt length, [(completion start,
    completion length), ...]) in positions of the row; completions of length 0 are left out."""
    units = [(p0, p) for p0, p, _ in spans]
    comps = [(p0, p, c0, c) for p0, p, cs in spans for c0, c in cs if c > 0]
    P = max(p for _, p in units)
    T = max((c for *_, c in comps), default=1)
    ar_p, ar_t = torch.arange(P), torch.arange(T)
    p_start, p_len = (torch.tensor(x) for x in zip(*units))
    prompt_real = ar_p[None, :] < p_len[:, None]  # (U, P)
    prompt_q = p_start[:, None] + torch.minimum(ar_p[None, :], p_len[:, None] - 1)
    causal_p = ar_p[:, None] >= ar_p[None, :]  # (P, P)
    prompt_mask = causal_p[None] & prompt_real[:, None, :]
    prompt_mask = prompt_mask | torch.eye(P, dtype=torch.bool)[None]  # padding queries see themselves
    if not comps:
        empty = torch.zeros((0, T), dtype=torch.long)
        return PrefixIndex(prompt_q, prompt_mask[:, None], _take(prompt_real), empty,
                           torch.zeros((0, P + T), dtype=torch.long), torch.zeros((0, 1, T, P + T), dtype=torch.bool),
                           _take(empty.bool()), _order(prompt_q, prompt_real, empty, empty.bool()))
    cp0, cp, c0, cl = (torch.tensor(x) for x in zip(*comps))
    comp_real = ar_t[None, :] < cl[:, None]  # (C, T)
    comp_q = c0[:, None] + torch.minimum(ar_t[None, :], cl[:, None] - 1)
    keys_prompt = cp0[:, None] + torch.minimum(ar_p[None, :], cp[:, None] - 1)  # (C, P)
    comp_k = torch.cat([keys_prompt, comp_q], 1)
    sees_prompt = (ar_p[None, :] < cp[:, None])[:, None, :].expand(-1, T, -1)  # (C, T, P)
    sees_self = (ar_t[:, None] >= ar_t[None, :])[None] & comp_real[:, None, :]  # (C, T, T)
    comp_mask = torch.cat([sees_prompt, sees_self], 2)
    return PrefixIndex(prompt_q, prompt_mask[:, None], _take(prompt_real), comp_q, comp_k, comp_mask[:, None],
                       _take(comp_real), _order(prompt_q, prompt_real, comp_q, comp_real))


def _take(real: torch.Tensor) -> torch.Tensor:
    return real.reshape(-1).nonzero()[:, 0]


def _order(prompt_q, prompt_real, comp_q, comp_real) -> torch.Tensor:
    """PrefixIndex.order: the inverse of the row's positions listed as [real prompt cells, real completion cells]."""
    listed = torch.cat([prompt_q[prompt_real], comp_q[comp_real]])
    order = torch.empty_like(listed)
    order[listed] = torch.arange(listed.shape[0])
    return order


@dataclass
class PackedRows:
    """One micro-batch in the packed layout (see the module docstring); built on the CPU by `pack`."""

    input_ids: torch.Tensor  # (R, L)
    position_ids: torch.Tensor  # (R, L): restarting at 0 for each prompt (and for each padding run at a row's end)
    segments: torch.Tensor  # (R, L): the unit each token belongs to; a distinct negative id for each padding token
    branches: torch.Tensor  # (R, L): 0 on a prompt, k on the k-th completion of its unit
    score_index: torch.Tensor  # (n_tok,): flat index into R x L of the position that predicts each scored token
    targets: torch.Tensor  # (n_tok,): the scored tokens
    layout: torch.Tensor  # (n, W) bool: where the scored tokens sit in the padded micro-batch, row-major
    keep_columns: torch.Tensor  # (k,): the columns holding a scoring position (logits_to_keep of the logits path)
    kept_index: torch.Tensor  # (n_tok,): flat index into R x k of each scored token's logits on the logits path
    packing: Packing
    prefix: PrefixIndex | None = None  # with Packing.mask "prefix": where each token goes for grouped attention
    cu_seq_lens: torch.Tensor | None = None  # with Packing.mask "varlen": (sequences + 1,) int32 boundaries, flat
    max_length: int = 0  # with Packing.mask "varlen": the longest sequence (a Python int: no host sync to read)
    host: "PackedRows | None" = None  # after `to`: the CPU original, for index arithmetic without host syncs
    source: torch.Tensor | None = None  # (R*L,): each position's flat index into the padded (n, P+W), -1 on padding

    def to(self, device) -> "PackedRows":
        return dataclasses.replace(self, host=self if self.host is None else self.host, **{
            f.name: getattr(self, f.name).to(device, non_blocking=True) for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), (torch.Tensor, PrefixIndex))})

    def attention_kwargs(self) -> dict:
        """Keyword arguments the model's forward passes on to its attention function: the grouped attention's index
        (grpo/engines/cpu/attention.py) with Packing.mask "prefix"; the sequence boundaries flash attention's varlen
        kernel takes (transformers' names, 5.17 to 5.24) with "varlen"; else none."""
        if self.prefix is not None:
            return {"grpo_prefix": self.prefix}
        if self.cu_seq_lens is not None:
            return {"cu_seq_lens_q": self.cu_seq_lens, "cu_seq_lens_k": self.cu_seq_lens,
                    "max_length_q": self.max_length, "max_length_k": self.max_length}
        return {}

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """(n_tok,) values of the scored tokens -> (n, W), 0 past each row's end; differentiable."""
        return values.new_zeros(self.layout.shape).masked_scatter(self.layout, values)

    @property
    def tokens(self) -> int:
        """Positions the model computes, padding at the rows' ends included."""
        return self.input_ids.numel()

    def attention_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The (R, 1, L, L) mask of shared prompts on the rows' device: position i sees position j <= i of its own
        unit when j is on the prompt or on i's own completion (0 added where it sees, dtype's min elsewhere; `dtype`
        the attention's, so no layer converts it; boolean with Packing.mask "bool"); None for whole sequences, which
        transformers masks from the position ids. Built with two boolean (R, L, L) temporaries besides the mask."""
        if self.packing.mask == "prefix":  # a 4D placeholder transformers passes on as it is; the grouped
            return torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.segments.device)  # attention ignores it
        if not self.packing.shared_prompts:
            return None
        idx = torch.arange(self.segments.shape[1], device=self.segments.device)
        allowed = self.segments[:, :, None] == self.segments[:, None, :]  # (R, L, L): the same unit
        allowed &= idx[:, None] >= idx[None, :]  # causal
        seen = self.branches[:, :, None] == self.branches[:, None, :]  # its own completion ...
        seen |= self.branches[:, None, :] == 0  # ... or the prompt
        allowed &= seen
        del seen
        if self.packing.mask == "bool":
            return allowed[:, None]
        out = torch.full((allowed.shape[0], 1, *allowed.shape[1:]), torch.finfo(dtype).min, dtype=dtype,
                         device=allowed.device)
        return out.masked_fill_(allowed[:, None], 0)


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, width: int, packing: Packing) -> PackedRows | None:
    """The packed layout of a padded micro-batch: input_ids and attention_mask (n, P+W), prompts left-padded,
    completions right-padded to W = `width`. None when there is nothing to pack the padded pass cannot take as well
    (no completion token at all, or a row with an empty prompt, whose first token nothing predicts)."""
    n, prompt_width = input_ids.shape[0], input_ids.shape[1] - width
    plen = attention_mask[:, :prompt_width].sum(1).tolist()
    clen = attention_mask[:, prompt_width:].sum(1).tolist()
    if sum(clen) == 0 or min(plen) == 0:
        return None
    prompts = torch.cat([input_ids[:, :prompt_width], attention_mask[:, :prompt_width]], 1).tolist()
    first, copies = distinct_rows(prompts) if packing.shared_prompts else (list(range(n)), list(range(n)))
    owners = [first[c] for c in copies]  # the row whose prompt each row's unit holds
    if packing.pair_cost is None:  # one row
        units, sizes = _units(plen, clen, owners, None)
        return _layout(input_ids, plen, clen, prompt_width, width, units, sizes, [list(range(len(units)))], packing)
    best = None
    for cap in _row_lengths(max(p + c - 1 for p, c in zip(plen, clen) if c), sum(plen) + sum(clen)):
        units, sizes = _units(plen, clen, owners, cap)
        rows = _first_fit(sizes, cap)
        length = max(sum(sizes[u] for u in row) for row in rows)
        cost = len(rows) * length * (1 + packing.pair_cost * length)  # tokens, and the dense mask's pairs
        if best is None or cost < best[0]:
            best = (cost, units, sizes, rows)
    _, units, sizes, rows = best
    return _layout(input_ids, plen, clen, prompt_width, width, units, sizes, rows, packing)


def _row_lengths(longest: int, total: int) -> list[int]:
    """Row lengths to try: from the longest sequence up, by factors of 1.25, to the whole micro-batch in one row."""
    out = [longest]
    while out[-1] < total:
        out.append(max(out[-1] + 1, int(out[-1] * 1.25)))
    return out


def _units(plen: list[int], clen: list[int], owners: list[int], cap: int | None):
    """Units: a prompt (that of row `owners[r]`) and the completions that follow it, in row order, each unit at most
    `cap` tokens (but one completion at least). Returns ([(owner, [rows])], sizes)."""
    units: list[tuple[int, list[int]]] = []
    sizes: list[int] = []
    open_unit: dict[int, int] = {}  # owner -> its open unit
    for r, owner in enumerate(owners):
        if clen[r] == 0:  # nothing to score
            continue
        body = clen[r] - 1  # the completion's tokens that enter the model (its last one predicts nothing)
        u = open_unit.get(owner)
        if u is None or (cap is not None and sizes[u] + body > cap):
            open_unit[owner] = u = len(units)
            units.append((owner, []))
            sizes.append(plen[owner])
        units[u][1].append(r)
        sizes[u] += body
    return units, sizes


def _first_fit(sizes: list[int], cap: int) -> list[list[int]]:
    """Units into rows of at most max(cap, the largest unit) tokens, longest first, each into the first row with
    room. Returns the units of each row."""
    cap = max(cap, max(sizes))
    rows: list[list[int]] = []
    room: list[int] = []
    for u in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        row = next((i for i, left in enumerate(room) if left >= sizes[u]), None)
        if row is None:
            rows.append([])
            room.append(cap)
            row = len(rows) - 1
        rows[row].append(u)
        room[row] -= sizes[u]
    return rows


def _layout(input_ids, plen, clen, prompt_width, width, units, sizes, rows, packing) -> PackedRows:
    """Gather the units' tokens into (R, L) rows. Pieces (a prompt, or a completion without its last token) are
    contiguous runs of source columns; each is expanded to its tokens with one gather."""
    n_rows, length = len(rows), max(sum(sizes[u] for u in row) for row in rows)
    # Each piece: (destination flat start, source flat start, length, first position id, segment, branch)
    pieces: list[tuple[int, int, int, int, int, int]] = []
    predictor = [0] * len(clen)  # flat index of the position predicting each row's first completion token
    body_start = [0] * len(clen)  # flat index of its second token's predictor (its first token, packed)
    spans = []  # per unit: (prompt start, prompt length, [(completion start, its length in the model)])
    src_width = input_ids.shape[1]
    for row_index, row in enumerate(rows):
        at = row_index * length
        for u in row:
            owner, members = units[u]
            p = plen[owner]
            pieces.append((at, owner * src_width + prompt_width - p, p, 0, u, 0))
            spans.append((at, p, []))
            at += p
            prompt_last = at - 1
            for k, r in enumerate(members, start=1):
                predictor[r], body_start[r] = prompt_last, at
                pieces.append((at, r * src_width + prompt_width, clen[r] - 1, p, u, k))
                spans[-1][2].append((at, clen[r] - 1))
                at += clen[r] - 1
    starts, sources, lens, pos0, segs, branches = (torch.tensor(col, dtype=torch.long) for col in zip(*pieces))
    total = int(lens.sum())
    within = torch.arange(total) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
    dest = torch.repeat_interleave(starts, lens) + within
    flat_ids = input_ids.reshape(-1)
    ids = torch.full((n_rows * length,), int(flat_ids[sources[0]]), dtype=input_ids.dtype)
    ids[dest] = flat_ids[torch.repeat_interleave(sources, lens) + within]
    segments = -1 - torch.arange(n_rows * length)  # padding: a unit of its own per token
    segments[dest] = torch.repeat_interleave(segs, lens)
    branch = torch.zeros(n_rows * length, dtype=torch.long)
    branch[dest] = torch.repeat_interleave(branches, lens)
    positions = torch.zeros(n_rows * length, dtype=torch.long)
    is_pad = torch.ones(n_rows * length, dtype=torch.bool)
    is_pad[dest] = False
    positions[dest] = torch.repeat_interleave(pos0, lens) + within
    source = torch.full((n_rows * length,), -1, dtype=torch.long)
    source[dest] = torch.repeat_interleave(sources, lens) + within
    positions = torch.where(is_pad, _pad_positions(is_pad.view(n_rows, length)).reshape(-1), positions)
    # Scoring: a row's first completion token is predicted by its prompt's last position, token j > 0 by token j-1.
    scored = torch.tensor(clen, dtype=torch.long)
    j = torch.arange(int(scored.sum())) - torch.repeat_interleave(torch.cumsum(scored, 0) - scored, scored)
    score_index = torch.where(j == 0, torch.repeat_interleave(torch.tensor(predictor), scored),
                              torch.repeat_interleave(torch.tensor(body_start), scored) + j - 1)
    layout = torch.arange(width)[None, :] < scored[:, None]
    targets = input_ids[:, prompt_width:][layout]
    columns = score_index % length
    keep = torch.unique(columns)
    kept_index = (score_index // length) * keep.numel() + torch.searchsorted(keep, columns)
    prefix = prefix_index(spans) if packing.mask == "prefix" else None  # (one row: flat indices are positions)
    cu_seq_lens, max_length = _boundaries(positions) if packing.mask == "varlen" else (None, 0)
    return PackedRows(ids.view(n_rows, length), positions.view(n_rows, length), segments.view(n_rows, length),
                      branch.view(n_rows, length), score_index, targets, layout, keep, kept_index, packing, prefix,
                      cu_seq_lens, max_length, source=source)


def _boundaries(positions: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cu_seq_lens, longest) of the flat packed positions: a sequence starts wherever the position is 0 (each
    prompt, and the padding run at a row's end), as transformers' `prepare_fa_kwargs_from_position_ids` reads them."""
    starts = (positions == 0).nonzero()[:, 0]
    cu = torch.cat([starts, torch.tensor([positions.numel()])]).to(torch.int32)
    return cu, int(cu.diff().max())


def _pad_positions(is_pad: torch.Tensor) -> torch.Tensor:
    """Position ids 0, 1, 2, ... along each run of padding at a row's end (a sequence of its own to transformers)."""
    run = torch.cumsum(is_pad.long(), 1)
    return (run - 1).clamp(min=0)
