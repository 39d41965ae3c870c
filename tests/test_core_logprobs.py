"""Tests of grpo.engines.head (logprobs, loss, seeded): golden values, agreement with the naive full-softmax
computation (values and gradients), chunk coverage, and that backward does not keep an (N, T, V) tensor alive."""

import math

import pytest
import torch

from grpo.engines.head import hidden_logprobs, hidden_loss, token_entropy, token_logprobs
from grpo.engines.head.logprobs import _chunks


def naive_logprobs(logits, tokens, temperature=1.0):
    """The obvious version: a full float32 log_softmax over (N, T, V)."""
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def naive_entropy(logits, temperature=1.0):
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(log_probs.exp() * log_probs).sum(-1)


def random_case(seed, rows=3, cols=5, vocab=11, hidden_size=6, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, cols, hidden_size, generator=generator, dtype=dtype)
    weight = torch.randn(vocab, hidden_size, generator=generator, dtype=dtype)
    bias = torch.randn(vocab, generator=generator, dtype=dtype)
    tokens = torch.randint(0, vocab, (rows, cols), generator=generator)
    return hidden, weight, bias, tokens


def test_golden_two_token_vocabulary():
    # logits [0, ln 3] -> p = [1/4, 3/4]: log p(token 1) = ln 0.75 = -0.287682, log p(token 0) = ln 0.25 = -1.386294,
    # entropy = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.346574 + 0.215762 = 0.562335 nats.
    # With temperature 2 the logits [0, 2 ln 3] are divided back to [0, ln 3]: same numbers.
    logits = torch.tensor([[[0.0, math.log(3)], [0.0, math.log(3)]]])
    tokens = torch.tensor([[1, 0]])
    torch.testing.assert_close(token_logprobs(logits, tokens), torch.tensor([[math.log(0.75), math.log(0.25)]]))
    entropy = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(token_entropy(logits), torch.full((1, 2), entropy))
    torch.testing.assert_close(token_logprobs(2 * logits, tokens, temperature=2.0),
                               torch.tensor([[math.log(0.75), math.log(0.25)]]))
    torch.testing.assert_close(token_entropy(2 * logits, temperature=2.0), torch.full((1, 2), entropy))


@pytest.mark.parametrize("rows, cols, positions", [(3, 5, 1), (3, 5, 4), (3, 5, 10), (3, 5, 100), (1, 7, 3), (0, 4, 2)])
def test_chunks_cover_every_position_once_within_budget(rows, cols, positions):
    seen = torch.zeros(rows, cols, dtype=torch.long)
    for rs, cs in _chunks(rows, cols, positions):
        assert seen[rs, cs].numel() <= positions
        seen[rs, cs] += 1
    assert bool((seen == 1).all())


@pytest.mark.parametrize("chunk_size", [None, 1, 4, 7, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_and_entropy_match_naive_with_gradients(chunk_size, temperature):
    generator = torch.Generator().manual_seed(0)
    # Slice off the last position, as a trainer does with model logits: a non-contiguous view.
    full = torch.randn(3, 6, 13, generator=generator, requires_grad=True)
    logits = full[:, :-1]
    tokens = torch.randint(0, 13, (3, 5), generator=generator)
    weights = torch.randn(3, 5, generator=generator)  # an arbitrary upstream gradient

    logp = token_logprobs(logits, tokens, temperature=temperature, chunk_size=chunk_size)
    entropy = token_entropy(logits, chunk_size=chunk_size, temperature=temperature)
    assert logp.dtype == torch.float32 and logp.shape == (3, 5)
    (grad,) = torch.autograd.grad((logp * weights).sum() + (entropy * weights).sum(), full)

    expected_logp = naive_logprobs(logits, tokens, temperature)
    expected_entropy = naive_entropy(logits, temperature)
    (expected_grad,) = torch.autograd.grad((expected_logp * weights).sum() + (expected_entropy * weights).sum(), full)
    torch.testing.assert_close(logp, expected_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, expected_entropy, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, expected_grad, atol=1e-5, rtol=1e-5)


def test_bfloat16_logits_give_float32_logprobs():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, 9, generator=generator).to(torch.bfloat16)
    tokens = torch.randint(0, 9, (2, 4), generator=generator)
    logp = token_logprobs(logits, tokens, chunk_size=3)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp, naive_logprobs(logits, tokens), atol=1e-6, rtol=1e-6)


