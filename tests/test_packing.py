"""Padding-free passes (grpo/engines/packing.py): the packed layout by hand, the packed passes' log-probs against the
padded pass's for each attention that takes them, which packing each model gets, and the one-pass loss on ragged
rows (grpo.engines.head.hidden_loss's layout) against the padded one."""

from __future__ import annotations

import pytest
import torch

from grpo.engines.head import hidden_loss
from grpo.engines.packing import Packing, choose_packing, pack
from grpo.engines.policy import completion_logprobs
from grpo.training.rollout.batch import pack as pad_rows

SHARED = Packing(True, "bool", 1e-3)
SEQUENCES = Packing(False, None, 1e-3)
ONE_ROW = Packing(False, None, None)


def padded(prompts, completions, pad=1):
    """The trainer's padded micro-batch: ids and attention (n, P+W), prompts left-padded, completions right-padded."""
    ids, attention, _ = pad_rows(prompts, completions, pad, [True] * len(prompts))
    return ids, attention, attention.shape[1] - max(len(p) for p in prompts)


def test_a_shared_prompt_is_laid_once_and_each_token_scored_by_the_position_before_it():
    """Two rows share the prompt [5, 6]; completions [7, 8, 9] and [10]. Packed: the prompt once, then each
    completion less its last token, [5, 6, 7, 8] (the second completion adds nothing). Row 0's tokens 7, 8, 9 are
    predicted by positions 1 (the prompt's last), 2 and 3; row 1's token 10 by position 1 too. Positions continue from
    the prompt for each completion: [0, 1, 2, 3]. Completion 1 sees the prompt and itself; nothing else is there."""
    ids, attention, width = padded([[5, 6], [5, 6]], [[7, 8, 9], [10]])
    rows = pack(ids, attention, width, Packing(True, "bool", None))
    assert rows.input_ids.tolist() == [[5, 6, 7, 8]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3]]
    assert rows.branches.tolist() == [[0, 0, 1, 1]]
    assert rows.score_index.tolist() == [1, 2, 3, 1]
    assert rows.targets.tolist() == [7, 8, 9, 10]
    assert rows.layout.tolist() == [[True, True, True], [True, False, False]]
    assert rows.unpack(torch.tensor([1.0, 2.0, 3.0, 4.0])).tolist() == [[1, 2, 3], [4, 0, 0]]


