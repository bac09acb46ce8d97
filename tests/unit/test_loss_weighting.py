"""A VN's loss weighting folded into its backward (runtime/step/weighting.py: the VN engine's
compute and the pipeline's last piece use it): the gradients and the weighted losses are bit for bit
those of ``(loss * share).backward()``, the plain PyTorch way, for shares that are not exact binary
fractions; half-precision losses and a loss scale keep the multiplication."""

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
    plain_block = torch.stack(plain_weighted)
    ws, total = compute.weighted_block(losses, SHARES)  # on CPU: Python floats, exact products
    if dtype == torch.bfloat16:  # (kept as tensors)
        assert ws.dtype == dtype and not ws.requires_grad and torch.equal(ws, plain_block)
        assert torch.equal(total, plain_block.sum())
    else:
        assert all(type(x) is float for x in ws) and total == sum(ws)
        assert torch.equal(torch.tensor(ws, dtype=dtype), plain_block)  # rounded: the multiplied losses
        if dtype == torch.float32:  # and they are the exact products (no rounding before the sum)
            assert any(x != float(y) for x, y in zip(ws, plain_block.tolist()))
    compute.on_cpu = False  # an accelerator's block: a tensor on the device
    ws, total = compute.weighted_block(losses, SHARES)
    assert ws.dtype == dtype and not ws.requires_grad and torch.equal(ws, plain_block)
    assert torch.equal(total, plain_block.sum())
    for i, (loss, share) in enumerate(zip(losses, SHARES)):
        assert torch.equal(compute.weighted(loss, share), plain_weighted[i])
    folded = compute.weighting.root(losses[0], 0.5)[1] is not None
    assert compute.weighting.folds and folded == (dtype in (torch.float32, torch.float64))


def test_a_loss_scale_keeps_the_multiplication():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 1))
    scaler = LossScaler({"init_scale": 2.0**7})
    compute = _compute(model, scaler)
    assert not compute.weighting.folds
    plain_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**7)
    for loss, share in zip(_losses(model, torch.float32), SHARES):
        plain_scaler.scale(loss * share).backward()
    plain = _grads(model)
    model.zero_grad(set_to_none=True)
    for loss, share in zip(_losses(model, torch.float32), SHARES):
        root, seed = compute.weighting.root(loss, share)
        assert seed is None
        compute.backward(loss, share)
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), plain))


@pytest.mark.parametrize("on_cpu", [True, False])
def test_the_block_keeps_its_shares_until_they_change(on_cpu):
    model = nn.Linear(4, 1)
    compute = _compute(model)
    compute.on_cpu = on_cpu
    losses = _losses(model, torch.float32)
    compute.weighted_block(losses, SHARES)
    kept = compute._shares[2]
    compute.weighted_block(losses, SHARES)
    assert compute._shares[2] is kept
    other = (0.25,) * len(SHARES)
    got, _ = compute.weighted_block(losses, other)
    assert compute._shares[2] is not kept
    assert torch.equal(torch.as_tensor(got, dtype=torch.float32), torch.stack([x.detach() * 0.25 for x in losses]))


def test_non_finite_losses_flag_the_same_vns_and_a_huge_sum_packs_as_infinity():
    from virtualflow.runtime.step.stats import BadFlags, StatsLayout

    model = nn.Linear(4, 1)
    compute = _compute(model)
    big = torch.finfo(torch.float32).max
    losses = [torch.tensor(x) for x in (1.0, float("inf"), float("nan"), big, big, -float("inf"))]
    shares = (0.5, 0.25, 1 / 3, 1.0, 1.0, 0.125)
    flags = {}
    for on_cpu in (True, False):
        compute.on_cpu = on_cpu
        ws, total = compute.weighted_block(losses, shares)
        bad = BadFlags(len(losses), None)
        bad.note_block(range(len(losses)), slice(None), ws)
        flags[on_cpu] = bad.values
    assert flags[True] == flags[False] == [0.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    compute.on_cpu = True
    ws, total = compute.weighted_block(losses[3:5], shares[3:5])  # finite in a Python float, not in float32
    assert total == 2 * big
    layout = StatsLayout(2, 1, 0, loss=True, bn_numel=0, bn_mean=False)
    packed = layout.pack(BadFlags(2, None), 0, None, total, None, 0.0, None)
    assert packed[0].item() == float("inf") and packed.dtype == torch.float32