def test_minus_inf_logits_give_finite_entropy():
    # A masked-out vocabulary entry (-inf logit) has p = 0 and contributes 0 log 0 = 0: entropy of [1/2, 1/2, 0]
    # is ln 2 = 0.693147, and its gradient must not be NaN.
    logits = torch.tensor([[[0.0, 0.0, -float("inf")]]], requires_grad=True)
    entropy = token_entropy(logits)
    torch.testing.assert_close(entropy, torch.tensor([[math.log(2)]]))
    entropy.sum().backward()
    assert torch.isfinite(logits.grad).all()


@pytest.mark.parametrize("chunk_size", [1, 4, 6, 1024])
@pytest.mark.parametrize("vocab_block", [None, 1, 3, 4, 11])
@pytest.mark.parametrize("use_bias", [False, True])
def test_hidden_logprobs_match_naive_full_logits(chunk_size, vocab_block, use_bias, kernels=None):
    # vocab 11: blocks of 1 (the running max moves at nearly every tile), 3 and 4 (a short last tile), 11 (one tile).
    # tests/test_native.py runs this with the compiled tile kernels.
    hidden, weight, bias, tokens = random_case(seed=chunk_size)
    weight[2] += 3.0  # a large logit in the middle of the vocabulary: the running max must move up and be rescaled
    bias = bias if use_bias else None
    temperature = 0.8
    leaves = [t.clone().requires_grad_() for t in ((hidden, weight, bias) if use_bias else (hidden, weight))]
    logp, entropy = hidden_logprobs(leaves[0], leaves[1], tokens, temperature, chunk_size,
                                    bias=leaves[2] if use_bias else None, with_entropy=True, vocab_block=vocab_block,
                                    kernels=kernels)
    upstream = torch.linspace(-1, 1, tokens.numel()).reshape(tokens.shape)
    grads = torch.autograd.grad((logp * upstream).sum() + (entropy * upstream).sum(), leaves)

    naive_leaves = [t.clone().requires_grad_() for t in leaves]
    logits = naive_leaves[0] @ naive_leaves[1].T + (naive_leaves[2] if use_bias else 0)  # (N, T, V): all of it
    expected_logp, expected_entropy = naive_logprobs(logits, tokens, temperature), naive_entropy(logits, temperature)
    expected = torch.autograd.grad((expected_logp * upstream).sum() + (expected_entropy * upstream).sum(), naive_leaves)
    torch.testing.assert_close(logp, expected_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, expected_entropy, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_hidden_logprobs_with_frozen_head_and_no_entropy():
    # LoRA-style: the LM head is frozen, only the hidden states need a gradient.
    hidden, weight, _, tokens = random_case(seed=3)
    hidden.requires_grad_()
    logp, entropy = hidden_logprobs(hidden, weight, tokens, chunk_size=2)
    assert entropy is None
    logp.sum().backward()
    naive_hidden = hidden.detach().clone().requires_grad_()
    naive_logprobs(naive_hidden @ weight.T, tokens).sum().backward()
    torch.testing.assert_close(hidden.grad, naive_hidden.grad, atol=1e-5, rtol=1e-5)
    assert weight.grad is None


def test_float64_gradcheck():
    # Finite differences against our hand-written backward passes (float64 in, float64 out).
    hidden, weight, bias, tokens = random_case(seed=5, rows=2, cols=3, vocab=5, hidden_size=3, dtype=torch.float64)
    leaves = tuple(t.requires_grad_() for t in (hidden, weight, bias))
    assert torch.autograd.gradcheck(
        lambda h, w, b: hidden_logprobs(h, w, tokens, 0.9, 4, b, with_entropy=True), leaves)
    assert torch.autograd.gradcheck(
        lambda h, w, b: hidden_logprobs(h, w, tokens, 0.9, 4, b, with_entropy=True, vocab_block=2), leaves)
    logits = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, tokens, 1.3, chunk_size=2), (logits,))
    assert torch.autograd.gradcheck(lambda x: token_entropy(x, chunk_size=4), (logits,))