def test_the_shared_prompt_mask_lets_a_completion_see_its_prompt_and_itself_only():
    """Prompt [5, 6] with completions [7, 8, 9] and [10, 11, 12]: packed [5, 6, 7, 8, 10, 11] (branches 0 0 1 1 2 2),
    positions [0, 1, 2, 3, 2, 3]. Token 10 (index 4) sees the prompt (0, 1) and itself, not completion 1 (2, 3)."""
    ids, attention, width = padded([[5, 6], [5, 6]], [[7, 8, 9], [10, 11, 12]])
    rows = pack(ids, attention, width, Packing(True, "bool", None))
    assert rows.input_ids.tolist() == [[5, 6, 7, 8, 10, 11]] and rows.position_ids.tolist() == [[0, 1, 2, 3, 2, 3]]
    want = torch.tensor([[1, 0, 0, 0, 0, 0],
                         [1, 1, 0, 0, 0, 0],
                         [1, 1, 1, 0, 0, 0],
                         [1, 1, 1, 1, 0, 0],
                         [1, 1, 0, 0, 1, 0],
                         [1, 1, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(rows.attention_mask(torch.float32)[0, 0], want)
    additive = pack(ids, attention, width, Packing(True, "additive", None)).attention_mask(torch.float32)[0, 0]
    assert torch.equal(additive == 0, want) and float(additive.min()) == torch.finfo(torch.float32).min
    assert pack(ids, attention, width, ONE_ROW).attention_mask(torch.float32) is None  # transformers' own


def ragged_batch(vocab=200, seed=0):
    """Three groups of four (prompts of 2, 5 and 9 tokens), completions of 1 to 12 tokens: the padded micro-batch."""
    g = torch.Generator().manual_seed(seed)
    prompts, completions = [], []
    for p_len in (2, 5, 9):
        prompt = torch.randint(2, vocab, (p_len,), generator=g).tolist()
        for c_len in torch.randint(1, 13, (4,), generator=g).tolist():
            prompts.append(prompt)
            completions.append(torch.randint(2, vocab, (c_len,), generator=g).tolist())
    completions[5] = completions[5][:1]  # a one-token completion: only the prompt's last position scores it
    return padded(prompts, completions)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("packing", [SHARED, SEQUENCES, ONE_ROW, Packing(True, "bool", 1.0)],
                         ids=["shared", "sequences", "one_row", "shared_short_rows"])
def test_packed_passes_give_the_padded_log_probs(tiny_model_dir, attention, packing, monkeypatch):
    """Every layout, through the tiled head and through the model's own forward (logits path), gives the padded
    pass's log-probs and entropies up to float32 rounding, 0 past each row's end; gradients too."""
    from transformers import AutoModelForCausalLM

    from grpo.engines import policy

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attention)
    packing = Packing(packing.shared_prompts, "additive" if packing.shared_prompts else None, packing.pair_cost)
    ids, attention_mask, width = ragged_batch(vocab=model.config.vocab_size)
    rows = pack(ids, attention_mask, width, packing)
    real = rows.layout
    assert rows.tokens < ids.numel() and int(real.sum()) == int(attention_mask[:, -width:].sum())
    weights = torch.linspace(-1, 1, real.numel()).reshape(real.shape)
    for logits_path in (False, True):
        if logits_path:  # a head that is not a plain linear layer (or a wrapped model) takes the model's forward
            monkeypatch.setattr(policy, "plain_head", lambda model: None)
        results = []
        for layout in (None, rows):
            model.zero_grad()
            logp, entropy = completion_logprobs(model, ids, attention_mask, width, 0.7, with_entropy=True,
                                                packed=layout)
            (weights * logp * real).sum().backward()
            results.append((logp.detach(), entropy, [p.grad.clone() for p in model.parameters()]))
        (want, want_entropy, want_grads), (got, got_entropy, got_grads) = results
        torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_entropy[real], want_entropy[real], atol=1e-5, rtol=1e-5)
        assert got[~real].abs().max() == 0 and got_entropy[~real].abs().max() == 0
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w, atol=1e-5 * float(w.abs().max()) + 1e-7, rtol=1e-4)


def test_rows_are_sized_by_cost():
    """Cheap attention (a small pair cost) packs the micro-batch into few long rows; dear attention into rows about as
    long as its longest sequence, duplicating prompts where a group no longer fits a row."""
    ids, attention, width = ragged_batch()
    long_rows = pack(ids, attention, width, Packing(True, "bool", 1e-6))
    short_rows = pack(ids, attention, width, Packing(True, "bool", 1.0))
    longest = int(max(attention[r, :-width].sum() + attention[r, -width:].sum() - 1 for r in range(ids.shape[0])))
    assert long_rows.input_ids.shape[0] == 1
    assert short_rows.input_ids.shape[1] == longest and short_rows.input_ids.shape[0] > 3


def test_each_attention_gets_the_packing_it_can_take(tiny_model_dir):
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    packing, why = choose_packing(model)
    assert packing.shared_prompts and packing.mask == "additive" and why == ""  # (sdpa too: D13)
    model.config._attn_implementation = "eager"
    assert choose_packing(model)[0].mask == "additive"
    model.config._attn_implementation = "flash_attention_2"  # (the flag only: no kernel runs here)
    packing, _ = choose_packing(model)
    assert not packing.shared_prompts and packing.pair_cost is None and packing.mask == "varlen"  # one row, cu_seqlens
    model.config._attn_implementation = "paged|eager"
    assert choose_packing(model) == (None, "attention 'paged|eager' is not one transformers masks packed sequences "
                                           "for")
    assert choose_packing(model, enabled=False) == (None, "use_remove_padding: false")
    sliding = Qwen2ForCausalLM(Qwen2Config(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True,
                                           sliding_window=4, max_window_layers=1))
    packing, _ = choose_packing(sliding)  # a window in a custom mask would be lost: transformers masks sequences
    assert not packing.shared_prompts and packing.mask is None and packing.pair_cost is not None


def test_a_micro_batch_with_nothing_to_score_or_an_empty_prompt_is_not_packed():
    ids, attention, width = padded([[5, 6]], [[]])
    assert pack(ids, attention, width, SHARED) is None
    ids, attention, width = padded([[], [5]], [[7], [8]])
    assert pack(ids, attention, width, SHARED) is None


