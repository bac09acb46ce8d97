"""The ``owners`` deterministic exchange on an in-process fabric: the root is bit-identical to the
one-worker tree sum for any VN map, and each worker's bytes equal the closed form and do not grow
with the worker count."""

from __future__ import annotations

import pytest
import torch

from fabric import Fabric, run_ranks
from virtualflow.comm.exchange import OwnerExchange, owner_exchange
from virtualflow.comm.reduce import tree_reduce_local
from virtualflow.plan.exchange import (OwnerSchedule, choose_exchange, owners_traffic_closed_form, slots_traffic,
                                       units)
from virtualflow.plan.shards import shard_bounds
from virtualflow.plan.vnmap import TreePlan, contiguous_assignment


def leaves(v: int, numel: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Values of very different magnitudes: a different summation order would change the bits.
    return torch.randn(v, numel, generator=g) * torch.logspace(-6, 6, numel)


def one_worker_sum(x: torch.Tensor) -> torch.Tensor:
    v = x.shape[0]
    return tree_reduce_local([(0, v)], lambda i: x[i].clone())[(0, v)]


def uneven(v: int, w: int) -> list[list[int]]:
    """Blocks of unequal size (the first workers get more), none empty."""
    sizes = [1] * w
    for i in range(v - w):
        sizes[i % max(1, w // 2)] += 1
    out, at = [], 0
    for s in sizes:
        out.append(list(range(at, at + s)))
        at += s
    return out


def run_exchange(assignment, x, **schedule_kw):
    plan = TreePlan.build(assignment)
    w = len(assignment)
    numel = x.shape[1]
    sched = OwnerSchedule.build(plan, numel, **schedule_kw)
    fabric = Fabric(w)

    def body(r, group):
        local = tree_reduce_local(plan.per_worker[r], lambda i: x[i].clone())
        return owner_exchange(sched, group, local, like=x[0])

    return run_ranks(fabric, body), fabric, plan, sched


@pytest.mark.parametrize("v,assignment", [
    (8, contiguous_assignment(8, 2)), (8, contiguous_assignment(8, 3)), (16, uneven(16, 5)),
    (12, uneven(12, 5)), (12, contiguous_assignment(12, 8)), (16, contiguous_assignment(16, 16)),
    (8, [[0, 1, 2, 3, 4], [], [5, 6, 7]]),  # a worker with no VN still owns and combines a chunk
])
def test_root_is_bit_identical_to_one_worker(v, assignment):
    x = leaves(v, 257)
    roots, fabric, _, _ = run_exchange(assignment, x)
    want = one_worker_sum(x)
    for r in roots:
        assert torch.equal(r.view(torch.int32), want.view(torch.int32))
    assert fabric.undelivered() == 0
    # and the order matters at these magnitudes: a plain left-to-right sum differs
    plain = x[0].clone()
    for i in range(1, v):
        plain += x[i]
    assert not torch.equal(plain, want)


def test_sharded_layout_owner_keeps_its_chunk_and_everyone_gets_the_tail():
    v, w, numel, tail = 12, 5, 203, 3
    x = leaves(v, numel + tail)
    bounds = shard_bounds(numel, w)
    bounds[-1] = (bounds[-1][0], numel + tail)
    roots, _, _, _ = run_exchange(uneven(v, w), x, bounds=bounds, gather=[(numel, numel + tail)])
    want = one_worker_sum(x)
    for r, root in enumerate(roots):
        lo, hi = bounds[r]
        assert torch.equal(root[lo:hi], want[lo:hi])
        assert torch.equal(root[numel:], want[numel:])


@pytest.mark.parametrize("w", [2, 3, 4, 5, 8, 13, 16, 32, 64])
def test_bytes_equal_the_closed_form_and_do_not_grow_with_workers(w):
    v, numel = 4 * w, 96  # fixed VNs per worker
    x = leaves(v, numel, seed=w)
    roots, fabric, plan, sched = run_exchange(contiguous_assignment(v, w), x)
    assert torch.equal(roots[0], one_worker_sum(x))
    for r in range(w):
        c = fabric.counters[r]
        closed = owners_traffic_closed_form(plan, numel, r, 4)
        counted = sched.traffic(r, 4)
        assert (c.bytes_sent, c.bytes_received) == closed
        assert (c.bytes_sent, c.bytes_received, c.messages_sent, c.messages_received) == (
            counted.bytes_sent, counted.bytes_received, counted.messages_sent, counted.messages_received)
        # (own partials + 1) vectors at most (+ W elements of uneven chunks), whatever W
        k = len(plan.per_worker[r])
        assert c.bytes_sent <= ((k + 1) * numel + w) * 4
        assert c.bytes_received <= (len(plan.slots) * -(-numel // w) + numel) * 4
    # the old exchange moves O(W) vectors per worker
    assert slots_traffic(plan, numel, 0, 4) >= (w - 1) * numel * 4


def test_unit_messages_cover_each_owner_chunk_and_pieces_change_nothing():
    bounds = shard_bounds(100, 3)
    pieces = [(70, 100), (20, 70), (0, 20)]  # launch order: the last parameters' bucket first
    us = units(bounds, pieces)
    for o, (lo, hi) in enumerate(bounds):
        mine = sorted((u.lo, u.hi) for u in us if u.owner == o)
        assert mine[0][0] == lo and mine[-1][1] == hi
        assert all(a[1] == b[0] for a, b in zip(mine, mine[1:]))
    with pytest.raises(ValueError, match="cover"):
        units(bounds, [(0, 50), (60, 100)])
    # the same exchange sent piece by piece (the overlap with backward) gives the same bits
    v, w = 8, 3
    x = leaves(v, 100)
    plan = TreePlan.build(contiguous_assignment(v, w))
    sched = OwnerSchedule.build(plan, 100, pieces=pieces)
    per_piece = [[j for j, u in enumerate(sched.units) if lo <= u.lo and u.hi <= hi] for lo, hi in pieces]
    fabric = Fabric(w)

    def body(r, group):
        local = tree_reduce_local(plan.per_worker[r], lambda i: x[i].clone())
        ex = OwnerExchange(sched, group, pieces_units=per_piece)
        out = []
        for _ in range(2):  # two steps: persistent buffers, alternating tags
            ex.begin()
            for node, vec in local.items():
                for p in range(len(pieces)):
                    ex.send(node, vec, piece=p)
            out.append(ex.finish(local).clone())
        return out

    for both in run_ranks(fabric, body):
        for root in both:
            assert torch.equal(root, one_worker_sum(x))
    assert fabric.undelivered() == 0


def test_choose_exchange_reasons_and_bad_knob():
    plan = TreePlan.build(contiguous_assignment(8, 4))
    name, why = choose_exchange(plan, 1_000_000, 4)
    assert name == "owners" and "MiB" in why
    assert choose_exchange(plan, 100, 4)[0] == "owners"
    name, why = choose_exchange(plan, 100, 4, "slots")
    assert name == "slots" and "--deterministic-exchange slots" in why
    with pytest.raises(ValueError, match="--deterministic-exchange"):
        choose_exchange(plan, 100, 4, "ring")
