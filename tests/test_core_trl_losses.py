"""The loss terms TRL 1.16 has beyond the paper, in grpo.core: numbers derived by hand, then TRL's own code.

Each term first gets a small example worked out in the comments; then `policy_loss` (with `aggregation_normalizer`,
the masks and the entropy bonus, as the trainer combines them) is compared with TRL's `_compute_loss` on the same
random per-token tensors for every loss_type and option (tests/trl_reference.py): loss, gradients and metrics.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo.config import LOSS_TYPES
from grpo.core import (LossSettings, adaptive_entropy_coef, aggregation_normalizer, applied_entropy_coef,
                       cispo_surrogate, clip_surrogate, decoupled_advantages, entropy_bonus, entropy_threshold,
                       high_entropy_mask, off_policy_mask, policy_loss, sapo_surrogate, sync_reference_, vespo_weights)


def t(*values):
    return torch.tensor(values, dtype=torch.float64)


# ---- by hand ------------------------------------------------------------------------------------------------------
def test_two_sided_clip_caps_the_ratio_at_delta():
    # rho = 2, eps = 0.2: A = +1 takes the clipped 1.2 either way: -min(2, 1.2) = -1.2 (delta changes nothing).
    # A = -1: without delta -min(-2, -1.2) = 2; with delta 1.5 the unclipped branch is -1.5: -min(-1.5, -1.2) = 1.5.
    ratio = t(2.0, 2.0)[:, None]
    adv = t(1.0, -1.0)[:, None]
    assert clip_surrogate(ratio, adv, 0.2, 0.2).flatten().tolist() == pytest.approx([-1.2, 2.0])
    assert clip_surrogate(ratio, adv, 0.2, 0.2, delta=1.5).flatten().tolist() == pytest.approx([-1.2, 1.5])


def test_cispo_weighs_the_log_prob_by_the_capped_detached_ratio():
    # rho = 3 capped at eps_high = 2; A = 0.5, log pi = -1: l = -2 * 0.5 * (-1) = 1.0, and dl/dlogp = -w A = -1.0
    # (the weight is detached, so the ratio's own dependence on log pi adds nothing).
    logp = t(-1.0).requires_grad_()
    ratio = torch.exp(logp - t(-1.0 - math.log(3)))  # = 3
    loss = cispo_surrogate(ratio, t(0.5), logp, eps_high=2.0)
    loss.backward()
    assert loss.item() == pytest.approx(1.0) and logp.grad.item() == pytest.approx(-1.0)


def test_sapo_gate_is_the_policy_gradient_at_ratio_one():
    # rho = 1, A = 2, tau_pos = 1: l = -(4/1) sigmoid(0) * 2 = -4; dl/drho = -(4/tau) sigmoid'(0) tau A = -4 * 0.25 * 2
    # = -2 = -A, and drho/dlogp = rho = 1. A = -1 with tau_neg = 1.05: l = -(4/1.05) * 0.5 * (-1) = 1.9047619.
    logp = t(-0.7, -0.7).requires_grad_()
    ratio = torch.exp(logp - t(-0.7, -0.7))
    loss = sapo_surrogate(ratio, t(2.0, -1.0), tau_pos=1.0, tau_neg=1.05)
    assert loss.tolist() == pytest.approx([-4.0, 1.9047619047619])
    loss[0].backward()
    assert logp.grad.tolist() == pytest.approx([-2.0, 0.0])


def test_vespo_gamma_weight():
    # One row, log-ratios 0.2 and 0.3: log w = 0.5; A >= 0 so k = 2, lambda = 3:
    # phi = exp(3 + 2 * 0.5 - 3 * e^0.5) = exp(4 - 4.9461638) = exp(-0.9461638) = 0.3882. At w = 1: phi = 1.
    # A negative row takes k = 3, lambda = 2: log w = -0.1, phi = exp(2 - 0.3 - 2 e^-0.1) = exp(1.7 - 1.8096748)
    # = exp(-0.1096748) = 0.8961255.
    log_ratio = t(0.2, 0.3, 0.0, 0.0, -0.1, 0.0).reshape(3, 2)
    mask = torch.tensor([[True, True], [True, True], [True, False]])
    adv = t(1.0, 1.0, 2.0, 2.0, -1.0, -1.0).reshape(3, 2)
    phi = vespo_weights(adv, log_ratio, mask)
    assert phi.flatten().tolist() == pytest.approx([math.exp(-0.9461638), 1.0, 0.8961255], rel=1e-6)


def test_ratio_corrected_kl_value_and_gradient():
    # logp = -1, ref = -1.5, old = -1.2: log r = ref - logp = -0.5, k3 = e^-0.5 + 0.5 - 1 = 0.1065307;
    # rho = e^0.2 = 1.2214028, so the corrected term is 0.1065307 * 1.2214028 = 0.1301168.
    # Its gradient: dk3/dlogp * rho + k3 * rho
    # = (1 - e^-0.5 + e^-0.5 + 0.5 - 1) * rho = 0.5 * rho = 0.6107014. With beta = 1 and A = 0 it is the loss.
    logp = t(-1.0)[None, :].requires_grad_()
    out = policy_loss(logp, t(-1.2)[None, :], t(0.0), torch.ones(1, 1, dtype=torch.bool),
                      LossSettings(beta=1.0, kl_ratio_correction=True), ref_logp=t(-1.5)[None, :])
    out.loss.backward()
    assert out.loss.item() == pytest.approx(0.1301168, rel=1e-6)
    assert out.metrics["kl"].item() == pytest.approx(0.1301168, rel=1e-6)
    assert logp.grad.item() == pytest.approx(0.6107014, rel=1e-6)


def test_off_policy_mask_drops_negative_far_sequences():
    # KL per token = log pi_sampling - log pi: row 0 (A < 0) [0.8, 0.6] -> mean 0.7 > 0.5: dropped; row 1 (A < 0)
    # [0.2, 0.4] -> 0.3: kept; row 2 (A > 0) [0.9, 0.9]: kept whatever its KL.
    logp = torch.full((3, 2), -1.0, dtype=torch.float64)
    sampling = t(-0.2, -0.4, -0.8, -0.6, -0.1, -0.1).reshape(3, 2)
    keep = off_policy_mask(t(-1.0, -1.0, 1.0), logp, sampling, torch.ones(3, 2, dtype=torch.bool), threshold=0.5)
    assert keep.flatten().tolist() == [0.0, 1.0, 1.0]


def test_high_entropy_mask_keeps_the_top_quantile():
    # Entropies 0.1, 0.5, 0.9, 0.3 (and a padded 5.0): the 0.5 quantile of the four is 0.4 (linear between 0.3 and
    # 0.5), so the tokens at 0.5 and 0.9 stay; the padding never does.
    entropy = t(0.1, 0.5, 0.9, 0.3, 5.0).reshape(1, 5)
    mask = torch.tensor([[True, True, True, True, False]])
    threshold = entropy_threshold(entropy[mask], 0.5)
    assert threshold.item() == pytest.approx(0.4)
    assert high_entropy_mask(entropy, mask, threshold).tolist() == [[False, True, True, False, False]]


def test_entropy_bonus_and_adaptive_coefficient():
    # Entropies 1, 2, 3 on the mask: mean 2, bonus -0.1 * 2 = -0.2; with a normalizer of 6 (two micro-batches of 3
    # tokens), -0.1 * 6 / 6 = -0.1.
    entropy, mask = t(1.0, 2.0, 3.0, 9.0).reshape(2, 2), torch.tensor([[True, True], [True, False]])
    assert entropy_bonus(entropy, mask, 0.1).item() == pytest.approx(-0.2)
    assert entropy_bonus(entropy, mask, 0.1, normalizer=6).item() == pytest.approx(-0.1)
    # Adaptive: at or below the target the coefficient rises by delta (to at most the max), above it falls.
    assert adaptive_entropy_coef(0.01, entropy=0.1, target=0.2, delta=0.005, low=0.0, high=1.0) == pytest.approx(0.015)
    assert adaptive_entropy_coef(0.01, entropy=0.3, target=0.2, delta=0.005, low=0.0, high=1.0) == pytest.approx(0.005)
    assert adaptive_entropy_coef(0.002, entropy=0.3, target=0.2, delta=0.005, low=0.0, high=1.0) == 0.0
    assert applied_entropy_coef(0.3, last_entropy=math.inf, target=0.2, adaptive=True) == 0.0
    assert applied_entropy_coef(0.3, last_entropy=0.1, target=0.2, adaptive=True) == 0.3
    assert applied_entropy_coef(0.3, last_entropy=math.inf, target=0.2, adaptive=False) == 0.3


def test_aggregation_normalizers():
    # An optimizer step of 8 sequences and 40 tokens on 2 processes, each taking 2 micro-batches; this micro-batch has
    # 9 tokens; the rollout (120 tokens) feeds 3 optimizer steps per pass.
    counts = dict(step_tokens=40, step_rows=8, micro_tokens=9, micro_batches=2, processes=2, rollout_tokens=120,
                  steps_per_rollout=3)
    assert aggregation_normalizer("token_mean", **counts) == 40
    assert aggregation_normalizer("sequence_mean", **counts) == 8
    assert aggregation_normalizer("constant", **counts) == 8  # (policy_loss multiplies by max_length)
    assert aggregation_normalizer("sequence_sum", **counts) == 8
    assert aggregation_normalizer("micro_batch_token_mean", **counts) == 9 * 2 * 2
    assert aggregation_normalizer("rollout_token_mean", **counts) == 40


def test_sync_reference_mixes_in_place():
    # alpha = 0.6: ref 0 -> 0.6 * 1 + 0.4 * 0 = 0.6, then 0.6 + 0.4 * 0.6 = 0.84.
    ref, policy = {"w": torch.zeros(2)}, {"w": torch.ones(2)}
    sync_reference_(ref, policy, 0.6)
    sync_reference_(ref, policy, 0.6)
    assert ref["w"].tolist() == pytest.approx([0.84, 0.84])
    # A tied weight listed twice (embedding and LM head) is mixed once: 0.6, not 0.84.
    tied = torch.zeros(2)
    sync_reference_({"embed": tied, "head": tied}, {"embed": torch.ones(2), "head": torch.ones(2)}, 0.6)
    assert tied.tolist() == pytest.approx([0.6, 0.6])


def test_decoupled_advantages_by_hand():
    # Two groups of 2, two functions, weights (1, 0.5), eps 0, Bessel std. Group 0: r1 = [1, 0] -> +-0.70711 (std
    # 0.70711), r2 = [0, 0] -> 0. Group 1: r1 = [1, 1] -> 0, r2 = [2, 0] -> +-0.70711, times 0.5. Sums
    # [0.70711, -0.70711, 0.35355, -0.35355]: mean 0, std sqrt((0.5 + 0.5 + 0.125 + 0.125) / 3) = 0.645497, so
    # A = [1.095445, -1.095445, 0.547723, -0.547723].
    rewards = t(1, 0, 0, 0, 1, 2, 1, 0).reshape(2, 2, 2)  # (B, G, K)
    adv = decoupled_advantages(rewards, t(1.0, 0.5), eps=0.0)
    assert adv.flatten().tolist() == pytest.approx([1.095445, -1.095445, 0.547723, -0.547723], rel=1e-5)
    # A third group: a completion every function skipped (NaN, NaN) is left out of the batch statistics and gets 0;
    # its partner (0, 0) has no group signal (one usable reward per function) and sums to 0, which does count: the
    # sums [0.70711, -0.70711, 0.35355, -0.35355, 0] have mean 0 and std sqrt(1.25 / 4) = 0.559017.
    rewards = torch.cat([rewards, t(float("nan"), float("nan"), 0, 0).reshape(1, 2, 2)])
    adv = decoupled_advantages(rewards, t(1.0, 0.5), eps=0.0)
    assert adv[2].tolist() == [0.0, 0.0]
    assert adv[:2].flatten().tolist() == pytest.approx([1.2649111, -1.2649111, 0.6324555, -0.6324555], rel=1e-5)


# ---- against TRL's _compute_loss ----------------------------------------------------------------------------------
def _inputs(seed, rows=6, width=5):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 2 - 0.1
    logp = old + 0.3 * torch.randn(rows, width, generator=g, dtype=torch.float64)
    ref = old + 0.2 * torch.randn(rows, width, generator=g, dtype=torch.float64)
    sampling = old + 0.4 * torch.randn(rows, width, generator=g, dtype=torch.float64)
    entropy = torch.rand(rows, width, generator=g, dtype=torch.float64) * 2
    adv = torch.randn(rows, generator=g, dtype=torch.float64)
    lengths = torch.tensor([5, 2, 4, 5, 1, 3])[:rows]
    mask = torch.arange(width)[None, :] < lengths[:, None]
    return logp, entropy, old, ref, sampling, adv, mask


def ours(logp, entropy, old, ref, adv, mask, *, loss_type, beta=0.0, epsilon=0.2, epsilon_high=None, delta=None,
         importance_sampling_level="token", use_bias_correction_kl=True, top_entropy_quantile=1.0,
         off_policy_mask_threshold=None, sampling_logp=None, entropy_coef=0.0, use_adaptive_entropy=False,
         last_world_entropy=math.inf, entropy_target=0.2, gradient_accumulation_steps=1, steps_per_generation=1,
         num_items_in_batch=None, max_completion_length=None):
    """The trainer's combination for one micro-batch of an optimizer step of `gradient_accumulation_steps` equal
    micro-batches on one process."""
    aggregation, surrogate = LOSS_TYPES[loss_type]
    tokens = float(mask.sum())
    normalizer = aggregation_normalizer(
        aggregation, step_tokens=tokens * gradient_accumulation_steps,
        step_rows=mask.shape[0] * gradient_accumulation_steps,
        micro_tokens=tokens, micro_batches=gradient_accumulation_steps, processes=1,
        rollout_tokens=num_items_in_batch if num_items_in_batch is not None else tokens,
        steps_per_rollout=steps_per_generation // gradient_accumulation_steps)
    token_mask = None
    if top_entropy_quantile < 1:
        threshold = entropy_threshold(entropy.detach()[mask], 1 - top_entropy_quantile)
        token_mask = high_entropy_mask(entropy.detach(), mask, threshold)
    sequence_mask = None
    if off_policy_mask_threshold is not None:
        sequence_mask = off_policy_mask(adv, logp, sampling_logp if sampling_logp is not None else old, mask,
                                        off_policy_mask_threshold)
    settings = LossSettings(beta=beta, eps_low=epsilon, eps_high=epsilon if epsilon_high is None else epsilon_high,
                            ratio_level=importance_sampling_level, aggregation=aggregation,
                            max_length=max_completion_length or logp.shape[1], surrogate=surrogate, delta=delta,
                            kl_ratio_correction=use_bias_correction_kl)
    out = policy_loss(logp, old, adv, mask, settings, ref_logp=ref, normalizer=normalizer,
                      sequence_mask=sequence_mask, token_mask=token_mask)
    loss = out.loss
    if entropy_coef != 0 or use_adaptive_entropy:
        effective = mask if token_mask is None else mask & token_mask
        coef = applied_entropy_coef(entropy_coef, last_world_entropy, entropy_target, use_adaptive_entropy)
        loss = loss + entropy_bonus(entropy, effective, coef, float(effective.sum()) * gradient_accumulation_steps)
    return loss, out.metrics


CASES = [
    *[dict(loss_type=lt) for lt in LOSS_TYPES],
    *[dict(loss_type=lt, beta=0.1) for lt in ("grpo", "dapo", "cispo")],
    dict(loss_type="grpo", beta=0.1, use_bias_correction_kl=False),
    dict(loss_type="dapo", beta=0.04, importance_sampling_level="sequence"),
    dict(loss_type="luspo", importance_sampling_level="sequence"),
    dict(loss_type="dapo", delta=1.1),
    dict(loss_type="cispo", epsilon_high=1.2),
    dict(loss_type="dapo", epsilon_high=0.28, off_policy_mask_threshold=0.05),
    dict(loss_type="grpo", top_entropy_quantile=0.3),
    dict(loss_type="dapo", entropy_coef=0.05),
    dict(loss_type="bnpo", top_entropy_quantile=0.5, entropy_coef=0.1, gradient_accumulation_steps=2),
    dict(loss_type="grpo", gradient_accumulation_steps=3, beta=0.1),
    dict(loss_type="dr_grpo", gradient_accumulation_steps=2, max_completion_length=8),
    dict(loss_type="dapo", steps_per_generation=2, num_items_in_batch=41),
    dict(loss_type="vespo", steps_per_generation=4, gradient_accumulation_steps=2, num_items_in_batch=70),
    dict(loss_type="dapo", use_adaptive_entropy=True, entropy_coef=0.02, last_world_entropy=0.1, entropy_target=0.2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("seed", [0, 1])
def test_loss_and_gradients_equal_trls(case, seed):
    pytest.importorskip("trl")
    from trl_reference import trl_loss

    logp, entropy, old, ref, sampling, adv, mask = _inputs(seed)
    extra = {"sampling_logp": sampling} if case.get("off_policy_mask_threshold") else {}
    want_logp, want_entropy = logp.clone().requires_grad_(), entropy.clone().requires_grad_()
    want, metrics = trl_loss(want_logp, want_entropy, old, ref, adv, mask, **case, **extra)
    (want_grads) = torch.autograd.grad(want, [want_logp, want_entropy], allow_unused=True)
    got_logp, got_entropy = logp.clone().requires_grad_(), entropy.clone().requires_grad_()
    got, got_metrics = ours(got_logp, got_entropy, old, ref if case.get("beta") else None, adv, mask, **case, **extra)
    got_grads = torch.autograd.grad(got, [got_logp, got_entropy], allow_unused=True)
    rel = 1e-6 if case["loss_type"] == "sapo" else 1e-9  # (TRL builds sapo's temperatures in float32)
    assert got.item() == pytest.approx(want.item(), rel=rel, abs=1e-12)
    for mine, theirs in zip(got_grads, want_grads):
        if theirs is None:
            assert mine is None or mine.abs().max() == 0
        else:
            torch.testing.assert_close(mine, theirs, rtol=rel, atol=1e-10)
    names = {"kl": "kl", "clip_ratio/low_mean": "clip_frac_low", "clip_ratio/high_mean": "clip_frac_high",
             "clip_ratio/region_mean": "clip_frac", "cispo_clip_ratio": "cispo_clip_frac",
             "vespo/phi_seq_mean": "vespo_phi_mean"}
    for theirs, mine in names.items():
        if theirs in metrics:
            # (TRL takes its metrics in float32)
            assert got_metrics[mine].item() == pytest.approx(metrics[theirs], rel=1e-6, abs=1e-7), theirs
    if case.get("use_adaptive_entropy"):
        effective_entropy = float((entropy * mask).sum() / mask.sum())
        assert adaptive_entropy_coef(case["entropy_coef"], effective_entropy, case["entropy_target"], 0.005, 0.0,
                                     1.0) == pytest.approx(metrics["entropy_coef_after"])


def test_masks_and_gamma_weights_equal_trls_static_methods():
    trl = pytest.importorskip("trl")
    logp, entropy, old, ref, sampling, adv, mask = _inputs(3)
    want = trl.GRPOTrainer.get_off_policy_mask(adv[:, None], logp, sampling, mask.double(), 0.1)
    assert torch.equal(off_policy_mask(adv, logp, sampling, mask, 0.1), want)
    want = trl.GRPOTrainer.get_gamma_weights(adv[:, None], logp - old, mask.double(), None)
    torch.testing.assert_close(vespo_weights(adv[:, None].expand_as(logp), logp - old, mask), want)