def row_loss_on(layout, weights):
    """A nonlinear loss, a sum over rows, of the real positions only: sum w logp + 0.5 exp(logp) - (row mean)^2."""
    def loss(logp, rows):
        m, w = layout[rows].float(), weights[rows]
        return (m * (w * logp + 0.5 * logp.exp())).sum() - (((m * logp).sum(-1) / m.sum(-1).clamp(min=1)) ** 2).sum()
    return loss


@pytest.mark.parametrize("rows_per_chunk, estimate", [(1, None), (2, None), (5, None), (1, "close"), (1, "off")])
def test_hidden_loss_on_ragged_rows_is_the_padded_loss(rows_per_chunk, estimate):
    """hidden_loss(layout=...) on the real positions only (n_tok, H) gives the padded call's loss, log-probs,
    entropies and gradients (hidden at the real positions, weight, bias), through the buffer and the seeded pass."""
    g = torch.Generator().manual_seed(5)
    rows, cols, size, vocab = 4, 6, 8, 11
    hidden, weight = torch.randn(rows, cols, size, generator=g), torch.randn(vocab, size, generator=g)
    bias, tokens = torch.randn(vocab, generator=g), torch.randint(0, vocab, (rows, cols), generator=g)
    layout = torch.arange(cols)[None, :] < torch.tensor([6, 2, 0, 4])[:, None]  # row 2 is empty
    weights = torch.linspace(-1, 1, rows * cols).reshape(rows, cols)
    exact = hidden_loss(hidden, weight, tokens, row_loss_on(layout, weights), 0.8, bias=bias)[1]
    noise = torch.rand(rows, cols, generator=g)
    guess = None if estimate is None else exact + (1e-7 if estimate == "close" else 0.3) * noise
    outs = []
    for ragged in (False, True):
        leaves = [t.clone().requires_grad_() for t in ((hidden[layout] if ragged else hidden), weight, bias)]
        loss, logp, entropy = hidden_loss(leaves[0], leaves[1], tokens[layout] if ragged else tokens,
                                          row_loss_on(layout, weights), 0.8, bias=leaves[2], with_entropy=True,
                                          rows_per_chunk=rows_per_chunk, logp_estimate=guess,
                                          layout=layout if ragged else None)
        grads = torch.autograd.grad(2.0 * loss, leaves)
        outs.append((loss, logp, entropy, grads[0] if ragged else grads[0][layout], *grads[1:]))
    (loss, logp, entropy, *grads), (r_loss, r_logp, r_entropy, *r_grads) = outs
    torch.testing.assert_close(r_loss, loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r_logp[layout], logp[layout], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r_entropy[layout], entropy[layout], atol=1e-5, rtol=1e-5)
    assert r_logp[~layout].abs().max() == 0 and r_entropy[~layout].abs().max() == 0
    for got, want in zip(r_grads, grads):
        torch.testing.assert_close(got, want, atol=1e-5 * float(want.abs().max()), rtol=1e-5)


def test_hidden_loss_refuses_a_layout_that_does_not_match():
    layout = torch.tensor([[True, False], [True, True]])
    with pytest.raises(ValueError, match=r"hidden_loss: layout has 3 True cells but hidden has 2 positions"):
        hidden_loss(torch.zeros(2, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long), lambda lp, r: lp.sum(),
                    layout=layout)
    with pytest.raises(ValueError, match=r"hidden_loss: need hidden \(n_tok, H\)"):
        hidden_loss(torch.zeros(1, 3, 4), torch.zeros(5, 4), torch.zeros(1, 3, dtype=torch.long),
                    lambda lp, r: lp.sum(), layout=layout)


