"""Tests of grpo.core.loss: KL estimators, clipped surrogate, aggregation, gradients, metrics, and a loop reference."""

import math
import random

import pytest
import torch

from grpo.core import AGGREGATIONS, LossSettings, kl_penalty, policy_loss
from grpo.core.loss import TOKEN_AGGREGATIONS


def one_token(p_new, p_old, advantage, **kwargs):
    """policy_loss of a single completion of a single token with probabilities p_new (pi_theta) and p_old."""
    logp = torch.tensor([[math.log(p_new)]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[math.log(p_old)]], dtype=torch.float64)
    out = policy_loss(logp, old, torch.tensor([advantage], dtype=torch.float64), torch.ones(1, 1, dtype=torch.bool),
                      LossSettings(**kwargs))
    return out, logp


# --------------------------------------------------------------------------------------------------------------
# KL estimators
# --------------------------------------------------------------------------------------------------------------


def test_kl_estimators_hand_values():
    # pi_theta = 0.5, pi_ref = 0.25, so r = pi_ref / pi_theta = 0.5 and log r = -ln 2 = -0.693147.
    #   k1 = -log r = ln 2 = 0.693147
    #   k2 = (log r)^2 / 2 = 0.480453 / 2 = 0.240227
    #   k3 = r - log r - 1 = 0.5 + 0.693147 - 1 = 0.193147  (the seed's pi_ref/pi_theta - log(pi_ref/pi_theta) - 1)
    logp = torch.tensor([math.log(0.5)], dtype=torch.float64)
    ref = torch.tensor([math.log(0.25)], dtype=torch.float64)
    ln2 = math.log(2)
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(ln2)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(ln2**2 / 2)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 + ln2 - 1)
    assert kl_penalty(logp, ref).item() == pytest.approx(0.5 + ln2 - 1)  # k3 is the default


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_is_zero_when_policies_agree(estimator):
    # The seed: when pi_theta = pi_ref, r = 1 and k3 = 1 - log 1 - 1 = 0 (likewise k1 = k2 = 0).
    logp = torch.log(torch.tensor([[0.1, 0.5, 0.9], [0.3, 0.2, 1.0]]))
    assert torch.equal(kl_penalty(logp, logp.clone(), estimator), torch.zeros(2, 3))


def test_k3_is_nonnegative_and_keeps_shape():
    generator = torch.Generator().manual_seed(0)
    logp, ref = -torch.rand(4, 7, generator=generator) * 5, -torch.rand(4, 7, generator=generator) * 5
    kl = kl_penalty(logp, ref, "k3")
    assert kl.shape == (4, 7) and bool((kl >= 0).all())
    with pytest.raises(ValueError, match=r"estimator='k4' is not one of \('k1', 'k2', 'k3'\)"):
        kl_penalty(logp, ref, "k4")


# --------------------------------------------------------------------------------------------------------------
# Clipped surrogate: the seed's numbers
# --------------------------------------------------------------------------------------------------------------


def test_seed_ratio_above_range_with_positive_advantage_contributes_1_2_a():
    # Seed 000, case 1: pi_theta = 0.9, pi_old = 0.5, ratio 1.8, eps = 0.2, A = 0.935 > 0:
    #   min(1.8 * A, clip(1.8, 0.8, 1.2) * A) = min(1.683, 1.122) = 1.2 * A = 1.122; the loss is its negation.
    out, logp = one_token(0.9, 0.5, 0.935, eps_low=0.2)
    assert out.loss.item() == pytest.approx(-1.2 * 0.935)
    out.loss.backward()
    assert logp.grad.item() == 0.0  # the clipped branch is a constant: no gradient
    assert out.metrics["clip_frac_high"].item() == 1.0 and out.metrics["clip_frac_low"].item() == 0.0


