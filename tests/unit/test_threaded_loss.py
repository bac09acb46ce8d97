"""A member lost in the middle of a step of a threaded run (:func:`train_threads`): the survivors'
waits on it end because the generation's connections are shut down, not because a drain bound
ran out, and the run still trains the one-worker model bit for bit.

Ranks run as threads of one process build their gloo groups at the same time, so no group can
tell its own sockets apart and an abort alone shuts none down; the runner cuts every connection
of the broken generation whose both ends are in this process (:meth:`Connections.paired_between`),
and leaves any other socket alone."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys

import pytest
import torch

from jobs import regression_job
from virtualflow.comm import exchange as exchange_module
from virtualflow.comm import groups
from virtualflow.comm.connections import NATIVE, Connections
from virtualflow.config.worker_options import WorkerOptions
from virtualflow.runtime.grid_threads import Generation, train_threads


@pytest.mark.parametrize("workers,virtual_nodes,exchange", [(2, 4, "auto"), (3, 8, "owners"), (3, 8, "slots")])
def test_a_member_lost_mid_step_ends_the_survivors_waits_and_the_model_is_one_workers(
        caplog, monkeypatch, workers, virtual_nodes, exchange):
    """Without the cut, a survivor's wait on the lost member ends only when something else lets go
    of the lost member's group (its exchange's idle send thread after 10 s, the group's timeout):
    both are set far beyond the drain bound here, so a give-up that was not ended by the cut says
    so (the drain bound ran out) instead of passing by luck."""
    monkeypatch.setattr(groups, "DRAIN_S", 30.0)
    monkeypatch.setattr(exchange_module, "SENDER_IDLE_S", 600.0)
    job = regression_job("sgd", virtual_nodes=virtual_nodes, global_batch_size=32)
    options = WorkerOptions(deterministic=True, deterministic_exchange=exchange)
    members = tuple(range(workers))
    with caplog.at_level(logging.WARNING, logger="virtualflow"):
        run = train_threads(job, [Generation(members=members, steps=1, lost=members[-1]),
                                  Generation(members=members[:-1], steps=3)], options=options, timeout_s=600.0)
    expired = [r.getMessage() for r in caplog.records if "did not end within" in r.getMessage()]
    assert not expired, expired  # a survivor's give-up waited out the drain bound instead
    assert len(NATIVE) == 0  # no gloo wait outlives the run (one would abort the process at exit)
    one = train_threads(job, [Generation(members=(0,), steps=4)], options=WorkerOptions(deterministic=True))
    for name, value in one.state["model"].items():
        assert torch.equal(run.state["model"][name], value), name
    assert [o.loss for o in run.outcomes] == [o.loss for o in one.outcomes]


def _serve_once() -> tuple[subprocess.Popen, int]:
    """A process that accepts one connection and holds it until its standard input closes."""
    code = ("import socket, sys\n"
            "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(1)\n"
            "print(s.getsockname()[1], flush=True)\n"
            "c, _ = s.accept(); sys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


def test_paired_between_finds_connections_within_the_process_and_leaves_others_alone():
    proc, port = _serve_once()
    listener = socket.socket()
    try:
        before = Connections.snapshot()
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
        elsewhere = socket.create_connection(("127.0.0.1", port))  # its peer is another process
        store_like = socket.create_connection(listener.getsockname())  # both ends here, but the excluded port
        kept, _ = listener.accept()
        after = Connections.snapshot()
        found = Connections.paired_between(before, after, exclude_port=None)
        fds = {fd for fd, _ in found.sockets}
        assert {a.fileno(), b.fileno()} <= fds and elsewhere.fileno() not in fds
        excluded = Connections.paired_between(before, after, exclude_port=listener.getsockname()[1])
        assert {fd for fd, _ in excluded.sockets} == set()  # every in-process pair here ends at that port
        assert found.shut_down() == len(found)
        assert a.recv(1) == b"" and b.recv(1) == b""  # shut down: both ends read end-of-stream
        elsewhere.sendall(b"x")  # untouched
        for s in (a, b, elsewhere, store_like, kept):
            s.close()
    finally:
        listener.close()
        proc.stdin.close()
        proc.wait(timeout=30)


def test_the_drain_bound_running_out_is_said(caplog, monkeypatch):
    """An aborted wait whose operation does not end within the drain bound says so (a group whose
    connections could not be shut down), then gives up as before."""

    class Never:
        def wait(self) -> None:
            threading_event.wait()

    import threading

    threading_event = threading.Event()
    monkeypatch.setattr(groups, "DRAIN_S", 0.0)
    group = groups.Group(3, 0, 2, None)
    group.abort_check = lambda: True
    arrival = groups.Arrival(Never())
    try:
        with caplog.at_level(logging.WARNING, logger="virtualflow"), pytest.raises(groups.PeerFailure):
            arrival.wait(group, "receive")
    finally:
        threading_event.set()
    assert any("generation 3: a receive on the aborted group did not end within" in r.getMessage()
               for r in caplog.records)


def test_native_calls_settle_waits_for_every_call_to_leave():
    """The count the runner waits on before it returns: a call still inside keeps it from
    settling, and its leaving settles it."""
    import threading

    calls = type(NATIVE)()
    inside, leave = threading.Event(), threading.Event()

    def call() -> None:
        with calls:
            inside.set()
            leave.wait(30)

    t = threading.Thread(target=call)
    t.start()
    inside.wait(30)
    assert len(calls) == 1 and not calls.settle(0.0)
    leave.set()
    assert calls.settle(30.0) and len(calls) == 0
    t.join(30)