def test_a_sliding_window_model_packs_whole_sequences_with_the_padded_log_probs():
    """Layers with a 4-token window: prompts are not shared (a custom mask would lose the window); whole sequences
    are packed and transformers masks them, windows included, from the position ids: the padded pass's log-probs."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sizes = dict(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**sizes, use_sliding_window=True, sliding_window=4, max_window_layers=1))
    packing, _ = choose_packing(model)
    assert not packing.shared_prompts and packing.mask is None
    ids, attention_mask, width = ragged_batch()
    rows = pack(ids, attention_mask, width, packing)
    want = completion_logprobs(model, ids, attention_mask, width, 1.0)
    got = completion_logprobs(model, ids, attention_mask, width, 1.0, packed=rows)
    real = rows.layout
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
    # the window matters here: with full attention the log-probs would differ
    full = Qwen2ForCausalLM(Qwen2Config(**sizes))
    full.load_state_dict(model.state_dict())
    assert (completion_logprobs(full, ids, attention_mask, width, 1.0)[real] - want[real]).abs().max() > 1e-3


def test_the_grouped_attention_index_by_hand():
    """One row: a unit with prompt at 0-2 and completions at 3-4 and 5 (lengths 2 and 1), a unit with prompt 6-7 and
    one completion 8-10. Prompts (U=2, P=3): [0 1 2] and [6 7 7] (the last repeated, masked); completions (C=3, T=3):
    [3 4 4], [5 5 5], [8 9 10], each against its prompt then itself."""
    from grpo.engines.packing import prefix_index

    idx = prefix_index([(0, 3, [(3, 2), (5, 1)]), (6, 2, [(8, 3)])])
    assert idx.prompt_q.tolist() == [[0, 1, 2], [6, 7, 7]]
    assert idx.comp_q.tolist() == [[3, 4, 4], [5, 5, 5], [8, 9, 10]]
    assert idx.comp_k.tolist() == [[0, 1, 2, 3, 4, 4], [0, 1, 2, 5, 5, 5], [6, 7, 7, 8, 9, 10]]
    # completion 0's second token (position 4) sees the prompt and positions 3, 4; completion 2's first (8) sees
    # its 2-token prompt and itself
    assert idx.comp_mask[0, 0, 1].tolist() == [True, True, True, True, True, False]
    assert idx.comp_mask[2, 0, 0].tolist() == [True, True, False, True, False, False]
    assert idx.prompt_mask[1, 0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    # every position of the row once: prompts' real cells (0 1 2, 6 7), then completions' (3 4, 5, 8 9 10)
    listed = [0, 1, 2, 6, 7, 3, 4, 5, 8, 9, 10]
    assert [listed[i] for i in idx.order.tolist()] == list(range(11))


def test_the_cpu_engines_grouped_attention_gives_the_padded_log_probs_and_gradients(tiny_model_dir):
    """The CPU engine switches sdpa to its grouped attention (grpo/engines/cpu/attention.py): a packed micro-batch in
    one row, each prompt attending to itself and each completion to its prompt and itself. Log-probs, entropies and
    gradients equal the padded pass's (the tiny model has 4 query heads on 2 key-value heads); a padded pass through
    the switched model is plain sdpa; restoring gives sdpa back."""
    from transformers import AutoModelForCausalLM

    from grpo.engines.cpu import attention

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    ids, attention_mask, width = ragged_batch(vocab=model.config.vocab_size)
    rows = pack(ids, attention_mask, width, Packing(True, "prefix", None))
    real = rows.layout
    weights = torch.linspace(-1, 1, real.numel()).reshape(real.shape) * real  # a loss of the real tokens only
    results = []
    for grouped in (False, True):
        model.zero_grad()
        if grouped:
            assert attention.use_prefix_attention(model) and attention.switched(model)
        logp, entropy = completion_logprobs(model, ids, attention_mask, width, 0.7, with_entropy=True,
                                            packed=rows if grouped else None)
        (weights * logp).sum().backward()
        results.append((logp.detach(), entropy, [p.grad.clone() for p in model.parameters()]))
    assert rows.input_ids.shape[0] == 1 and rows.tokens == int((rows.segments >= 0).sum())  # one row, no padding
    (want, want_entropy, want_grads), (got, got_entropy, got_grads) = results
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_entropy[real], want_entropy[real], atol=1e-5, rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-5 * float(w.abs().max()) + 1e-7, rtol=1e-4)
    with torch.no_grad():  # without a prefix index the switched model runs sdpa, masks and all
        torch.testing.assert_close(completion_logprobs(model, ids, attention_mask, width, 0.7), want)
    attention.restore_attention(model)
    assert model.config._attn_implementation == "sdpa" and not attention.switched(model)


def test_the_flash_layout_hands_transformers_its_sequence_boundaries():
    """Flash attention's one row (D10): prompts [5, 6] and [3] with completions [7, 8, 9] and [4, 2]. Laid whole:
    [5, 6, 7, 8 | 3, 4] (each completion less its last token), positions [0, 1, 2, 3 | 0, 1]. The sequences start at
    0 and 4 and the row ends at 6: cu_seq_lens [0, 4, 6] (int32), the longest 4; passed as transformers' varlen
    kwargs (an int, so reading it costs no host sync)."""
    ids, attention, width = padded([[5, 6], [3]], [[7, 8, 9], [4, 2]])
    rows = pack(ids, attention, width, Packing(False, "varlen", None))
    assert rows.input_ids.tolist() == [[5, 6, 7, 8, 3, 4]] and rows.position_ids.tolist() == [[0, 1, 2, 3, 0, 1]]
    kwargs = rows.attention_kwargs()
    assert kwargs["cu_seq_lens_q"].dtype == torch.int32 and kwargs["cu_seq_lens_q"].tolist() == [0, 4, 6]
    assert kwargs["cu_seq_lens_k"] is kwargs["cu_seq_lens_q"]
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == 4 and type(kwargs["max_length_q"]) is int
    assert rows.to("cpu").attention_kwargs()["max_length_q"] == 4
    assert pack(ids, attention, width, ONE_ROW).attention_kwargs() == {}  # other layouts pass nothing


def _varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """A stand-in for flash attention's varlen kernel in plain torch: causal attention within each sequence that
    cu_seq_lens_q marks; it refuses to run without the boundaries (as a pass that syncs to find them would)."""
    cu = kwargs["cu_seq_lens_q"].tolist()
    assert attention_mask is None and kwargs["max_length_q"] == max(b - a for a, b in zip(cu, cu[1:]))
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    out = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        query[..., a:b, :], key[..., a:b, :], value[..., a:b, :], is_causal=True, scale=scaling)
        for a, b in zip(cu, cu[1:])], dim=2)
    return out.transpose(1, 2).contiguous(), None


def test_the_flash_layout_with_its_boundaries_gives_the_padded_log_probs(tiny_model_dir, monkeypatch):
    """The packed forward of the flash layout, through an attention that reads only the boundaries handed over
    (`_varlen_attention`), gives the padded pass's log-probs: the boundaries are the right ones, and they reach every
    layer's attention through the model's forward."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    ids, attention_mask, width = ragged_batch(vocab=model.config.vocab_size)
    with torch.no_grad():
        want = completion_logprobs(model, ids, attention_mask, width, 1.0)
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "flash_attention_2", _varlen_attention)
    model.config._attn_implementation = "flash_attention_2"
    packing, _ = choose_packing(model)
    assert packing.mask == "varlen"
    rows = pack(ids, attention_mask, width, packing)
    with torch.no_grad():
        got = completion_logprobs(model, ids, attention_mask, width, 1.0, packed=rows)
    real = rows.layout
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)


