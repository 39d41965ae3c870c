"""Host syncs in the update's per-micro-batch code: on a GPU each `.item()`, `float(t)`, `int(t)`, `.tolist()` or
`bool(t)` of a device tensor waits for the device, as does an operator whose output size depends on values
(nonzero, a boolean mask's index) (gpu_review2 N12). The CPU has no device to wait for, so these tests make every
such read raise while the code runs: what passes would not sync on a GPU either."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from grpo.config import GRPOConfig
from grpo.training.update.objective import MicroInputs, Objective


class _DataDependent(TorchDispatchMode):
    """Raises on the operators whose result needs a tensor's values on the host: a scalar read, nonzero, and
    indexing with a boolean mask (its output's size is the mask's count)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        boolean = func is torch.ops.aten.index.Tensor and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        if boolean or func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
                               torch.ops.aten.masked_select.default):
            raise AssertionError(f"a host sync: {func}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_host_reads(monkeypatch):
    """Every read of a tensor's values into Python, and every operator that needs one, raises inside the block."""
    def refuse(*args, **kwargs):
        raise AssertionError("a host sync: a tensor's value read into Python")

    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "__float__", "__int__", "__bool__", "__index__"):
            patch.setattr(torch.Tensor, name, refuse)
        with _DataDependent():
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


def test_the_high_entropy_mask_of_one_process_reads_no_value(monkeypatch):
    """top_entropy_quantile < 1 in one process: the threshold is the quantile of the masked tokens' entropies, taken
    with NaN off the mask (before: a boolean index, a host sync per micro-batch). By hand: the 3 real tokens'
    entropies 0.1, 0.9, 0.5 at quantile 1 - 0.5 = 0.5 give 0.5; tokens 2 and 3 (>= 0.5) keep their surrogate
    -1 each, token 1 is masked out: -2 / 3 tokens = -2/3 with the token-level normaliser 3. No token at all: inf."""
    cfg = GRPOConfig(beta=0.0, top_entropy_quantile=0.5, loss_type="dapo")
    logp = torch.tensor([[-1.0, -2.0, -0.5, 0.0]], requires_grad=True)
    entropy = torch.tensor([[0.1, 0.9, 0.5, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    objective = Objective(cfg, _OneProcess())
    with no_host_reads(monkeypatch):
        out = objective.loss(logp, entropy, MicroInputs(mask, torch.tensor([1.0]), None, None, None, 3.0, 1))
        empty = objective._threshold(entropy, torch.zeros_like(mask))
    assert out.loss.item() == pytest.approx(-2.0 / 3.0, abs=1e-6)
    assert objective._threshold(entropy, mask).item() == pytest.approx(0.5) and empty.item() == float("inf")
