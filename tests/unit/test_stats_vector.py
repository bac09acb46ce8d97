"""The VN engine's statistics vector: the non-finite flags and the loss packed as Python numbers
(on CPU) land in the same slots, with the same values, as packed as tensors (on an accelerator)."""

from __future__ import annotations

import math

import pytest
import torch

from virtualflow.runtime.breakdown import RAW
from virtualflow.runtime.step.stats import MAX_METRICS, BadFlags, StatsLayout

V = 8


def flags_of(device, weighted, vns=(2, 3, 4), one=None):
    """BadFlags after noting ``weighted`` (losses of ``vns``) as a block, and ``one`` (vn, loss) alone."""
    bad = BadFlags(V, device)
    bad.note_block(list(vns), slice(vns[0], vns[-1] + 1), weighted)
    if one is not None:
        bad.note(*one)
    return bad


@pytest.mark.parametrize("value", [1.5, 0.0, -0.0, 1e-45, 3e38, math.inf, -math.inf, math.nan])
def test_a_flag_is_set_exactly_when_the_loss_is_not_finite(value):
    weighted = torch.tensor([0.25, value, -2.0])
    for device in (None, torch.device("cpu")):  # Python floats / a tensor on the device
        bad = flags_of(device, weighted, one=(7, torch.tensor(value)))
        values = bad.values if device is None else bad.values.tolist()
        expect = 0.0 if math.isfinite(value) else 1.0
        assert values == [0.0, 0.0, 0.0, expect, 0.0, 0.0, 0.0, expect], (device, value)


@pytest.mark.parametrize("bn_numel", [0, 3])
@pytest.mark.parametrize("metrics", [False, True])
def test_cpu_numbers_and_device_tensors_pack_the_same_vector(bn_numel, metrics):
    layout = StatsLayout(V, 2, 1, loss=True, bn_numel=bn_numel, bn_mean=False)
    weighted = torch.tensor([0.125, math.nan, 0.375], dtype=torch.float32)
    loss = torch.tensor(0.1 + 0.2, dtype=torch.float32)  # not exact in binary: the fp32 value must survive
    bn = torch.tensor([1.0, 2.0, 3.5]) if bn_numel else None
    m = torch.arange(MAX_METRICS, dtype=torch.float32) / 3 if metrics else None
    previous = [0.001 * (k + 1) for k in range(len(RAW))]
    packed = [layout.pack(flags_of(device, weighted), 5, m, loss, bn, 0.0123, previous)
              for device in (None, torch.device("cpu"))]
    assert packed[0].dtype == packed[1].dtype == torch.get_default_dtype()
    assert torch.equal(packed[0].view(torch.int32), packed[1].view(torch.int32))  # bit for bit (NaN-free)
    got = layout.read(packed[0])
    assert got.bad_vns == [3]
    assert got.loss == loss.item() and got.control == 5
    assert got.compute_s == [0.0, pytest.approx(0.0123)]
    assert got.breakdown_raw[0] == [0.0] * len(RAW) and got.breakdown_raw[1] == pytest.approx(previous)
    assert got.metric_values == (pytest.approx(m.tolist()) if metrics else [0.0] * MAX_METRICS)
    if bn_numel:
        assert torch.equal(got.bn, bn)


def test_a_float64_default_dtype_packs_float64():
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        layout = StatsLayout(V, 1, 0, loss=True, bn_numel=0, bn_mean=False)
        vec = layout.pack(flags_of(None, torch.tensor([1.0, 2.0, 3.0])), 0, None, torch.tensor(0.1), None, 0.0, None)
        assert vec.dtype == torch.float64 and layout.read(vec).loss == 0.1
    finally:
        torch.set_default_dtype(prev)
