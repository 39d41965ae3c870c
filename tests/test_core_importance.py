"""engine_importance_weights (TRL 1.16's vllm_importance_sampling_* modes) and policy_loss's sampling_weights,
against numbers derived by hand."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.core import LossSettings, engine_importance_weights, policy_loss

LN = math.log


def example():
    """Two rows; row 1's last token is padding (garbage values, masked out).
    Per-token ratios r = pi_old / pi_engine: row 0 [2, 1, 0.5] (product 1), row 1 [4, 1.5] (product 6)."""
    engine = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -float("inf")]])
    diff = torch.tensor([[LN(2), 0.0, LN(0.5)], [LN(4), LN(1.5), 0.0]])
    trainer = engine + diff
    trainer[1, 2] = 100.0
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return trainer, engine, mask


@pytest.mark.parametrize("mode, clip_min, clip_max, expected, bounded", [
    # token_truncate: clip each r to [c_min, c_max]: 4 -> 3
    ("token_truncate", None, 3.0, [[2, 1, 0.5], [3, 1.5, 0]], 1 / 5),
    ("token_truncate", 0.8, 3.0, [[2, 1, 0.8], [3, 1.5, 0]], 2 / 5),  # and 0.5 -> 0.8
    # token_mask: an r outside [c_min, c_max] weighs 0
    ("token_mask", None, 3.0, [[2, 1, 0.5], [0, 1.5, 0]], 1 / 5),
    ("token_mask", 0.8, None, [[2, 1, 0], [4, 1.5, 0]], 1 / 5),
    # sequence modes: R = product of the row's r = [1, 6], one weight for the whole row
    ("sequence_mask", None, 3.0, [[1, 1, 1], [0, 0, 0]], 1 / 2),  # TRL's default mode and cap
    ("sequence_truncate", None, 3.0, [[1, 1, 1], [3, 3, 0]], 1 / 2),
    ("sequence_mask", 2.0, None, [[0, 0, 0], [6, 6, 0]], 1 / 2),
])
def test_weights_for_each_mode(mode, clip_min, clip_max, expected, bounded):
    trainer, engine, mask = example()
    weights, metrics = engine_importance_weights(trainer, engine, mask, mode=mode, clip_max=clip_max,
                                                 clip_min=clip_min)
    assert torch.allclose(weights, torch.tensor(expected, dtype=torch.float32), atol=1e-6), weights
    assert metrics["bounded_frac"].item() == pytest.approx(bounded)
    if mode.startswith("token"):  # over the 5 tokens: r = 2, 1, 0.5, 4, 1.5
        assert (metrics["ratio_mean"].item(), metrics["ratio_min"].item(), metrics["ratio_max"].item()) == \
            pytest.approx((9 / 5, 0.5, 4))
    else:  # over the 2 rows: R = 1, 6
        assert (metrics["ratio_mean"].item(), metrics["ratio_min"].item(), metrics["ratio_max"].item()) == \
            pytest.approx((3.5, 1, 6))
    # engine_kl = mean over tokens of log pi_engine - log pi_old = -(ln 2 + 0 + ln 0.5 + ln 4 + ln 1.5) / 5 = -ln 6 / 5
    assert metrics["engine_kl"].item() == pytest.approx(-LN(6) / 5, abs=1e-6)


def test_a_missing_engine_logprob_counts_as_ratio_one():
    trainer, engine, mask = example()
    engine[0, 0] = float("nan")  # r was 2
    weights, _ = engine_importance_weights(trainer, engine, mask, mode="token_truncate", clip_max=3.0)
    assert weights[0].tolist() == pytest.approx([1, 1, 0.5])


def test_bad_mode_and_shapes_are_named():
    trainer, engine, mask = example()
    with pytest.raises(ValueError, match="mode='token' is not one of"):
        engine_importance_weights(trainer, engine, mask, mode="token")
    with pytest.raises(ValueError, match="one \\(N, T\\) shape"):
        engine_importance_weights(trainer, engine[:, :2], mask)


def test_sampling_weights_scale_the_surrogate_not_the_kl():
    """ratio 1 (old = logp), A = [1, -1], w = [[2, 0.5], [1, 0]], sequence_mean over 2 rows of 2 tokens:
    surrogate per token -A w: row 0 [-2, -0.5] -> mean -1.25; row 1 [1, 0] -> 0.5; loss (-1.25 + 0.5) / 2 = -0.375.
    With beta 1 and ref = logp - 0.1, k3 = e^-0.1 + 0.1 - 1 = 0.0048374 on every token, weights or not:
    loss -0.375 + 0.0048374. d loss / d logp[0, 0] = -A w / (rows * tokens) = -1 * 2 / 4 = -0.5."""
    logp = torch.full((2, 2), -1.0, requires_grad=True)
    w = torch.tensor([[2.0, 0.5], [1.0, 0.0]])
    adv, mask = torch.tensor([1.0, -1.0]), torch.ones(2, 2)
    out = policy_loss(logp, logp.detach(), adv, mask, sampling_weights=w)
    assert out.loss.item() == pytest.approx(-0.375)
    out.loss.backward()
    assert logp.grad[0, 0].item() == pytest.approx(-0.5) and logp.grad[1, 1].item() == 0.0
    k3 = math.exp(-0.1) + 0.1 - 1
    out = policy_loss(logp, logp.detach(), adv, mask, LossSettings(beta=1.0), sampling_weights=w,
                      ref_logp=logp.detach() - 0.1)
    assert out.loss.item() == pytest.approx(-0.375 + k3, abs=1e-6)
    with pytest.raises(ValueError, match="sampling_weights has shape"):
        policy_loss(logp, logp.detach(), adv, mask, sampling_weights=w[:, :1])
