"""Process-group generations: waits that outlast a wait slice, and the abort flag.

A peer (a child process, rank 0) delays its side of an operation by several wait slices; the
test process is rank 1. Collective waits are sliced (to look at the abort flag in between) and
must survive any number of expired slices; point-to-point receives must not be sliced at all,
because gloo closes the pair when a receive's wait expires (the cause of a real bug: a state
transfer longer than one slice broke every grow of a 25 M-parameter model).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import threading
import time

import pytest
import torch
import torch.distributed as dist

from virtualflow.comm import groups
from virtualflow.comm.groups import PeerFailure, make_group

DELAY_S = 6 * groups.WAIT_SLICE_S


def _peer(port: int, op: str, delay_s: float) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=30))
    group = make_group(store, 0, 0, 2, 30.0, torch.device("cpu"))
    time.sleep(delay_s)
    if op == "send":
        group.send(torch.arange(1 << 20, dtype=torch.float32), 1, tag=7)
    elif op == "all_reduce":
        group.all_reduce(torch.ones(4))
    elif op == "silent":
        time.sleep(30)  # never joins the collective
    time.sleep(0.5)  # let rank 1 finish reading before the sockets close
    group.close()


@pytest.fixture
def pair():
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    procs = []

    def start(op: str, delay_s: float = DELAY_S):
        p = mp.get_context("spawn").Process(target=_peer, args=(store.port, op, delay_s), daemon=True)
        p.start()
        procs.append(p)
        group = make_group(store, 0, 1, 2, 30.0, torch.device("cpu"))
        return store, group, p

    yield start
    for p in procs:
        p.kill()
        p.join(10)


def test_a_receive_outlasting_many_wait_slices_completes(pair):
    store, group, _ = pair("send")
    group.abort_check = lambda: store.check(["gen/0/abort"])
    buf = torch.empty(1 << 20)
    t0 = time.perf_counter()
    group.recv(buf, 0, tag=7)
    assert time.perf_counter() - t0 >= DELAY_S * 0.8  # the wait really did outlast the slices
    assert torch.equal(buf, torch.arange(1 << 20, dtype=torch.float32))


def test_a_collective_outlasting_many_wait_slices_completes(pair):
    store, group, _ = pair("all_reduce")
    group.abort_check = lambda: store.check(["gen/0/abort"])
    t = torch.ones(4)
    t0 = time.perf_counter()
    group.all_reduce(t)
    assert time.perf_counter() - t0 >= DELAY_S * 0.8
    assert torch.equal(t, torch.full((4,), 2.0))


def test_a_collective_wait_ends_when_the_generation_is_aborted(pair):
    store, group, peer = pair("silent")
    group.abort_check = lambda: store.check(["gen/0/abort"])
    threading.Timer(0.3, lambda: store.set("gen/0/abort", "1")).start()
    t0 = time.perf_counter()
    with pytest.raises(PeerFailure, match="declared the generation broken"):
        group.all_reduce(torch.ones(4))
    assert time.perf_counter() - t0 < 5.0  # not the 30 s group timeout
    peer.kill()  # the abandoned all-reduce then fails at once instead of holding the group
    peer.join(10)
