"""The ``owners`` exchange's second phase, pipelined per unit: an owner sends each unit of its chunk
of the root as soon as every slot's message for that unit is in (not after its whole chunk), the
senders start with the next owner after themselves, units are cut into segments, and the root is
still bit-identical to the one-worker tree sum for every layout. The schedule's time model
(``owners_seconds``) is checked against hand-computed cases."""

from __future__ import annotations

import threading

import pytest
import torch

from fabric import Fabric, run_ranks
from test_exchange import leaves, one_worker_sum, uneven
from virtualflow.comm.exchange import OwnerExchange, owner_exchange
from virtualflow.comm.reduce import tree_reduce_local
from virtualflow.plan.exchange import (DEPTH, MIN_SEGMENT, SEGMENT, OwnerSchedule, owners_seconds,
                                       owners_traffic_closed_form, segment_for, units)
from virtualflow.plan.shards import shard_bounds
from virtualflow.plan.vnmap import TreePlan, contiguous_assignment

GATE_S = 10.0
"""How long the held message waits for the owner's early root before it is let through anyway
(only reached when the owner waits for its whole chunk: the test then fails)."""


def test_units_are_cut_into_near_even_segments_in_launch_order():
    bounds = shard_bounds(100, 3)  # (0, 34), (34, 67), (67, 100)
    pieces = [(50, 100), (0, 50)]
    us = units(bounds, pieces, segment=10)
    assert all(u.hi - u.lo <= 10 for u in us)
    # piece 0 first, then piece 1; inside a piece owner by owner, each part cut into near-even segments
    assert [(u.piece, u.owner, u.lo, u.hi) for u in us[:6]] == [
        (0, 1, 50, 59), (0, 1, 59, 67), (0, 2, 67, 76), (0, 2, 76, 84), (0, 2, 84, 92), (0, 2, 92, 100)]
    for o, (lo, hi) in enumerate(bounds):
        mine = sorted((u.lo, u.hi) for u in us if u.owner == o)
        assert mine[0][0] == lo and mine[-1][1] == hi and all(a[1] == b[0] for a, b in zip(mine, mine[1:]))
    assert len(units(bounds, pieces)) == 4  # no segment: one message per piece and owner
    with pytest.raises(ValueError, match="segment=0"):
        units(bounds, pieces, segment=0)