def test_the_shared_prompt_mask_is_one_tensor_that_every_layer_shares(tiny_model_dir):
    """D13: sdpa converts a boolean mask to a float copy in every call, and each layer keeps its copy for backward
    (layers x R x L^2 x 2 bytes in bf16). The packed pass hands sdpa an additive mask in the dtype attention computes
    in (bf16 under autocast over float32 weights), so every layer saves the same tensor; the log-probs are the
    padded pass's up to bf16 rounding."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    layers = model.config.num_hidden_layers
    ids, attention_mask, width = ragged_batch(vocab=model.config.vocab_size)
    packing, _ = choose_packing(model)
    copies = {}
    for kind in ("bool", "additive"):
        rows = pack(ids, attention_mask, width, Packing(True, kind, packing.pair_cost))
        shape = (rows.input_ids.shape[0], 1, rows.input_ids.shape[1], rows.input_ids.shape[1])
        saved = []
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.append(t) or t, lambda t: t):
            logp = completion_logprobs(model, ids, attention_mask, width, 1.0, packed=rows)
        masks = [t for t in saved if tuple(t.shape) == shape]
        assert len(masks) == layers and {t.dtype for t in masks} == {torch.bfloat16}
        copies[kind] = len({t.data_ptr() for t in masks})
    assert copies == {"bool": layers, "additive": 1} and packing.mask == "additive"
    with torch.no_grad():
        want = completion_logprobs(model, ids, attention_mask, width, 1.0)
    real = rows.layout
    assert float((logp.detach() - want).abs()[real].mean()) < 2e-2