def test_seed_ratio_below_range_with_negative_advantage_contributes_0_8_a():
    # Seed 000, case 2: pi_theta = 0.2, pi_old = 0.5, ratio 0.4, A = -0.935 < 0:
    #   min(0.4 * A, 0.8 * A) = min(-0.374, -0.748) = 0.8 * A = -0.748; loss = +0.748.
    out, logp = one_token(0.2, 0.5, -0.935)
    assert out.loss.item() == pytest.approx(-0.8 * -0.935)
    out.loss.backward()
    assert logp.grad.item() == 0.0
    assert out.metrics["clip_frac_low"].item() == 1.0 and out.metrics["clip_frac_high"].item() == 0.0


def test_seed_final_example_ratio_1_4_clips_to_1_2():
    # Seed 000's worked example: pi_old = 0.5 -> pi_theta = 0.7, ratio 1.4, clipped to 1.2 for A = 0.94 > 0.
    out, _ = one_token(0.7, 0.5, 0.94)
    assert out.loss.item() == pytest.approx(-1.2 * 0.94)


def test_asymmetric_clip_higher():
    # ratio 1.25, A = 1. Symmetric eps 0.2 clips at 1.2 -> loss -1.2.
    # DAPO clip-higher eps_high = 0.28: 1.25 < 1.28 is inside the range -> loss -1.25, gradient flows.
    symmetric, _ = one_token(0.625, 0.5, 1.0, eps_low=0.2)
    assert symmetric.loss.item() == pytest.approx(-1.2)
    higher, logp = one_token(0.625, 0.5, 1.0, eps_low=0.2, eps_high=0.28)
    assert higher.loss.item() == pytest.approx(-1.25)
    higher.loss.backward()
    # d(-ratio * A)/d logp = -ratio * A = -1.25 (ratio = exp(logp - old_logp))
    assert logp.grad.item() == pytest.approx(-1.25)
    # eps_low still applies below: ratio 0.75 < 0.8 with A = -1 clips to 0.8 -> loss +0.8
    low, _ = one_token(0.375, 0.5, -1.0, eps_low=0.2, eps_high=0.28)
    assert low.loss.item() == pytest.approx(0.8)


# --------------------------------------------------------------------------------------------------------------
# Gradients
# --------------------------------------------------------------------------------------------------------------


def test_gradient_zero_through_clipped_token_nonzero_through_unclipped():
    # One completion, A = 2, three tokens with ratios 1.8 (clipped), 1.1 (inside) and 0.5 (below the range but
    # A > 0, so the unclipped branch 0.5 * A is the min and stays active: PPO's pessimistic bound).
    # sequence_mean loss = -(1.2 * 2 + 1.1 * 2 + 0.5 * 2) / 3; d/d logp_t = -ratio_t * A / 3 for active tokens:
    #   token 0: 0;  token 1: -1.1 * 2 / 3 = -0.733333;  token 2: -0.5 * 2 / 3 = -0.333333.
    ratios = torch.tensor([[1.8, 1.1, 0.5]], dtype=torch.float64)
    old = torch.log(torch.tensor([[0.3, 0.4, 0.6]], dtype=torch.float64))
    logp = (old + torch.log(ratios)).requires_grad_()
    out = policy_loss(logp, old, torch.tensor([2.0], dtype=torch.float64), torch.ones(1, 3, dtype=torch.bool))
    assert out.loss.item() == pytest.approx(-(1.2 + 1.1 + 0.5) * 2 / 3)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -2.2 / 3, -1.0 / 3]], dtype=torch.float64))
    # With A < 0 the roles swap: ratio 1.8 is not clipped (min(1.8A, 1.2A) = 1.8A), ratio 0.5 is.
    logp.grad = None
    out = policy_loss(logp, old, torch.tensor([-2.0], dtype=torch.float64), torch.ones(1, 3, dtype=torch.bool))
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[3.6 / 3, 2.2 / 3, 0.0]], dtype=torch.float64))


@pytest.mark.parametrize("advantage", [1.0, -1.0])
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_gradient_step_moves_logprob_with_the_sign_of_the_advantage(advantage, ratio_level):
    # A plain gradient-descent step on the loss must raise log-probs of a completion with A > 0 and lower them
    # for A < 0 (on-policy, ratio 1, so nothing is clipped).
    logp = torch.log(torch.tensor([[0.3, 0.5, 0.2]])).requires_grad_()
    start = logp.detach().clone()
    out = policy_loss(logp, start, torch.tensor([advantage]), torch.ones(1, 3, dtype=torch.bool),
                      LossSettings(ratio_level=ratio_level))
    out.loss.backward()
    with torch.no_grad():
        logp -= 0.1 * logp.grad
    moved = logp.detach() - start
    assert bool((moved * advantage > 0).all()), moved


