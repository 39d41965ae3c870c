"""Host syncs in the update's per-micro-batch code: on a GPU each `.item()`, `float(t)`, `int(t)`, `.tolist()` or
`bool(t)` of a device tensor waits for the device (gpu_review2 N12). The CPU has no device to wait for, so these
tests make every such read raise while the code runs: what passes would not sync on a GPU either."""

from __future__ import annotations

import contextlib

import pytest
import torch

from grpo.config import GRPOConfig
from grpo.training.objective import MicroInputs, Objective


@contextlib.contextmanager
def no_host_reads(monkeypatch):
    """Every read of a tensor's values into Python raises inside the block."""
    def refuse(*args, **kwargs):
        raise AssertionError("a host sync: a tensor's value read into Python")

    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "__float__", "__int__", "__bool__", "__index__"):
            patch.setattr(torch.Tensor, name, refuse)
        yield


class _OneProcess:
    world = 1


@pytest.mark.parametrize("adaptive", [False, True])
def test_the_entropy_bonus_reads_no_value_per_micro_batch(monkeypatch, adaptive):
    """The entropy bonus's normaliser (the micro-batch's tokens x micro-batches x processes) stays a tensor: before,
    float(tokens) synced once per micro-batch. The loss is the hand value: the surrogate -rho x A = -1 on each of
    the row's 3 tokens, their mean -1 over 1 row (the default aggregation's normaliser); the bonus -0.1 x (3 x 0.5) /
    (3 tokens x 2 micro-batches x 1 process) = -0.025, or 0 under adaptive control before any step measured the
    entropy (its coefficient applies at or below the target only)."""
    cfg = GRPOConfig(beta=0.0, entropy_coef=0.1, use_adaptive_entropy=adaptive, entropy_target=1.0)
    logp = torch.tensor([[-1.0, -2.0, -0.5, 0.0]], requires_grad=True)
    entropy = torch.full((1, 4), 0.5, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    micro = MicroInputs(mask, torch.tensor([1.0]), None, None, None, 1.0, 2)
    objective = Objective(cfg, _OneProcess())
    with no_host_reads(monkeypatch):
        out = objective.loss(logp, entropy, micro)
    assert out.loss.item() == pytest.approx(-1.0 - (0.0 if adaptive else 0.025), abs=1e-6)
