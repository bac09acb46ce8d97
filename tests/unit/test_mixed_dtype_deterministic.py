"""Deterministic mode with parameters of several dtypes (a float64 head on a float32 body).

Each VN's leaf vector holds every gradient in the widest dtype, the tree sums it there, and each
parameter's gradient is its sum rounded to the parameter's own dtype. So the weights are
bit-identical for any worker count and either exchange, and within float rounding of the plain
PyTorch loop (``tests/reference.py``). Before, the step failed when it handed a float64 sum to a
float32 parameter as its gradient.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import virtualflow as vf
from reference import reference_train
from test_exchange_engine import FEATURES, data, state, train, uneven
from virtualflow.plan.vnmap import contiguous_assignment


class MixedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(FEATURES, 16)
        self.head = nn.Linear(16, 1).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)).double()).float()


def job() -> vf.Job:
    return vf.Job(model=MixedNet, optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2), dataset=data,
                  loss=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), global_batch_size=48, virtual_nodes=12,
                  seed=3)


@pytest.mark.parametrize("exchange", ["slots", "owners"])
def test_several_dtypes_are_bit_identical_for_any_worker_count(exchange):
    j = job()
    one, _ = train(j, contiguous_assignment(12, 1), 3)
    assert one.model.head.weight.dtype == torch.float64 and one.model.body.weight.dtype == torch.float32
    _, engines = train(j, uneven(12, 3), 3, exchange=exchange)
    for e in engines:
        for (name, a), b in zip(state(e).items(), state(one).values()):
            assert a.dtype == b.dtype and torch.equal(a, b), name


def test_several_dtypes_train_as_the_plain_loop():
    j = job()
    one, _ = train(j, contiguous_assignment(12, 1), 3)
    ref, _, _ = reference_train(j, 3)
    for (name, a), b in zip(one.model.state_dict().items(), ref.state_dict().values()):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