def test_backward_keeps_no_full_vocabulary_tensor():
    # The naive version saves an (N, T, V) float32 log-softmax for backward. Ours saves only the caller's own
    # inputs: for token_logprobs the logits themselves (no copy), for hidden_logprobs nothing of size N*T*V.
    hidden, weight, _, tokens = random_case(seed=7, rows=4, cols=8, vocab=50, hidden_size=4)
    hidden.requires_grad_()
    logp, _ = hidden_logprobs(hidden, weight, tokens, chunk_size=5)
    saved = logp.grad_fn.saved_tensors
    assert max(t.numel() for t in saved if t is not None) < tokens.numel() * weight.shape[0]

    logits = (hidden @ weight.T).detach().requires_grad_()
    logp = token_logprobs(logits, tokens, chunk_size=5)
    for tensor in logp.grad_fn.saved_tensors:
        if tensor is not None and tensor.numel() == logits.numel():
            assert tensor.data_ptr() == logits.data_ptr() and tensor.dtype == logits.dtype


def test_bad_arguments_raise_clear_errors():
    logits = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match=r"token_logprobs: tokens must have shape \(N, T\) = \(2, 3\)"):
        token_logprobs(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="integer token ids"):
        token_logprobs(logits, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_entropy(logits, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size must be a positive"):
        token_logprobs(logits, torch.zeros(2, 3, dtype=torch.long), chunk_size=0)
    with pytest.raises(ValueError, match="hidden_logprobs: vocab_block must be a positive"):
        hidden_logprobs(torch.zeros(2, 3, 5), torch.zeros(4, 5), torch.zeros(2, 3, dtype=torch.long), vocab_block=0)
    with pytest.raises(ValueError, match=r"hidden_logprobs: need hidden \(N, T, H\) and weight \(V, H\)"):
        hidden_logprobs(torch.zeros(2, 3, 5), torch.zeros(4, 6), torch.zeros(2, 3, dtype=torch.long))


def row_separable_loss(weights):
    """A nonlinear loss that is a sum over rows: sum_t w_t logp_t + 0.5 exp(logp_t) - (row mean of logp)^2."""
    def loss(logp, rows):
        w = weights[rows]
        return (w * logp + 0.5 * logp.exp()).sum() - (logp.mean(-1) ** 2).sum()
    return loss


@pytest.mark.parametrize("rows_per_chunk", [1, 2, 5])
@pytest.mark.parametrize("vocab_block", [None, 1, 3, 4])
@pytest.mark.parametrize("use_bias", [False, True])
def test_hidden_loss_matches_autograd_through_the_naive_logits(rows_per_chunk, vocab_block, use_bias, kernels=None,
                                                               atol=1e-5):
    # tests/test_native.py runs this with the compiled tile kernels (their sums round differently from torch's, and
    # this loss's gradients carry float32 errors of ~1e-5 on both: against float64, 1.1e-5 for torch, 1.5e-5 for C).
    hidden, weight, bias, tokens = random_case(seed=rows_per_chunk + 10, rows=4)
    weight[5] += 3.0
    bias = bias if use_bias else None
    weights = torch.linspace(-1, 1, tokens.numel()).reshape(tokens.shape)
    temperature = 0.8
    leaves = [t.clone().requires_grad_() for t in ((hidden, weight, bias) if use_bias else (hidden, weight))]
    loss, logp, entropy = hidden_loss(leaves[0], leaves[1], tokens, row_separable_loss(weights), temperature,
                                      bias=leaves[2] if use_bias else None, with_entropy=True,
                                      rows_per_chunk=rows_per_chunk, vocab_block=vocab_block, kernels=kernels)
    grads = torch.autograd.grad(3.0 * loss, leaves)  # a scale other than 1 reaches every gradient

    naive = [t.clone().requires_grad_() for t in leaves]
    logits = naive[0] @ naive[1].T + (naive[2] if use_bias else 0)
    expected_logp = naive_logprobs(logits, tokens, temperature)
    expected_loss = row_separable_loss(weights)(expected_logp, slice(None))
    expected = torch.autograd.grad(3.0 * expected_loss, naive)
    torch.testing.assert_close(loss, expected_loss.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logp, expected_logp.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, naive_entropy(logits, temperature).detach(), atol=1e-5, rtol=1e-5)
    assert not logp.requires_grad and not entropy.requires_grad
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, atol=atol, rtol=1e-5)


@pytest.mark.parametrize("estimate, corrected", [
    ("close", False),  # within float32 rounding, as the sampler's own log-probs are: one pass
    ("off", True),  # 0-0.5 nats off: the weight gradient's correcting pass
    ("too_high", True),  # 5 nats above: capped exponents, the exact log-sum-exp in a pass of its own
    ("too_low", True),  # 120 nats below: every q underflows, likewise
    ("mixed", True),  # close but for two positions 30 nats off (as padding past a row's end can be)
])
@pytest.mark.parametrize("vocab_block", [None, 3])
@pytest.mark.parametrize("use_bias", [False, True])
def test_seeded_hidden_loss_matches_autograd_through_the_naive_logits(estimate, corrected, vocab_block, use_bias,
                                                                     monkeypatch, kernels=None, atol=1e-5):
    # tests/test_native.py runs this with the compiled tile kernels.
    import grpo.engines.head.seeded as seeded_module

    hidden, weight, bias, tokens = random_case(seed=31, rows=4)
    weight[5] += 3.0
    bias = bias if use_bias else None
    weights = torch.linspace(-1, 1, tokens.numel()).reshape(tokens.shape)
    temperature = 0.8
    naive = [t.clone().requires_grad_() for t in ((hidden, weight, bias) if use_bias else (hidden, weight))]
    logits = naive[0] @ naive[1].T + (naive[2] if use_bias else 0)
    expected_logp = naive_logprobs(logits, tokens, temperature)
    expected_loss = row_separable_loss(weights)(expected_logp, slice(None))
    expected = torch.autograd.grad(3.0 * expected_loss, naive)
    noise = torch.rand(tokens.shape, generator=torch.Generator().manual_seed(3))
    mixed = torch.zeros(tokens.shape)
    mixed[1, 2], mixed[3, 4] = 30.0, -30.0
    logp_estimate = expected_logp.detach() + {"close": 1e-6 * noise, "off": 0.5 * noise, "too_high": 5.0,
                                              "too_low": -120.0, "mixed": 1e-6 * noise + mixed}[estimate]
    passes = []
    correct = seeded_module._correct_seeded
    monkeypatch.setattr(seeded_module, "_correct_seeded", lambda h, *a: passes.append(len(h)) or correct(h, *a))

    leaves = [t.detach().clone().requires_grad_() for t in naive]
    loss, logp, entropy = hidden_loss(leaves[0], leaves[1], tokens, row_separable_loss(weights), temperature,
                                      bias=leaves[2] if use_bias else None, with_entropy=True,
                                      vocab_block=vocab_block, kernels=kernels, logp_estimate=logp_estimate)
    grads = torch.autograd.grad(3.0 * loss, leaves)
    assert bool(passes) == corrected
    if estimate == "mixed":  # the second pass runs over the rows of those two positions (this loss couples a
        assert passes == [2 * tokens.shape[1]]  # row's positions through its mean), not over all four rows
    torch.testing.assert_close(loss, expected_loss.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logp, expected_logp.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, naive_entropy(logits, temperature).detach(), atol=1e-5, rtol=1e-5)
    # The hidden states' gradient is exact: up to float32 rounding, which here (entries up to ~40, some near 0 by
    # cancellation) is ~1e-6 of the largest entry on both sides (against float64: 9e-6 here, 5e-6 for autograd).
    scale = float(expected[0].abs().max())
    torch.testing.assert_close(grads[0], expected[0], atol=max(atol, 1e-6 * scale), rtol=1e-5)
    for got, want in zip(grads[1:], expected[1:]):  # the head's: within the tolerance (1e-5) of the largest
        torch.testing.assert_close(got, want, atol=1e-5 * float(want.abs().max()), rtol=0)

    # A frozen head takes one pass (two head products) whatever the estimate: only the hidden gradient, exact.
    passes.clear()
    frozen = hidden.clone().requires_grad_()
    loss, _, _ = hidden_loss(frozen, weight, tokens, row_separable_loss(weights), temperature, bias=bias,
                             vocab_block=vocab_block, kernels=kernels, logp_estimate=logp_estimate)
    (grad_hidden,) = torch.autograd.grad(3.0 * loss, (frozen,))
    assert bool(passes) == (estimate in ("too_high", "too_low", "mixed"))  # the exact sum p W needs the tiles again
    torch.testing.assert_close(grad_hidden, expected[0], atol=max(atol, 1e-6 * scale), rtol=1e-5)


def test_seeded_hidden_loss_tolerance_zero_is_exact_and_gradcheck():
    hidden, weight, bias, tokens = random_case(seed=32, rows=2, cols=3, vocab=5, hidden_size=3, dtype=torch.float64)
    weights = torch.linspace(-1, 1, tokens.numel(), dtype=torch.float64).reshape(tokens.shape)
    estimate = naive_logprobs(hidden @ weight.T + bias, tokens, 0.9).double() + 0.01
    leaves = tuple(t.requires_grad_() for t in (hidden, weight, bias))
    assert torch.autograd.gradcheck(
        lambda h, w, b: hidden_loss(h, w, tokens, row_separable_loss(weights), 0.9, b, vocab_block=2,
                                    logp_estimate=estimate, tolerance=0.0)[0], leaves)
    with pytest.raises(ValueError, match="logp_estimate must have the tokens' shape"):
        hidden_loss(hidden, weight, tokens, row_separable_loss(weights), logp_estimate=estimate[:1])


@pytest.mark.parametrize("kernels", [None, "compiled"])
def test_seeded_hidden_loss_survives_non_finite_and_far_off_estimates(kernels):
    """NaN, +-inf and hugely low estimates, at positions the loss uses and at ones it ignores (padding), give finite,
    exact gradients; so does an estimate far too high under a loss that couples a row's positions (a sequence-level
    ratio), which inflates the others' first-pass terms."""
    from grpo.engines.cpu import native

    if kernels == "compiled":
        kernels = native.tile_kernels(torch.float32, torch.device("cpu"))
        if kernels is None:
            pytest.skip("no C compiler")
    hidden, weight, bias, tokens = random_case(seed=33, rows=3, cols=4)
    mask = torch.ones(tokens.shape)
    mask[1, 3] = 0.0

    def coupled(logp, rows):  # exp(mean over the row of logp - old) A, masked: a sequence-level ratio
        ratio = torch.exp(((logp - logp.detach() - 3.0) * mask[rows]).sum(-1) / mask[rows].sum(-1))
        return -(ratio * torch.tensor([1.0, -0.5, 0.25])[rows]).sum()

    naive = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    logp = naive_logprobs(naive[0] @ naive[1].T + naive[2], tokens, 0.9)
    expected = torch.autograd.grad(coupled(logp, slice(None)), naive)
    for position, value in [((0, 1), float("nan")), ((1, 3), float("nan")), ((1, 3), float("-inf")),
                            ((0, 1), float("inf")), ((1, 3), -100.0), ((2, 2), 30.0)]:
        estimate = logp.detach().clone()
        estimate[position] = value if value != 30.0 else estimate[position] + value
        leaves = [t.detach().clone().requires_grad_() for t in naive]
        loss, got_logp, _ = hidden_loss(leaves[0], leaves[1], tokens, coupled, 0.9, bias=leaves[2],
                                        vocab_block=4, kernels=kernels, logp_estimate=estimate)
        grads = torch.autograd.grad(loss, leaves)
        torch.testing.assert_close(got_logp, logp.detach(), atol=1e-5, rtol=1e-5)
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got, want, atol=1e-5 * float(want.abs().max()), rtol=0)


