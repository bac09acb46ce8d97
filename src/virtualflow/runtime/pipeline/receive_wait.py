"""Waiting for a pipeline receive on the driver's own thread, abortable by the generation's flag.

A thread per received message (:class:`~virtualflow.comm.groups.Arrival`) costs its start and two
more context switches per hop (measured in ``bench/pipeline``); :func:`wait_receive` waits on the
calling thread instead, while one :class:`Watcher` thread per process reads the abort flag of
every group a receive is blocked on and aborts a group whose generation was declared broken (its
connections shut down, which ends the blocked wait at once).

Invariant: a receive waited for here ends either with its message or with a
:class:`~virtualflow.comm.groups.PeerFailure` (the coordinator's verdict when the flag was set).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from virtualflow.comm.groups import ARRIVAL_POLL_S, Arrival, Group, PeerFailure

__all__ = ["WATCHER", "Watcher", "flag_set", "wait_receive"]


class Watcher:
    """Reads the abort flag of every group a driver thread is blocked on in a receive, so that the
    receive can be waited for on the driver's own thread instead of a thread per message.

    One daemon thread per process, started at the first watched wait; a thread blocked in a
    receive registers (:meth:`blocked`) and, every ``ARRIVAL_POLL_S``, its group's ``abort_check``
    is read (once the wait is ``_FIRST_CHECK_S`` old, as :class:`Arrival` reads it). A True read
    aborts the group (its connections shut down), which ends the blocked wait at once with an
    error; the waiter then raises the coordinator's verdict. Used only where an abort does end a
    wait (a group whose connections are known); elsewhere :class:`Arrival` owns the wait. The
    thread parks after ``_IDLE_S`` without a registration, so an idle process is not woken."""

    _FIRST_CHECK_S = 0.05
    _IDLE_S = 30.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waits: dict[int, tuple[Group, float]] = {}
        self._aborted: set[int] = set()
        self._next = 0
        self._last_seen = 0.0
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def blocked(self, group: Group) -> int:
        """The calling thread is about to block in a receive on ``group``: a token for :meth:`done`."""
        now = time.monotonic()
        with self._lock:
            self._next += 1
            token = self._next
            self._waits[token] = (group, now)
            self._last_seen = now
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, daemon=True, name="vf-recv-watch")
                self._thread.start()
            elif not self._wake.is_set():
                self._wake.set()  # parked: resume reading flags
        return token

    def done(self, token: int) -> bool:
        """The wait of ``token`` is over; True when this watcher aborted its group meanwhile."""
        with self._lock:
            self._waits.pop(token, None)
            if token in self._aborted:
                self._aborted.discard(token)
                return True
        return False

    def _run(self) -> None:
        self._wake.set()
        while True:
            if not self._wake.wait(self._IDLE_S):
                continue
            time.sleep(ARRIVAL_POLL_S)
            now = time.monotonic()
            with self._lock:
                due = [(token, group) for token, (group, since) in self._waits.items()
                       if now - since >= self._FIRST_CHECK_S]
                if not self._waits and now - self._last_seen > self._IDLE_S:
                    self._wake.clear()  # park until the next registration
            for token, group in due:
                check = group.abort_check
                try:
                    broken = check is not None and check()  # True aborts the group
                except Exception:  # an unreadable flag: the group's timeout stays the bound
                    broken = False
                if broken:
                    with self._lock:
                        if token in self._waits:
                            self._aborted.add(token)


WATCHER = Watcher()


def wait_receive(group: Group, work: Any) -> None:
    """Wait for a posted receive. Without an ``abort_check`` (nothing to watch) and where an abort
    ends a blocked wait (the group knows its connections) the driver's thread waits itself, as a
    hand-written pipeline does: a thread per message costs its start and two more context
    switches per hop (measured in ``bench/pipeline``). Elsewhere (ranks run as threads of one
    process: no connections known) an :class:`Arrival` owns the wait and the caller watches the
    flag."""
    if group.abort_check is None:
        work.wait()
        return
    if not len(group.connections):
        Arrival(work).wait(group)
        return
    token = WATCHER.blocked(group)
    try:
        work.wait()
    except PeerFailure:
        # The flag may be set but not yet seen by the watcher while a peer that did see it has
        # left (its connection closed): the abort, not the closed connection, is the cause.
        if WATCHER.done(token) or flag_set(group):
            raise PeerFailure(group.generation, "the coordinator declared the generation broken (a member failed) "
                                                "during a receive") from None
        raise
    if WATCHER.done(token):  # completed just as the group was aborted: the group is broken all the same
        raise PeerFailure(group.generation, "the coordinator declared the generation broken (a member failed) "
                                            "during a receive")


def flag_set(group: Group) -> bool:
    try:
        return bool(group.abort_check())
    except Exception:  # noqa: BLE001 - a store that cannot answer says nothing about the flag
        return False
