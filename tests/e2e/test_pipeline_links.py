"""The pipeline driver's receive waits (runtime/pipeline/receive_wait.py, ``wait_receive``).

A receive of a group with an abort flag and known connections (a worker's group) is waited for on
the driver's own thread, with one watcher thread per process reading the flag, instead of a
thread per message: the flag must still end a receive from a live peer that has left the
generation, and an undisturbed receive must complete with its data. The peer is a child process
(rank 0), the test process rank 1, as in test_groups.py (whose peer and fixture these reuse).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from test_groups import LEFT_TIMEOUT_S, RELEASED, _peer_outcome, pair  # noqa: F401  (pair: a fixture)
from virtualflow.comm.groups import PeerFailure
from virtualflow.runtime.pipeline.receive_wait import wait_receive as _wait_receive


def _arrival_threads() -> int:
    return sum(t.name == "vf-recv-arrival" for t in threading.enumerate())


def test_a_watched_receive_from_a_live_peer_that_left_ends_on_the_abort_flag(pair):
    store, group, _ = pair("silent_receiving", delay_s=0.0, timeout_s=LEFT_TIMEOUT_S)
    assert len(group.connections)  # known connections: the driver's thread waits itself
    group.abort_check = lambda: store.check(["gen/0/abort"])
    threading.Timer(0.3, lambda: store.set("gen/0/abort", "1")).start()
    buf = torch.zeros(4)
    before = _arrival_threads()
    t0 = time.perf_counter()
    with pytest.raises(PeerFailure, match="declared the generation broken.*during a receive"):
        _wait_receive(group, group.irecv(buf, 0, tag=7))
    assert time.perf_counter() - t0 < 5.0  # not the group's timeout
    assert _arrival_threads() == before  # no thread per message
    assert RELEASED in _peer_outcome(store)  # the abort released the peer's own receive too
    assert torch.equal(buf, torch.zeros(4))


def test_a_watched_receive_outlasting_the_watchers_checks_completes(pair):
    store, group, _ = pair("send", delay_s=0.6)  # the peer sends after 0.6 s: several flag reads
    reads = []
    group.abort_check = lambda: reads.append(1) or False
    buf = torch.empty(1 << 20)
    _wait_receive(group, group.irecv(buf, 0, tag=7))
    assert torch.equal(buf, torch.arange(1 << 20, dtype=torch.float32))
    assert reads  # the flag was read while the receive waited