def test_seeded_bfloat16_head_scores_like_the_other_paths():
    """A bfloat16 head's tiles are rounded to bfloat16 before scoring: the seeded pass takes each target logit from
    its tile, as hidden_logprobs does, so the log-probs agree and good estimates need no second pass."""
    import grpo.engines.head.seeded as seeded_module

    hidden, weight, _, tokens = random_case(seed=34, rows=4, cols=6, vocab=300, hidden_size=16)
    hidden, weight = (3 * hidden).bfloat16(), weight.bfloat16()
    weights = torch.linspace(-1, 1, tokens.numel()).reshape(tokens.shape)
    tiled, _ = hidden_logprobs(hidden, weight, tokens, vocab_block=64)
    passes = []
    correct = seeded_module._correct_seeded
    seeded_module._correct_seeded = lambda *a: passes.append(1) or correct(*a)
    try:
        _, logp, _ = hidden_loss(hidden.clone().requires_grad_(), weight.clone().requires_grad_(), tokens,
                                 row_separable_loss(weights), vocab_block=64, logp_estimate=tiled)
    finally:
        seeded_module._correct_seeded = correct
    torch.testing.assert_close(logp, tiled, atol=1e-5, rtol=1e-5)
    assert not passes


def test_hidden_loss_in_place_weight_gradient_accumulates_into_grad():
    hidden, weight, _, tokens = random_case(seed=21, rows=3)
    weights = torch.linspace(-1, 1, tokens.numel()).reshape(tokens.shape)
    param = torch.nn.Parameter(weight.clone())
    reference = torch.nn.Parameter(weight.clone())
    for _ in range(2):  # the second pass adds to the .grad the first one created
        loss, _, _ = hidden_loss(hidden, param, tokens, row_separable_loss(weights), vocab_block=4,
                                 weight_grad_in_place=True)
        loss.backward()
        naive = naive_logprobs(hidden @ reference.T, tokens)
        row_separable_loss(weights)(naive, slice(None)).backward()
    torch.testing.assert_close(param.grad, reference.grad, atol=1e-5, rtol=1e-5)
    loss, _, _ = hidden_loss(hidden, param, tokens, row_separable_loss(weights), weight_grad_in_place=True)
    with pytest.raises(RuntimeError, match="gradient 1"):
        (2.0 * loss).backward()