def test_a_chunk_is_cut_into_depth_segments_unless_they_would_fall_below_the_floor():
    # a chunk of 78,125 elements (4 hosts, 100 Mbit/s in bench.hosts): DEPTH messages, not one
    assert segment_for(78_125, SEGMENT) == -(-78_125 // DEPTH)
    # never below MIN_SEGMENT: a chunk shorter than DEPTH floors is one message, or a few
    assert segment_for(MIN_SEGMENT, SEGMENT) == MIN_SEGMENT
    assert segment_for(3 * MIN_SEGMENT, SEGMENT) == MIN_SEGMENT
    # never above SEGMENT (a 25 M vector on 3 workers keeps 2^20-element messages)
    assert segment_for(25_000_000 // 3, SEGMENT) == SEGMENT
    # an explicit small segment is kept as it is
    assert segment_for(34, 10) == 10
    n = 4 * 78_125
    plan = TreePlan.build(contiguous_assignment(8, 4))
    sched = OwnerSchedule.build(plan, n)
    for o, (lo, hi) in enumerate(sched.bounds):
        mine = [u for u in sched.units if u.owner == o]
        assert len(mine) == DEPTH and (mine[0].lo, mine[-1].hi) == (lo, hi)
        assert max(u.hi - u.lo for u in mine) - min(u.hi - u.lo for u in mine) <= 1
    # the bytes do not depend on the cut: the closed form holds message by message
    for r in range(4):
        t = sched.traffic(r, 4)
        assert (t.bytes_sent, t.bytes_received) == owners_traffic_closed_form(plan, n, r, 4)
    # a piece inside a chunk is cut by its owner's segment length, not into DEPTH more
    small = OwnerSchedule.build(plan, n, pieces=[(0, 1000), (1000, n)])
    assert [u.hi - u.lo for u in small.units if u.piece == 0] == [1000]


@pytest.mark.parametrize("w", [2, 3, 5])
def test_send_order_starts_with_the_next_owner_and_keeps_each_owners_unit_order(w):
    plan = TreePlan.build(contiguous_assignment(2 * w, w))
    sched = OwnerSchedule.build(plan, 97, pieces=[(10, 97), (0, 10)], segment=7)  # piece 0 meets every chunk
    for rank in range(w):
        order = sched.send_order(rank)
        assert sorted(order) == [j for j, u in enumerate(sched.units) if u.owner != rank]
        assert sched.units[order[0]].owner == (rank + 1) % w
        for o in range(w):
            to_o = [j for j in order if sched.units[j].owner == o]
            assert to_o == sorted(to_o)  # the order the owner combines them in
        pieces = [sched.units[j].piece for j in order]
        assert pieces == sorted(pieces)  # launch order first
    firsts = {sched.units[sched.send_order(r)[0]].owner for r in range(w)}
    assert len(firsts) == w  # no owner is everyone's first destination


LAYOUTS = [
    (8, contiguous_assignment(8, 2), None, 5),
    (8, contiguous_assignment(8, 3), [(70, 101), (30, 70), (0, 30)], 9),
    (16, uneven(16, 5), [(0, 101)], 3),
    (12, contiguous_assignment(12, 8), [(90, 101), (0, 90)], 4),
    (8, [[0, 1, 2, 3, 4], [], [5, 6, 7]], [(50, 101), (0, 50)], 6),  # a worker with no VN
]


@pytest.mark.parametrize("v,assignment,pieces,segment", LAYOUTS)
@pytest.mark.parametrize("sharded", [False, True])
def test_root_is_bit_identical_piece_by_piece_with_segments(v, assignment, pieces, segment, sharded):
    numel, tail = 98, 3
    n = numel + tail
    x = leaves(v, n, seed=v)
    plan = TreePlan.build(assignment)
    w = len(assignment)
    bounds = gather = None
    if sharded:  # each owner keeps its chunk of the gradients, the tail goes to everyone
        bounds = shard_bounds(numel, w)
        bounds[-1] = (bounds[-1][0], n)
        gather = [(numel, n)]
    sched = OwnerSchedule.build(plan, n, bounds=bounds, pieces=pieces, gather=gather, segment=segment)
    cut = pieces if pieces is not None else [(0, n)]
    per_piece = [[j for j, u in enumerate(sched.units) if lo <= u.lo and u.hi <= hi] for lo, hi in cut]
    fabric = Fabric(w)
    for g in fabric.groups:
        g.abort_check = lambda: False  # the worker's way of waiting (a daemon thread per unit)

    def body(r, group):
        local = tree_reduce_local(plan.per_worker[r], lambda i: x[i].clone())
        ex = OwnerExchange(sched, group, pieces_units=per_piece)
        out = []
        for _ in range(2):  # two steps: persistent buffers, alternating tags
            ex.begin()
            for node, vec in local.items():
                for p in reversed(range(len(cut))):  # any order of the pieces
                    ex.send(node, vec, piece=p)
            out.append(ex.finish(local).clone())
        return out

    want = one_worker_sum(x)
    for r, both in enumerate(run_ranks(fabric, body)):
        lo, hi = sched.bounds[r]
        for root in both:
            assert torch.equal(root[lo:hi].view(torch.int32), want[lo:hi].view(torch.int32))
            for a, b in sched.gather:
                assert torch.equal(root[a:b].view(torch.int32), want[a:b].view(torch.int32))
    assert fabric.undelivered() == 0
    for r in range(w):
        c, t = fabric.counters[r], sched.traffic(r, 4)
        assert (c.bytes_sent, c.bytes_received, c.messages_sent, c.messages_received) == (
            2 * t.bytes_sent, 2 * t.bytes_received, 2 * t.messages_sent, 2 * t.messages_received)
        assert (t.bytes_sent, t.bytes_received) == owners_traffic_closed_form(plan, n, r, 4, bounds, gather)


@pytest.mark.parametrize("w", [2, 3, 4, 6])
def test_owner_exchange_with_default_segments_is_the_one_worker_sum(w):
    v = 2 * w + 1
    x = leaves(v, 211, seed=w)
    plan = TreePlan.build(contiguous_assignment(v, w))
    sched = OwnerSchedule.build(plan, 211, segment=16)
    fabric = Fabric(w)

    def body(r, group):
        return owner_exchange(sched, group, tree_reduce_local(plan.per_worker[r], lambda i: x[i].clone()), like=x[0])

    want = one_worker_sum(x)
    for root in run_ranks(fabric, body):
        assert torch.equal(root.view(torch.int32), want.view(torch.int32))


class _Held:
    """A send let through by a thread once ``gate`` is set (or after GATE_S)."""

    def __init__(self, send, gate: threading.Event) -> None:
        self.thread = threading.Thread(target=lambda: (gate.wait(GATE_S), send()), daemon=True)
        self.thread.start()

    def wait(self) -> bool:
        self.thread.join()
        return True


def test_an_owner_sends_its_first_units_root_before_its_last_unit_arrives():
    """Owner 0's chunk has two units (pieces cut it at 12); rank 1's message for the second unit is
    held until owner 0 has sent the first unit's root to both other ranks. Waiting for the whole
    chunk first, owner 0 would send nothing until the held message came (after GATE_S)."""
    v, numel = 3, 60
    x = leaves(v, numel, seed=7)
    plan = TreePlan.build(contiguous_assignment(v, 3))
    pieces = [(0, 12), (12, numel)]
    sched = OwnerSchedule.build(plan, numel, pieces=pieces, segment=None)
    owner0 = [(u.lo, u.hi) for u in sched.units if u.owner == 0]
    assert owner0 == [(0, 12), (12, 20)]
    per_piece = [[j for j, u in enumerate(sched.units) if lo <= u.lo and u.hi <= hi] for lo, hi in pieces]
    fabric = Fabric(3)
    gate, events, lock = threading.Event(), [], threading.Lock()
    g0, g1 = fabric.groups[0], fabric.groups[1]
    send0, send1 = g0.isend, g1.isend

    def isend0(tensor, dst, tag=0):
        work = send0(tensor, dst, tag)
        if tensor.numel() == 12:  # the root of owner 0's first unit (its partial's units are 20 long)
            with lock:
                events.append(("root unit 0 sent", dst))
                if sum(e[0] == "root unit 0 sent" for e in events) == 2:
                    gate.set()
        return work

    def isend1(tensor, dst, tag=0):
        if dst == 0 and tensor.numel() == 8:  # rank 1's message for owner 0's second unit
            def late():
                with lock:
                    events.append(("held message delivered", gate.is_set()))
                send1(tensor, dst, tag)
            return _Held(late, gate)
        return send1(tensor, dst, tag)

    g0.isend, g1.isend = isend0, isend1

    def body(r, group):
        local = tree_reduce_local(plan.per_worker[r], lambda i: x[i].clone())
        ex = OwnerExchange(sched, group, pieces_units=per_piece)
        ex.begin()
        for node, vec in local.items():
            for p in range(len(pieces)):
                ex.send(node, vec, piece=p)
        return ex.finish(local).clone()

    roots = run_ranks(fabric, body)
    assert events[:3] == [("root unit 0 sent", 1), ("root unit 0 sent", 2), ("held message delivered", True)] or \
        events[:3] == [("root unit 0 sent", 2), ("root unit 0 sent", 1), ("held message delivered", True)]
    want = one_worker_sum(x)
    for root in roots:
        assert torch.equal(root, want)


def test_time_model_pipelines_the_second_phase_per_unit():
    """Two workers, owner 0's chunk 90 of 100 elements, one byte per element and per second each
    way: the first phase brings 90 bytes to owner 0 (90 s), its root goes back (90 s). As one unit
    the second phase starts after the first: 180 s; in segments of 10 only the last segment's
    root follows the first phase, and the links' bytes bound it: 100 s."""
    plan = TreePlan.build(contiguous_assignment(2, 2))
    skewed = [(0, 90), (90, 100)]
    seconds = lambda out, into: out  # noqa: E731 - one byte per second, nothing for the other way
    assert owners_seconds(OwnerSchedule.build(plan, 100, bounds=skewed, segment=None), 1, seconds) == 180
    assert owners_seconds(OwnerSchedule.build(plan, 100, bounds=skewed, segment=10), 1, seconds) == 100
    # even chunks, one partial per worker: the first phase then every unit's root: the links' bytes
    plan4 = TreePlan.build(contiguous_assignment(8, 4))
    sched = OwnerSchedule.build(plan4, 400, segment=None)
    assert owners_seconds(sched, 4, seconds) == max(sched.traffic(r, 4).bytes_sent for r in range(4)) == 1.5 * 400 * 4
    # the acknowledgements the other way count on the busier direction
    acks = lambda out, into: out + into / 10  # noqa: E731
    assert owners_seconds(sched, 4, acks) == pytest.approx(1.5 * 400 * 4 * 1.1)