def test_sequence_ratio_is_geometric_mean_and_gradient_reaches_every_token():
    # GSPO: token log-ratios [ln 2, 0] -> s = exp((ln 2 + 0) / 2) = sqrt(2) = 1.414214 on both tokens.
    # A = -1: min(s * A, clip(s, 0.8, 1.2) * A) = min(-1.414, -1.2) = -1.414 (not clipped); loss = +1.414214.
    # d loss / d logp_t = d s / d logp_t = s / 2 = 0.707107 for both tokens, including the one with log-ratio 0.
    old = torch.log(torch.tensor([[0.25, 0.5]], dtype=torch.float64))
    logp = (old + torch.tensor([[math.log(2), 0.0]], dtype=torch.float64)).requires_grad_()
    mask = torch.ones(1, 2, dtype=torch.bool)
    sequence = LossSettings(ratio_level="sequence")
    out = policy_loss(logp, old, torch.tensor([-1.0], dtype=torch.float64), mask, sequence)
    assert out.loss.item() == pytest.approx(math.sqrt(2))
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.full((1, 2), math.sqrt(2) / 2, dtype=torch.float64))
    # A = +1: clipped at 1.2 -> loss -1.2 and no gradient anywhere.
    logp.grad = None
    out = policy_loss(logp, old, torch.tensor([1.0], dtype=torch.float64), mask, sequence)
    assert out.loss.item() == pytest.approx(-1.2)
    out.loss.backward()
    assert torch.equal(logp.grad, torch.zeros(1, 2, dtype=torch.float64))


def test_kl_term_is_added_per_token_with_beta():
    # On-policy (ratio 1) with A = 0: the surrogate is 0 and the loss is beta * k3.
    # pi_theta = 0.5, pi_ref = 0.25: k3 = 0.193147 (see test_kl_estimators_hand_values); beta = 0.04.
    # Its gradient: d/d logp [exp(ref - logp) - (ref - logp) - 1] = -r + 1 = 1 - 0.5 = 0.5, times beta = 0.02.
    logp = torch.tensor([[math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[math.log(0.25)]], dtype=torch.float64)
    out = policy_loss(logp, logp.detach(), torch.zeros(1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.bool),
                      LossSettings(beta=0.04), ref_logp=ref)
    assert out.loss.item() == pytest.approx(0.04 * (0.5 + math.log(2) - 1))
    assert out.metrics["kl"].item() == pytest.approx(0.5 + math.log(2) - 1)
    out.loss.backward()
    assert logp.grad.item() == pytest.approx(0.02)


# --------------------------------------------------------------------------------------------------------------
# Aggregation and normalizer
# --------------------------------------------------------------------------------------------------------------


def aggregation_batch():
    # Two completions, on-policy (ratio 1), per-token advantages; per-token loss is l = -A.
    #   row 0: one valid token, A = 3          -> token losses [-3]
    #   row 1: three valid tokens, A = 1, 2, 3 -> token losses [-1, -2, -3]
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.2, 0.3, 0.4]], dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([[3.0, 7.0, 7.0], [1.0, 2.0, 3.0]], dtype=torch.float64)  # the 7s are masked out
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    return logp, logp.detach().clone(), adv, mask


