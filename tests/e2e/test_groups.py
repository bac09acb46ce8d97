"""Process-group generations: waits that outlast a wait slice, the abort flag, and leaving.

A peer (a child process, rank 0) delays its side of an operation by several wait slices; the
test process is rank 1. Collective waits are sliced (to look at the abort flag in between) and
must survive any number of expired slices; point-to-point receives must not be sliced at all,
because gloo closes the pair when a receive's wait expires (the cause of a real bug: a state
transfer longer than one slice broke every grow of a 25 M-parameter model).

No wait outlives its generation: a member that leaves with an operation still in flight, or that
gives up on one because the generation was declared broken, releases its peers at once, and its
own close does not wait for the abandoned operation (the cause of 120 s stalls after a SIGKILL:
a survivor waited for the group's timeout on a live peer that had left).
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


def _peer(port: int, op: str, delay_s: float, timeout_s: float) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=30))
    group = make_group(store, 0, 0, 2, timeout_s, torch.device("cpu"))
    if op in ("leaves_receiving", "silent_receiving"):
        # A member that has left the generation (or never joins its collective) while a receive
        # from the test process is still posted and waited for on a thread, as the pipeline
        # driver's receives are. It reports in the store when that receive ended.
        work = group.irecv(torch.zeros(4), 1, tag=9)

        def wait() -> None:
            try:
                work.wait()
                outcome = "completed"
            except PeerFailure as exc:
                outcome = str(exc)
            store.set("peer/outcome", outcome)

        threading.Thread(target=wait, daemon=True).start()
        time.sleep(delay_s)
        if op == "leaves_receiving":
            group.close()
        time.sleep(60)
        return
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

    def start(op: str, delay_s: float = DELAY_S, timeout_s: float = 30.0):
        p = mp.get_context("spawn").Process(target=_peer, args=(store.port, op, delay_s, timeout_s), daemon=True)
        p.start()
        procs.append(p)
        group = make_group(store, 0, 1, 2, timeout_s, torch.device("cpu"))
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


# The group timeout of the tests below. A wait that nobody releases ends with it, reading "Timed
# out waiting ..."; one released by a shut-down connection reads "Connection closed by peer".
LEFT_TIMEOUT_S = 20.0
RELEASED = "Connection closed by peer"


def _peer_outcome(store) -> str:
    """How the peer's own receive from the test process ended."""
    store.wait(["peer/outcome"], datetime.timedelta(seconds=LEFT_TIMEOUT_S + 10))
    return store.get("peer/outcome").decode()


def test_a_peer_that_left_with_a_receive_in_flight_releases_a_receive_from_it(pair):
    """The peer closes its group while its own receive still waits on a thread (whose work keeps
    gloo's connections alive): the close must still release this process's receive at once."""
    store, group, _ = pair("leaves_receiving", delay_s=0.3, timeout_s=LEFT_TIMEOUT_S)
    with pytest.raises(PeerFailure, match=RELEASED):
        group.recv(torch.empty(4), 0, tag=7)  # no abort check: only the peer's close can end it
    assert RELEASED in _peer_outcome(store)  # the peer's own receive ended with its close


def test_a_collective_given_up_on_the_abort_flag_releases_the_peer_and_closes_at_once(pair):
    """The survivor's side of the 120 s stall: its all-reduce waits on a live peer that has left
    (here: a peer that never joins it, waiting itself on a receive from the survivor). The abort
    flag ends the wait, and then neither the peer's receive nor the survivor's close may wait for
    the abandoned all-reduce (gloo's destructor waits for a collective in flight)."""
    store, group, _ = pair("silent_receiving", delay_s=0.0, timeout_s=LEFT_TIMEOUT_S)
    group.abort_check = lambda: store.check(["gen/0/abort"])
    threading.Timer(0.3, lambda: store.set("gen/0/abort", "1")).start()
    with pytest.raises(PeerFailure, match="declared the generation broken"):
        group.all_reduce(torch.ones(4))
    assert RELEASED in _peer_outcome(store)
    closer = threading.Thread(target=group.close, daemon=True)
    closer.start()
    closer.join(LEFT_TIMEOUT_S / 2)  # a close that waits for the all-reduce takes the whole timeout
    assert not closer.is_alive() and group.pg is None


def test_a_receive_from_a_live_peer_that_left_ends_on_the_abort_flag(pair):
    """A state transfer from a member that has left the generation (alive, waiting on a receive of
    its own): the receiver gives up on the abort flag, and that releases the peer too."""
    store, group, _ = pair("silent_receiving", delay_s=0.0, timeout_s=LEFT_TIMEOUT_S)
    group.abort_check = lambda: store.check(["gen/0/abort"])
    threading.Timer(0.3, lambda: store.set("gen/0/abort", "1")).start()
    buf = torch.zeros(4)
    with pytest.raises(PeerFailure, match="declared the generation broken.*during a receive"):
        group.recv(buf, 0, tag=7)
    assert RELEASED in _peer_outcome(store)
    assert torch.equal(buf, torch.zeros(4))  # nothing arrived, and nothing will write into it later


def test_builds_that_overlap_in_one_process_track_no_sockets():
    """Ranks of one group run as threads of one process connect to each other inside their builds:
    the builds must run at once (taking turns deadlocked them until gloo's connect timeout), and
    the sockets each finds new cannot be told apart, so only a build that ran alone tracks any."""
    from virtualflow.comm.groups import _Builds

    b = _Builds()
    alone = b.begin()
    assert b.end(*alone)  # nothing else ran: its new sockets are its own
    first = b.begin()
    second = b.begin()  # starts while the first runs
    assert not b.end(*second) and not b.end(*first)
    outer = b.begin()
    inner = b.begin()
    assert not b.end(*inner)
    later = b.begin()  # starts after inner ended, while outer still runs
    assert not b.end(*outer) and not b.end(*later)
    assert b.end(*b.begin())  # and alone again afterwards
