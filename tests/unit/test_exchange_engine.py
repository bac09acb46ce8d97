"""The VN engine's deterministic exchange with W workers as threads in this process (the in-process
fabric of ``tests/fabric.py``): bit-identical to one worker for uneven VN maps and both exchanges,
plain and sharded, and the ``owners`` exchange sends while the backward still runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from conftest import assert_state_equal
from fabric import Fabric, run_ranks
from virtualflow.comm.groups import Group
from virtualflow.plan.data import DataPlan
from virtualflow.plan.vnmap import contiguous_assignment
from virtualflow.runtime.engine import BatchLoader, VNEngine
import virtualflow as vf

FEATURES = 24


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(192, FEATURES, generator=g)
    return TensorDataset(x, (x[:, :3] * 2).sum(1, keepdim=True) + 0.1 * torch.randn(192, 1, generator=g))


def net(width: int = 32) -> nn.Module:
    # BatchNorm (its statistics ride in the exchanged vector), no dropout: threads share the
    # process's random generator, so these runs use none.
    return nn.Sequential(nn.Linear(FEATURES, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, width),
                         nn.Tanh(), nn.Linear(width, 1))


def job(virtual_nodes: int, width: int = 32) -> vf.Job:
    return vf.Job(model=lambda: net(width), optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2), dataset=data,
                  loss=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), global_batch_size=48,
                  virtual_nodes=virtual_nodes, seed=3)


def engine(j: vf.Job, reduction: str = "allreduce", exchange: str = "auto") -> VNEngine:
    torch.manual_seed(j.seed)
    model = j.model()
    opt = j.optimizer(model.parameters())
    ds = j.build_dataset()
    plan = DataPlan.of_job(j, len(ds))
    return VNEngine(model, opt, None, j.loss, plan, BatchLoader(ds, None), seed=j.seed, batchnorm=j.batchnorm,
                    deterministic=True, device=torch.device("cpu"), reduction=reduction,
                    deterministic_exchange=exchange)


def uneven(v: int, w: int) -> list[list[int]]:
    sizes = [1] * w
    for i in range(v - w):
        sizes[i % max(1, (w + 1) // 2)] += 1
    out, at = [], 0
    for s in sizes:
        out.append(list(range(at, at + s)))
        at += s
    return out


def train(j: vf.Job, assignment, steps: int, **kw):
    w = len(assignment)
    engines = [engine(j, **kw) for _ in range(w)]
    if w == 1:
        engines[0].set_membership(Group(0, 0, 1, None), assignment)
        for s in range(steps):
            engines[0].step(s)
        return engines[0], None
    fabric = Fabric(w)

    def body(r, group):
        e = engines[r]
        e.set_membership(group, assignment)
        for s in range(steps):
            e.step(s)
        return e

    out = run_ranks(fabric, body)
    assert fabric.undelivered() == 0
    return out[0], out


def state(e: VNEngine) -> dict:
    return {k: v.clone() for k, v in e.model.state_dict().items()}


@pytest.mark.parametrize("exchange", ["owners", "slots"])
@pytest.mark.parametrize("v,assignment", [(12, uneven(12, 2)), (12, uneven(12, 5)), (16, uneven(16, 3)),
                                          (16, contiguous_assignment(16, 8)), (12, [[0, 1, 2, 3, 4, 5, 6], [], [7, 8, 9, 10, 11]])])
def test_bit_identical_to_one_worker(exchange, v, assignment):
    j = job(v)
    one, _ = train(j, contiguous_assignment(v, 1), 3)
    e0, engines = train(j, assignment, 3, exchange=exchange)
    for e in engines:
        assert e.exchange_choice[0] == exchange
        assert_state_equal(state(e), state(one))


def test_sharded_bit_identical_to_one_worker():
    j = job(12)
    one, _ = train(j, contiguous_assignment(12, 1), 3)
    _, engines = train(j, uneven(12, 3), 3, reduction="sharded", exchange="owners")
    for e in engines:
        assert_state_equal(state(e), state(one))


def test_owners_sends_earlier_partials_during_compute_and_the_last_one_during_backward():
    j = job(8, width=640)  # ~1.7 MB of weights: two gradient buckets (the first is capped at 1 MB)
    w = 2
    assignment = [[0, 1, 2], [3, 4, 5, 6, 7]]  # worker 0: nodes (0, 2), (2, 3); worker 1: (3, 4), (4, 8)
    engines = [engine(j, exchange="owners") for _ in range(w)]
    fabric = Fabric(w)
    seen: dict[int, list[tuple[int, str, bool]]] = {0: [], 1: []}

    def body(r, group):
        e = engines[r]
        e.set_membership(group, assignment)
        sender = e.reduction.exchange.exchange._sender  # sends are handed to it, and started in turn
        post = sender.post

        def watched(g, tensor, dst, tag):
            seen[r].append((tensor.numel(), e.phase, e._in_last_backward))
            return post(g, tensor, dst, tag)

        sender.post = watched
        e.step(0)
        return len(e.leaves.partials.pieces)

    pieces = run_ranks(fabric, body)
    assert pieces[0] == 3  # two buckets and the tail
    for r in range(w):
        during_backward = [s for s in seen[r] if s[2]]
        before_last_vn = [s for s in seen[r] if s[1] == "before_forward"]
        after = [s for s in seen[r] if s[1] == "reduction"]
        # the first bucket of the last partial left while the backward was still running
        assert during_backward, seen[r]
        # the root's chunk goes out after the combine
        assert after
    # worker 0's first partial (0, 2) left before its last VN even started
    assert [s for s in seen[0] if s[1] == "before_forward"]


@pytest.mark.parametrize("reduction", ["allreduce", "sharded"])
def test_large_parameters_are_sent_from_the_partial_sums_own_tensors_bit_identical_to_one_worker(reduction):
    # width 300: the middle Linear has 90,000 weights, a piece of its own (send_pieces); the
    # partial sums are never copied into a flat buffer of the pool (no buffer is ever taken)
    j = job(12, width=300)
    one, _ = train(j, contiguous_assignment(12, 1), 2)
    _, engines = train(j, uneven(12, 3), 2, reduction=reduction, exchange="owners")
    for e in engines:
        assert e.exchange_choice[0] == "owners"
        assert e.leaves.partials._pool == []
        assert_state_equal(state(e), state(one))
