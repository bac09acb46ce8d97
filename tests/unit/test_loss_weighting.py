"""A VN's loss weighting folded into its backward (runtime/step/compute.py): the gradients and the
weighted losses are bit for bit those of ``(loss * share).backward()``, the plain PyTorch way, for
shares that are not exact binary fractions; half-precision losses and a loss scale keep the
multiplication."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from virtualflow.plan.data import DataPlan
from virtualflow.runtime.amp import LossScaler
from virtualflow.runtime.batches import BatchLoader
from virtualflow.runtime.batchnorm import BatchNormState
from virtualflow.runtime.breakdown import StepClock
from virtualflow.runtime.step.compute import VNCompute

SHARES = (1 / 3, 5 / 7, 0.1, 1.0)


def _compute(model: nn.Module, scaler: LossScaler | None = None) -> VNCompute:
    ds = TensorDataset(torch.randn(12, 4), torch.randn(12, 1))
    return VNCompute(model, lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), DataPlan(12, 12, 4, 0),
                     BatchLoader(ds, None), seed=0, device=torch.device("cpu"), precision="32", scaler=scaler,
                     bn=BatchNormState(model), clock=StepClock(enabled=False), prefetcher=None)


def _losses(model: nn.Module, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(5, 4, generator=g, dtype=dtype) for _ in SHARES]
    return [(model(x) ** 2).mean() * 1e3 for x in xs]


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_folded_backward_and_weighted_losses_equal_the_multiplied_ones(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).to(dtype)
    compute = _compute(model)
    for loss, share in zip(_losses(model, dtype), SHARES):  # the plain way: accumulate loss * share
        (loss * share).backward()
    plain = _grads(model)
    plain_weighted = [loss.detach() * share for loss, share in zip(_losses(model, dtype), SHARES)]
    model.zero_grad(set_to_none=True)
    losses = _losses(model, dtype)
    for loss, share in zip(losses, SHARES):
        compute.backward(loss, share)
    for a, b in zip(_grads(model), plain):
        assert a.dtype == b.dtype and torch.equal(a, b)
    block = compute.weighted_block(losses, SHARES)
    assert block.dtype == dtype and not block.requires_grad
    assert torch.equal(block, torch.stack(plain_weighted))
    for i, (loss, share) in enumerate(zip(losses, SHARES)):
        assert torch.equal(compute.weighted(loss, share), plain_weighted[i])
    assert compute.folds and (dtype in (torch.float32, torch.float64)) == (compute._root(losses[0], 0.5)[1] is not None)


def test_a_loss_scale_keeps_the_multiplication():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 1))
    scaler = LossScaler({"init_scale": 2.0**7})
    compute = _compute(model, scaler)
    assert not compute.folds
    plain_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**7)
    for loss, share in zip(_losses(model, torch.float32), SHARES):
        plain_scaler.scale(loss * share).backward()
    plain = _grads(model)
    model.zero_grad(set_to_none=True)
    for loss, share in zip(_losses(model, torch.float32), SHARES):
        root, seed = compute._root(loss, share)
        assert seed is None
        compute.backward(loss, share)
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), plain))


def test_the_block_keeps_its_shares_tensor_until_the_shares_change():
    model = nn.Linear(4, 1)
    compute = _compute(model)
    losses = _losses(model, torch.float32)
    compute.weighted_block(losses, SHARES)
    kept = compute._shares[2]
    compute.weighted_block(losses, SHARES)
    assert compute._shares[2] is kept
    other = (0.25,) * len(SHARES)
    got = compute.weighted_block(losses, other)
    assert compute._shares[2] is not kept
    assert torch.equal(got, torch.stack([x.detach() * 0.25 for x in losses]))
