"""Which workers are gone: exits seen through the launcher, silence seen through heartbeats.

:class:`Liveness` is the membership controller's watch over its workers. Every tick
(:meth:`Liveness.judge`) it polls the launcher's exit codes, and :data:`SWEEPS_PER_TIMEOUT` times
per heartbeat timeout it reads every joined worker's heartbeat counter in the store (one call);
a step recorded for the first time is a beat of each of its members (:meth:`Liveness.stepped`:
they all entered its all-reduce, and they skip the beats their steps stand in for). It returns
the workers that failed, each with its cause in words, and kills a worker silent for longer than ``heartbeat_timeout_s`` (fencing: a worker
judged dead must not come back and write).

Invariants: a worker is judged once (``gone`` holds every worker whose exit or kill was
handled); a planned departure (``leaving``, exit code 0) and the clean exits after the job's
last step are not failures; a clean exit seen before the worker's last reports were read is
judged one tick later, after those reports.
"""

from __future__ import annotations

from typing import Any, Iterable

from virtualflow.comm import protocol
from virtualflow.control.membership.interface import WorkerLauncher, describe_exit
from virtualflow.runtime.channel import ABORT_MARK

SWEEPS_PER_TIMEOUT = 8
"""How often the heartbeat counters are read: ``SWEEPS_PER_TIMEOUT`` times per
``heartbeat_timeout_s`` (every 0.375 s with the 3 s default), not at every monitor tick (20 a
second): the sweep reads W counters, the monitor's largest cost that grows with W. A silent worker
is judged within ``heartbeat_timeout_s`` x (1 + 1/SWEEPS_PER_TIMEOUT) plus one tick."""


class Liveness:
    """Exit codes and heartbeats of the controller's workers (see the module docstring)."""

    def __init__(self, launcher: WorkerLauncher, store: Any, heartbeat_timeout_s: float) -> None:
        self.launcher = launcher
        self.store = store
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.gone: set[int] = set()  # exited or killed, handled
        self.fenced: set[int] = set()
        """Workers killed for silence: possibly still alive somewhere (a partition, a machine the
        launcher cannot reach), so whatever they send later must be refused."""
        self.leaving: set[int] = set()  # told to leave: a clean exit is expected
        self._exited_0: set[int] = set()  # seen exiting with code 0 one tick ago
        self._hb: dict[int, tuple[int, float]] = {}  # joined worker -> (heartbeat count, when it last changed)
        self._swept = float("-inf")  # when the counters were last read (:data:`SWEEPS_PER_TIMEOUT`)

    def joined(self, worker: int, now: float) -> None:
        """``worker`` reported ``join``: its heartbeats are watched from now on (not once it is
        gone: a join read after its exit was judged)."""
        if worker in self.gone:
            return
        self._hb[worker] = (_counter(self.store.add(protocol.heartbeat_key(worker), 0)), now)

    def stepped(self, members: Iterable[int], now: float) -> None:
        """A step of ``members`` was recorded for the first time (rank 0's report, read at
        ``now``): each of them was alive when it entered the step's all-reduce, so it counts as
        a beat (the members skip the beats their steps stand in for:
        :func:`~virtualflow.runtime.channel.next_beat_at`). O(members) per step."""
        hb = self._hb
        for w in members:
            seen = hb.get(w)
            if seen is not None:
                hb[w] = (seen[0], now)

    def watched(self) -> list[int]:
        """The workers whose heartbeats are watched (joined, not gone, not leaving): those an
        abort marks (:meth:`~virtualflow.control.coordinator.Coordinator.abort`)."""
        return list(self._hb)

    def _beats(self, workers: list[int]) -> list[Any]:
        """The heartbeat counters of ``workers`` (each created by :meth:`joined`), read in one round
        trip (``multi_get``): one store call per worker per tick made the monitor's cost grow as
        W x 20 calls a second. A counter is compared, not interpreted: a value someone else wrote
        there is only a change. A store without ``multi_get`` (a test's fake) is asked per key."""
        if not workers:
            return []
        multi_get = getattr(self.store, "multi_get", None)
        if multi_get is None:
            return [_counter(self.store.add(protocol.heartbeat_key(w), 0)) for w in workers]
        return [_counter(raw) for raw in multi_get([protocol.heartbeat_key(w) for w in workers])]

    def forget(self, worker: int) -> None:
        """Stop watching ``worker``'s heartbeats (it failed, or leaves)."""
        self._hb.pop(worker, None)

    def leave(self, worker: int) -> None:
        """``worker`` was told to leave: its clean exit is expected, its silence is not a failure."""
        self.leaving.add(worker)
        self._hb.pop(worker, None)

    def _exit_cause(self, worker: int) -> str | None:
        exit_cause = getattr(self.launcher, "exit_cause", None)
        return exit_cause(worker) if callable(exit_cause) else None

    def wedged(self, worker: int) -> None:
        """``worker`` is judged wedged (alive but making no progress: :mod:`.watchdog`): killed where
        the launcher can, and treated as a silent one (fenced: it may come back and write)."""
        self.launcher.kill_worker(worker)
        self.gone.add(worker)
        self.fenced.add(worker)
        self._hb.pop(worker, None)

    def judge(self, now: float, finished: bool) -> dict[int, str]:
        """The workers that failed since the last tick, each with its cause (silent ones killed)."""
        failed: dict[int, str] = {}
        ended: list[int] = []  # judged gone at this tick (the others left ``_hb`` when they were)
        for wid, code in self.launcher.poll().items():
            if code is None or wid in self.gone:
                continue
            if code == 0 and not finished and wid not in self.leaving and wid not in self._exited_0:
                # A clean exit seen before the worker's last reports were read (rank 0 posts
                # "done" and exits at once): judge it at the next tick, after those reports.
                self._exited_0.add(wid)
                continue
            self.gone.add(wid)
            ended.append(wid)
            if wid in self.leaving and code == 0:
                self.leaving.discard(wid)
                continue
            if finished and code == 0:
                continue
            # A backend that judged the worker itself (an external worker silent after its
            # welcome) says why; such a worker may be alive somewhere: fenced like a silent one.
            cause = self._exit_cause(wid)
            if cause is not None:
                self.fenced.add(wid)
            failed[wid] = cause or describe_exit(code)
        if finished:
            return failed
        for wid in ended:  # O(exits) a tick, not O(W)
            self._hb.pop(wid, None)
        if now - self._swept < self.heartbeat_timeout_s / SWEEPS_PER_TIMEOUT:
            return failed
        self._swept = now
        watched = list(self._hb)
        for wid, value in zip(watched, self._beats(watched)):
            count, t_seen = self._hb[wid]
            if value != count:
                self._hb[wid] = (value, now)
            elif now - t_seen > self.heartbeat_timeout_s:
                done = self.launcher.kill_worker(wid) or "killed"  # external workers: fenced out, not killed
                failed[wid] = f"stopped responding (no heartbeat for {now - t_seen:.1f} s); {done}"
                self.gone.add(wid)
                self.fenced.add(wid)
                del self._hb[wid]
        return failed


def _counter(raw: bytes | int) -> int | bytes:
    """A heartbeat counter as the store keeps it (decimal text) as a number of beats, below the
    coordinator's abort marks (:data:`~virtualflow.runtime.channel.ABORT_MARK`: a mark is not a
    beat); anything else as it is (it still differs from the last value read, so it reads as a
    change, never as an error)."""
    try:
        return int(raw) % ABORT_MARK
    except ValueError:
        return raw