@pytest.mark.parametrize("seeded", [False, True])
def test_hidden_loss_weight_gradient_made_in_given_storage(seeded):
    """weight_grad_storage becomes weight.grad when that is None, whatever it held (NaN here), with the gradient
    made without it; a later pass adds to it; a storage of the wrong shape or without in-place is refused."""
    hidden, weight, _, tokens = random_case(seed=26, rows=3)
    weights = torch.linspace(-1, 1, tokens.numel()).reshape(tokens.shape)
    estimate = hidden_logprobs(hidden, weight, tokens)[0] if seeded else None
    params = [torch.nn.Parameter(weight.clone()) for _ in range(2)]
    storage = torch.full_like(weight, float("nan"))
    for _ in range(2):  # the second pass accumulates into the storage, as into any .grad
        for param, given in zip(params, (storage, None)):
            loss, _, _ = hidden_loss(hidden, param, tokens, row_separable_loss(weights), vocab_block=4,
                                     weight_grad_in_place=True, logp_estimate=estimate, weight_grad_storage=given)
            loss.backward()
        assert params[0].grad.data_ptr() == storage.data_ptr()
        assert torch.equal(params[0].grad, params[1].grad)
    with pytest.raises(ValueError, match=r"hidden_loss: weight_grad_storage must be a contiguous tensor of the "
                                         r"weight's shape \(11, 6\)"):
        hidden_loss(hidden, params[0], tokens, row_separable_loss(weights), weight_grad_in_place=True,
                    weight_grad_storage=storage[:5])
    with pytest.raises(ValueError, match=r"weight_grad_in_place=False"):
        hidden_loss(hidden, params[0], tokens, row_separable_loss(weights), weight_grad_storage=storage)


