"""The owners exchange's send thread (``virtualflow.comm.exchange._Sender``): the sends of CPU
tensors are started off the step's thread, in the order handed over; their works come back to be
waited for; a failed send fails the step where its works are collected, and does not leak into
the next step."""

from __future__ import annotations

import threading

import pytest
import torch

from virtualflow.comm import exchange
from virtualflow.comm.groups import PeerFailure


class Recorder:
    """A stand-in group: records (thread, dst, tag) of each started send; fails at ``fail_at``."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.started: list[tuple[str, int, int]] = []
        self.fail_at = fail_at
        self.gate = threading.Event()
        self.gate.set()

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0):
        self.gate.wait(10)
        if self.fail_at is not None and len(self.started) == self.fail_at:
            self.started.append((threading.current_thread().name, dst, tag))
            raise PeerFailure(0, "connection closed by peer")
        self.started.append((threading.current_thread().name, dst, tag))
        return ("work", dst, tag)


def test_sends_start_off_the_callers_thread_in_the_order_handed_over():
    group, sender = Recorder(), exchange._Sender()
    group.gate.clear()  # the thread cannot start a send until the caller has handed over all of them
    for tag in range(6):
        sender.post(group, torch.zeros(4), tag % 2, tag)
    assert group.started == []  # handing over returned at once
    group.gate.set()
    works = sender.drain()
    assert works == [("work", t % 2, t) for t in range(6)]
    assert [t for _, _, t in group.started] == list(range(6))
    assert {name for name, _, _ in group.started} == {"vf-exchange-send"}
    assert sender.drain() == []  # collected once


def test_a_failed_send_is_raised_at_drain_and_the_rest_are_not_started():
    group, sender = Recorder(fail_at=2), exchange._Sender()
    for tag in range(5):
        sender.post(group, torch.zeros(4), 1, tag)
    with pytest.raises(PeerFailure, match="connection closed by peer"):
        sender.drain()
    assert [t for _, _, t in group.started] == [0, 1, 2]
    # the next step starts clean
    ok = Recorder()
    sender.post(ok, torch.zeros(4), 1, 7)
    assert sender.drain() == [("work", 1, 7)]


def test_forget_waits_for_what_was_handed_over_and_drops_it():
    group, sender = Recorder(fail_at=0), exchange._Sender()
    sender.post(group, torch.zeros(4), 1, 0)
    sender.post(group, torch.zeros(4), 1, 1)
    sender.forget()  # (a step abandoned after its sends were handed over)
    assert sender.drain() == []


def test_an_idle_thread_ends_and_a_new_one_starts_with_the_next_send(monkeypatch):
    monkeypatch.setattr(exchange, "SENDER_IDLE_S", 0.01)
    group, sender = Recorder(), exchange._Sender()
    sender.post(group, torch.zeros(4), 1, 0)
    assert sender.drain() == [("work", 1, 0)]
    first = sender._thread
    if first is not None:
        first.join(5)
        assert not first.is_alive()
    assert sender._thread is None
    sender.post(group, torch.zeros(4), 1, 1)
    assert sender.drain() == [("work", 1, 1)]


class Work:
    """A stand-in for gloo's work object, which can be referred to weakly."""


def test_the_thread_never_holds_a_works_last_reference_and_close_stops_it():
    """gloo's work releases the interpreter lock while it is destroyed, and a daemon thread that
    destroys one as the interpreter exits aborts the process: the works go to the caller, whose
    dropping them destroys them while the send thread is still alive; close() ends the thread."""
    import gc
    import weakref

    class Group:
        def isend(self, tensor, dst, tag=0):
            return Work()

    sender = exchange._Sender()
    sender.post(Group(), torch.zeros(4), 1, 0)
    works = sender.drain()
    ref = weakref.ref(works[0])
    thread = sender._thread
    assert thread is not None and thread.is_alive()
    del works
    gc.collect()
    assert ref() is None  # the caller held the last reference, not the (still running) thread
    sender.close()
    assert not thread.is_alive() and sender._thread is None
    sender.post(Group(), torch.zeros(4), 1, 1)  # a send after close starts a new thread
    assert len(sender.drain()) == 1 and sender._thread is not thread
    sender.close()