@pytest.mark.parametrize(
    "aggregation, kwargs, expected",
    [
        # paper: 1/G sum_i 1/|o_i| sum_t l = (-3/1 + -6/3) / 2 = -2.5
        ("sequence_mean", {}, -2.5),
        # DAPO: sum of all token losses / number of tokens = -9 / 4 = -2.25
        ("token_mean", {}, -2.25),
        # Dr. GRPO: sum / (number of sequences * max_length) = -9 / (2 * 4) = -1.125
        ("constant", {"max_length": 4}, -1.125),
        # normalizer replaces the micro-batch's own count:
        ("sequence_mean", {"normalizer": 5}, -1.0),  # (-3 - 2) / 5
        ("token_mean", {"normalizer": 10}, -0.9),  # -9 / 10
        ("constant", {"max_length": 4, "normalizer": 5}, -0.45),  # -9 / (5 * 4)
    ],
)
def test_aggregation_hand_values(aggregation, kwargs, expected):
    logp, old, adv, mask = aggregation_batch()
    settings = LossSettings(aggregation=aggregation, max_length=kwargs.get("max_length"))
    out = policy_loss(logp, old, adv, mask, settings, normalizer=kwargs.get("normalizer"))
    assert out.loss.item() == pytest.approx(expected)
    # Metrics are plain token means over this micro-batch whatever the aggregation: -9 / 4.
    assert out.metrics["policy_loss"].item() == pytest.approx(-2.25)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_micro_batches_with_normalizer_sum_to_the_full_batch(aggregation):
    # Splitting a batch into micro-batches and passing the whole step's count as normalizer must give the same
    # loss and the same gradient as one big batch (gradient accumulation is exact).
    generator = torch.Generator().manual_seed(1)
    old = -torch.rand(6, 5, generator=generator, dtype=torch.float64) * 3
    logp = (old + 0.3 * torch.randn(6, 5, generator=generator, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(6, generator=generator, dtype=torch.float64)
    mask = torch.arange(5)[None, :] < torch.tensor([5, 1, 3, 0, 4, 2])[:, None]
    settings = LossSettings(aggregation=aggregation, max_length=5, eps_high=0.28)
    full = policy_loss(logp, old, adv, mask, settings).loss
    (full_grad,) = torch.autograd.grad(full, logp)
    normalizer = int(mask.sum()) if aggregation in TOKEN_AGGREGATIONS else 6
    parts = [policy_loss(logp[rows], old[rows], adv[rows], mask[rows], settings, normalizer=normalizer).loss
             for rows in (slice(0, 2), slice(2, 6))]
    (parts_grad,) = torch.autograd.grad(sum(parts), logp)
    assert sum(parts).item() == pytest.approx(full.item())
    torch.testing.assert_close(parts_grad, full_grad)


# --------------------------------------------------------------------------------------------------------------
# Masking and metrics
# --------------------------------------------------------------------------------------------------------------


def test_garbage_in_masked_positions_cannot_leak():
    # Padding may hold -inf or NaN (e.g. log-probs of pad tokens). They are replaced before exp(), so the loss,
    # the metrics and the gradient stay finite, and masked positions get exactly zero gradient.
    logp = torch.tensor([[-1.0, -float("inf")], [-0.5, float("nan")]], requires_grad=True)
    old = torch.tensor([[-1.2, float("nan")], [-0.4, -float("inf")]])
    ref = torch.tensor([[-0.9, 50.0], [-0.6, float("nan")]])
    mask = torch.tensor([[1, 0], [1, 0]], dtype=torch.bool)
    for aggregation in AGGREGATIONS:
        logp.grad = None
        out = policy_loss(logp, old, torch.tensor([1.0, -1.0]), mask,
                          LossSettings(beta=0.1, aggregation=aggregation, max_length=2), ref_logp=ref,
                          entropy=torch.full((2, 2), float("nan")))
        out.loss.backward()
        assert torch.isfinite(out.loss) and torch.isfinite(logp.grad).all()
        assert torch.equal(logp.grad[:, 1], torch.zeros(2))
        assert all(bool(torch.isfinite(value)) for name, value in out.metrics.items() if name != "entropy")


def test_metrics_hand_values():
    # Four tokens in two completions, eps = 0.2:
    #   (ratio 1.8, A = +1) clipped high; (ratio 0.4, A = +1) not clipped (A > 0: the min keeps 0.4 * A);
    #   (ratio 0.4, A = -1) clipped low;  (ratio 1.0, A = -1) not clipped.
    # clip_frac_high = 1/4, clip_frac_low = 1/4, clip_frac = 2/4.
    # ratio_mean = (1.8 + 0.4 + 0.4 + 1.0) / 4 = 0.9.  advantage_mean = 0, advantage_std = 1 (population).
    # policy_loss (token mean of the surrogate) = -(1.2 + 0.4 - 0.8 - 1.0) / 4 = 0.05.
    # entropy = mean(0.5, 1.5, 2.5, 3.5) = 2.0.
    old = torch.log(torch.full((2, 2), 0.25))
    logp = old + torch.log(torch.tensor([[1.8, 0.4], [0.4, 1.0]]))
    entropy = torch.tensor([[0.5, 1.5], [2.5, 3.5]])
    out = policy_loss(logp, old, torch.tensor([1.0, -1.0]), torch.ones(2, 2, dtype=torch.bool), entropy=entropy)
    expected = {"clip_frac_high": 0.25, "clip_frac_low": 0.25, "clip_frac": 0.5, "ratio_mean": 0.9,
                "advantage_mean": 0.0, "advantage_std": 1.0, "policy_loss": 0.05, "entropy": 2.0}
    assert {name: round(value.item(), 5) for name, value in out.metrics.items()} == pytest.approx(expected)
    assert "kl" not in out.metrics  # no reference log-probs given
    assert not any(value.requires_grad for value in out.metrics.values())


def test_empty_mask_gives_zero_loss_and_metrics():
    logp = torch.zeros(2, 3, requires_grad=True)
    out = policy_loss(logp, logp.detach(), torch.ones(2), torch.zeros(2, 3, dtype=torch.bool),
                      LossSettings(aggregation="token_mean"))
    assert out.loss.item() == 0.0 and out.metrics["ratio_mean"].item() == 0.0
    out.loss.backward()
    assert torch.equal(logp.grad, torch.zeros(2, 3))


def test_bad_arguments_raise_clear_errors():
    logp, old, adv, mask = aggregation_batch()
    with pytest.raises(ValueError, match="beta=0.04 needs ref_logp"):
        policy_loss(logp, old, adv, mask, LossSettings(beta=0.04))
    with pytest.raises(ValueError, match=r"LossSettings: aggregation='seq' is not one of"):
        LossSettings(aggregation="seq")
    with pytest.raises(ValueError, match="needs max_length > 0"):
        LossSettings(aggregation="constant")
    with pytest.raises(ValueError, match=r"ratio_level='tok' is not one of"):
        LossSettings(ratio_level="tok")
    with pytest.raises(ValueError, match=r"kl_estimator='k4' is not one of"):
        LossSettings(kl_estimator="k4")
    with pytest.raises(ValueError, match="need eps_low >= 0 and eps_high >= 0, got 0.2 and -0.1"):
        LossSettings(eps_high=-0.1)
    with pytest.raises(ValueError, match=r"advantages must be \(B\*G,\) or \(B\*G, T\)"):
        policy_loss(logp, old, adv[:, :2], mask)
    with pytest.raises(ValueError, match="mask has shape"):
        policy_loss(logp, old, adv, mask[:, :2])
    with pytest.raises(ValueError, match="normalizer must be > 0"):
        policy_loss(logp, old, adv, mask, normalizer=0)


# --------------------------------------------------------------------------------------------------------------
# Vectorized vs an obviously-correct loop (values, metrics and gradients)
# --------------------------------------------------------------------------------------------------------------


def slow_policy_loss(logp, old, adv, mask, ref, beta, estimator, eps_low, eps_high, ratio_level, aggregation,
                     max_length):
    """Token by token with scalar tensor ops (so autograd still gives the gradient), no vectorization."""
    rows, length = mask.shape
    zero = logp.sum() * 0  # start value for sums, so an all-masked batch still gives a (zero) gradient
    sequence_terms, token_terms, surrogates, ratios, advs, kls = [], [], [], [], [], []
    for i in range(rows):
        valid = [t for t in range(length) if mask[i, t]]
        seq_ratio = torch.exp(sum((logp[i, t] - old[i, t] for t in valid), zero) / max(len(valid), 1))
        row_terms = []
        for t in valid:
            ratio = seq_ratio if ratio_level == "sequence" else torch.exp(logp[i, t] - old[i, t])
            a = adv[i] if adv.dim() == 1 else adv[i, t]
            surrogate = -min(ratio * a, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a)
            term = surrogate
            if ref is not None:
                log_r = ref[i, t] - logp[i, t]
                kl = {"k1": -log_r, "k2": log_r**2 / 2, "k3": torch.exp(log_r) - log_r - 1}[estimator]
                term = term + beta * kl
                kls.append(kl.item())
            row_terms.append(term)
            surrogates.append(surrogate.item())
            ratios.append((ratio.item(), a.item()))
            advs.append(a.item())
        token_terms += row_terms
        sequence_terms.append(sum(row_terms, zero) / max(len(valid), 1))
    if aggregation == "sequence_mean":
        loss = sum(sequence_terms, zero) / rows
    elif aggregation in TOKEN_AGGREGATIONS:  # (one micro-batch: the micro-batch's and the rollout's tokens too)
        loss = sum(token_terms, zero) / max(len(token_terms), 1)
    elif aggregation == "sequence_sum":
        loss = sum(token_terms, zero) / rows
    else:
        loss = sum(token_terms, zero) / (rows * max_length)
    count = max(len(surrogates), 1)
    adv_mean = sum(advs) / count
    metrics = {
        "policy_loss": sum(surrogates) / count,
        "clip_frac_low": sum(a < 0 and r < 1 - eps_low for r, a in ratios) / count,
        "clip_frac_high": sum(a > 0 and r > 1 + eps_high for r, a in ratios) / count,
        "ratio_mean": sum(r for r, _ in ratios) / count,
        "advantage_mean": adv_mean,
        "advantage_std": math.sqrt(sum((a - adv_mean) ** 2 for a in advs) / count),
    }
    metrics["clip_frac"] = metrics["clip_frac_low"] + metrics["clip_frac_high"]
    if ref is not None:
        metrics["kl"] = sum(kls) / count
    return loss, metrics


@pytest.mark.parametrize("seed", range(4))
def test_policy_loss_matches_loop(seed):
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    rows, length = rng.randint(1, 5), rng.randint(1, 6)
    old = -torch.rand(rows, length, generator=generator, dtype=torch.float64) * 3
    logp0 = old + 0.4 * torch.randn(rows, length, generator=generator, dtype=torch.float64)  # ratios around 1 +- 0.5
    ref = old + 0.3 * torch.randn(rows, length, generator=generator, dtype=torch.float64)
    lengths = torch.tensor([rng.randint(0, length) for _ in range(rows)])
    mask = torch.arange(length)[None, :] < lengths[:, None]  # ragged, possibly empty rows
    per_token = rng.random() < 0.5
    adv = torch.randn((rows, length) if per_token else (rows,), generator=generator, dtype=torch.float64)
    for aggregation in AGGREGATIONS:
        for ratio_level in ("token", "sequence"):
            for estimator, use_ref in (("k1", True), ("k2", True), ("k3", True), ("k3", False)):
                settings = {"beta": 0.05 if use_ref else 0.0, "eps_low": 0.2, "eps_high": 0.28,
                            "ratio_level": ratio_level, "aggregation": aggregation, "max_length": length}
                logp = logp0.clone().requires_grad_()
                out = policy_loss(logp, old, adv, mask, LossSettings(kl_estimator=estimator, **settings),
                                  ref_logp=ref if use_ref else None)
                (grad,) = torch.autograd.grad(out.loss, logp)
                logp_ref = logp0.clone().requires_grad_()
                loss, metrics = slow_policy_loss(logp_ref, old, adv, mask, ref if use_ref else None,
                                                 estimator=estimator, **settings)
                (expected_grad,) = torch.autograd.grad(loss, logp_ref)
                assert out.loss.item() == pytest.approx(loss.item(), abs=1e-12)
                torch.testing.assert_close(grad, expected_grad)
                assert {k: v.item() for k, v in out.metrics.items()} == pytest.approx(metrics, abs=1e-12)