def test_hidden_loss_float64_gradcheck_and_frozen_head():
    hidden, weight, bias, tokens = random_case(seed=22, rows=2, cols=3, vocab=5, hidden_size=3, dtype=torch.float64)
    weights = torch.linspace(-1, 1, tokens.numel(), dtype=torch.float64).reshape(tokens.shape)
    leaves = tuple(t.requires_grad_() for t in (hidden, weight, bias))
    assert torch.autograd.gradcheck(
        lambda h, w, b: hidden_loss(h, w, tokens, row_separable_loss(weights), 0.9, b, vocab_block=2)[0], leaves)
    frozen = weight.detach()
    loss, _, _ = hidden_loss(hidden, frozen, tokens, row_separable_loss(weights))
    (grad_hidden,) = torch.autograd.grad(loss, (hidden,))
    assert frozen.grad is None and torch.isfinite(grad_hidden).all()


def test_tiled_heads_reject_out_of_range_tokens_and_no_grad_leaves_grad_alone():
    hidden, weight, _, tokens = random_case(seed=23)
    padded = tokens.clone()
    padded[0, 0] = -100
    with pytest.raises(ValueError, match=r"hidden_logprobs: token ids must be in \[0, 11\), got min -100"):
        hidden_logprobs(hidden, weight, padded)
    with pytest.raises(ValueError, match=r"hidden_loss: token ids must be in \[0, 11\)"):
        hidden_loss(hidden, weight, padded, lambda lp, rows: lp.sum())
    param = torch.nn.Parameter(weight.clone())
    with torch.no_grad():
        loss, logp, _ = hidden_loss(hidden, param, tokens, lambda lp, rows: lp.sum(), weight_grad_in_place=True)
    assert param.grad is None and not loss.requires_grad
    torch.testing.assert_close(logp, naive_logprobs(hidden @ weight.T, tokens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("vocab_block", [None, 4])
def test_bfloat16_head_matches_the_naive_bfloat16_logits(vocab_block):
    # bf16 weights (the usual GPU dtype): logits come out of the matmul in bf16 and are scored in float32.
    hidden, weight, _, tokens = random_case(seed=24, rows=3)
    hidden, weight = hidden.bfloat16(), weight.bfloat16()
    weights = torch.linspace(-1, 1, tokens.numel()).reshape(tokens.shape)
    leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    loss, logp, _ = hidden_loss(leaves[0], leaves[1], tokens, row_separable_loss(weights), vocab_block=vocab_block)
    grads = torch.autograd.grad(loss, leaves)
    tiled, _ = hidden_logprobs(hidden, weight, tokens, vocab_block=vocab_block)
    naive_leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    expected_logp = naive_logprobs(naive_leaves[0] @ naive_leaves[1].T, tokens)
    expected = torch.autograd.grad(row_separable_loss(weights)(expected_logp, slice(None)), naive_leaves)
    assert logp.dtype == tiled.dtype == torch.float32
    torch.testing.assert_close(logp, expected_logp.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tiled, expected_logp.detach(), atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, expected):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
