"""A worker's side of the control plane: its signed reports out, and what it reads back.

:class:`Reporter` signs and numbers this worker's reports; :class:`Rejections` notes (bounded)
what the worker refused from the store; :class:`Heartbeat` is the thread that beats, follows
the verified control sequence and watches the current generation's abort flag, off the step's
critical path, at the pace :func:`heartbeat_interval_s` sets (its law bounds what a fleet's
heartbeats cost the store); :func:`aborted` reads a verified abort flag; :func:`rendezvous` waits for a generation's
members (the store wakes them: no polling); :func:`connect_store`
opens the worker's connection to the job's store, naming the address when it cannot. Protocol and
signatures are in :mod:`virtualflow.comm.protocol`.
"""

from __future__ import annotations

import collections
import datetime
import hashlib
import logging
import os
import socket
import threading
import time
from typing import Any, Callable

import torch.distributed as dist

from virtualflow.comm import protocol
from virtualflow.comm.rejects import RejectLog
from virtualflow.runtime.worker_config import WorkerConfig

logger = logging.getLogger("virtualflow.runtime.worker")


class Reporter:
    """Signs and sends this worker's reports, numbered 1, 2, ... (the coordinator accepts each
    number once and in order, so a report queued again is refused). Called from the main thread
    only (one store client, so reports arrive in the order they are numbered); other threads
    hand their reports in with :meth:`queue`, sent with the next report or :meth:`flush`."""

    def __init__(self, store: dist.Store, run: protocol.RunKey, worker_id: int) -> None:
        self.store, self.run, self.worker = store, run, worker_id
        self.pid = os.getpid()
        self.seq = 0
        self._queued: collections.deque[dict[str, Any]] = collections.deque()

    def __call__(self, message: dict[str, Any]) -> None:
        self.flush()
        self._push(message)

    def queue(self, message: dict[str, Any]) -> None:
        self._queued.append(message)

    def flush(self) -> None:
        while self._queued:
            self._push(self._queued.popleft())

    def _push(self, message: dict[str, Any]) -> None:
        self.seq += 1
        protocol.push_report(self.store, self.run, {**message, "worker": self.worker, "pid": self.pid, "seq": self.seq})


class Rejections:
    """What this worker refused from the store: noted once per distinct value of a key, logged
    (bounded: :class:`~virtualflow.comm.rejects.RejectLog`) and reported to the coordinator.
    Thread-safe."""

    def __init__(self, reporter: Reporter | None) -> None:
        self.reporter = reporter
        self._lock = threading.Lock()
        self._seen: dict[str, bytes] = {}
        self.log = RejectLog(self._report, logger)

    def __call__(self, channel: str, key: str, raw: bytes, reason: Exception) -> None:
        digest = hashlib.sha256(raw if isinstance(raw, bytes) else repr(raw).encode()).digest()
        with self._lock:
            if self._seen.get(key) == digest:
                return  # read again while waiting for the coordinator's own value: noted already
            if len(self._seen) > 1024:
                self._seen.clear()
            self._seen[key] = digest
            self.log(f"{channel.partition(' ')[0]}_rejected", reason, raw, channel=channel, key=key)

    def _report(self, event: str, **fields: Any) -> None:
        if self.reporter is None or event == "rejections_suppressed":
            return  # the count is in this worker's own log
        self.reporter.queue({"type": "rejected", "channel": str(fields.get("channel", "")),
                             "reason": str(fields.get("reason", "")), "message": str(fields.get("message", "")),
                             "bytes": int(fields.get("bytes") or 0)})


def aborted(store: dist.Store, run: protocol.RunKey, generation: int, rejections: Rejections) -> bool:
    """True when the coordinator has declared ``generation`` broken (a verified abort flag)."""
    key = protocol.abort_key(generation)
    if not store.check([key]):
        return False
    raw = store.get(key)
    try:
        protocol.parse_abort(run, raw, generation)
        return True
    except ValueError as exc:
        rejections(f"abort {generation}", key, raw, exc)
        return False


def rendezvous(store: dist.Store, generation: int, size: int, timeout_s: float, aborted: Callable[[], bool]) -> bool:
    """Wait until every one of the ``size`` members of ``generation`` has arrived; False when the
    generation was aborted meanwhile (or did not complete within ``timeout_s``).

    A member counts itself in (``vf/gen/<g>/arrived``); the one whose arrival completes the
    count sets ``vf/gen/<g>/ready`` (:func:`~virtualflow.comm.protocol.ready_key`), and so does
    the coordinator when it aborts the generation (after the signed abort flag). Every member
    waits on that one key with the store's blocking ``wait``: the store wakes it, nobody polls,
    so a rendezvous costs the store's one thread three calls per member (add, wait, the abort
    check after waking) whatever W, instead of a poll every 20 ms per member for as long as the
    slowest one takes (at W = 1,024 that polling alone was about 50,000 calls a second)."""
    arrived = int(store.add(protocol.arrived_key(generation), 1))
    if size == 1:
        return True
    if arrived >= size:
        store.set(protocol.ready_key(generation), "1")
    try:
        store.wait([protocol.ready_key(generation)], datetime.timedelta(seconds=timeout_s))
    except RuntimeError:  # torch's DistStoreError: the wait timed out (a member never came)
        return False
    return not aborted()


HEARTBEATS_PER_S = 1000.0
"""The beats a second a whole fleet may send the store once it is past ``50`` workers (20 a
second each at the base interval): the store serves every call on one thread, so its load, not
the coordinator's own work, is what a thousand workers beating every 50 ms would cost (about
60,000 calls a second)."""

ABORT_MARK = 1 << 32
"""What the coordinator adds to the heartbeat counter of every worker it watches when it declares
a generation broken (:meth:`~virtualflow.control.coordinator.Coordinator.abort`): the beat's own
``add`` then tells the worker that some abort flag changed, so a beat is one store call and the
signed flag is read only when the counter's high part moved (once per abort, and once per
generation watched). The coordinator compares counters below the mark only: the mark is not a
beat."""

BEATS_PER_TIMEOUT = 4
"""A live worker beats at least this many times within ``heartbeat_timeout_s`` (and within
``coordinator_timeout_s``): a beat or three delayed by a loaded machine is not a death."""


def heartbeat_interval_s(workers: int, base_s: float, timeout_s: float, follows: bool) -> float:
    """Seconds between two beats of one worker of a fleet of ``workers``: the law of the heartbeat.

    ``base_s`` (50 ms) for the worker that follows the control sequence (``follows``: rank 0,
    whose position goes into the step's reduction, so a command still lands within ``base_s``)
    and in fleets of up to ``HEARTBEATS_PER_S x base_s`` (50) workers; beyond, ``workers /
    HEARTBEATS_PER_S``, so the fleet's beats stay at :data:`HEARTBEATS_PER_S` a second whatever
    its size, but never longer than ``timeout_s / BEATS_PER_TIMEOUT`` (``timeout_s``: the smaller
    of the heartbeat and coordinator timeouts): failure detection stays bounded by the heartbeat
    timeout. Past ``HEARTBEATS_PER_S x timeout_s / BEATS_PER_TIMEOUT`` workers (750 with the
    3 s default) the cap wins and the fleet's rate grows again as ``BEATS_PER_TIMEOUT x workers /
    timeout_s`` (1,365 a second at 1,024): a larger fleet keeps the store's load bounded by
    raising ``heartbeat_timeout_s``."""
    if follows:
        return base_s
    return max(base_s, min(workers / HEARTBEATS_PER_S, timeout_s / BEATS_PER_TIMEOUT))


def next_beat_at(last_beat: float, stepped: float, interval_s: float, follows: bool) -> float:
    """When a worker's next beat is due: ``interval_s`` after its last beat or, for a member
    that does not follow the control sequence (``follows``: rank 0 beats at its own pace
    whatever its steps do), after the last step it completed, whichever came later.

    A completed step is a liveness event of every member: the step's statistics all-reduce (the
    one-step core, every layout) returns on no member until all of them have entered it, so
    rank 0's step report tells the coordinator that each member was alive then
    (:meth:`Liveness.stepped <virtualflow.control.membership.liveness.Liveness.stepped>`). Beats
    and steps together stay at most ``interval_s`` apart, the same evidence the coordinator had
    from beats alone, and a fleet whose steps are shorter than the interval stops beating at steady
    state (one beat per step at most otherwise): the store's heartbeat load falls from
    ``W / interval`` to what the steps leave, and comes back at once when the steps stop."""
    return (last_beat if follows else max(last_beat, stepped)) + interval_s


class Heartbeat:
    """A daemon thread on its own store client: bumps ``vf/hb/<id>`` every
    :func:`heartbeat_interval_s` (the worker's ``heartbeat_interval_s`` as its base, the fleet's
    size and the smaller of ``heartbeat_timeout_s`` and ``coordinator_timeout_s``), and, on rank
    0 only, follows the control sequence.

    A stopped or frozen process stops beating and the coordinator fences it. Following the control
    sequence here keeps the store round trips off the step's critical path: rank 0's thread reads
    and verifies new commands in order (:attr:`control_seq` is the last one that verified, with
    all before it, or the position the generation agreed on when it formed; :attr:`commands`
    holds them), rank 0 puts that number into the step's reduction, so every member still acts
    on a command at the same boundary (a command waits at most one base interval longer) and none
    acts on a forged one. The other members read a command the reduction announces themselves
    (:meth:`Worker._command <virtualflow.runtime.worker.Worker._command>`: one round trip per
    command, which is rare), so their beat is one store call: the counter, whose high part
    (:data:`ABORT_MARK`) moves when the coordinator aborts a generation; only then is the signed
    abort flag read. Without ``run`` (a benchmark of the
    heartbeat alone) it reads the same keys but follows nothing. If the coordinator itself is gone
    or cut off (the store has not answered for ``coordinator_timeout_s``), the worker exits with
    code 3: an orphan must not keep training (``virtualflow run --resume`` continues the job from
    its last checkpoint). A shorter outage is survived; whether the worker still counts is the
    coordinator's decision (its ``heartbeat_timeout_s``). It also watches
    the current generation's abort flag, so a step that can no longer complete is abandoned
    before its next virtual node rather than at its reduction (:meth:`broken`).
    """

    def __init__(self, cfg: WorkerConfig, worker_id: int, run: protocol.RunKey | None = None,
                 rejections: Rejections | None = None) -> None:
        self.cfg = cfg
        self.key = protocol.heartbeat_key(worker_id)
        self.run = run
        self.rejections = rejections if rejections is not None else Rejections(None)
        self.control_seq = 0
        self.commands: dict[int, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._generation: int | None = None
        self._rank: int | None = None  # in the watched generation (None: in none yet)
        self._workers = cfg.initial_workers  # the fleet's size, for the interval's law
        self._acted = 0  # the control position the watched generation agreed on when it formed
        self._marks: int | None = None  # the counter's abort marks when the watched flag was last read
        self._timeout_s = min(cfg.options.heartbeat_timeout_s, cfg.options.coordinator_timeout_s)
        self._broken = threading.Event()
        self._thread = threading.Thread(target=self._run, name="virtualflow-heartbeat", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="virtualflow-coordinator-watch", daemon=True)
        self._last_ok = time.monotonic()
        self._last_error = ""
        self._stepped = float("-inf")  # when this member last completed a step (:meth:`stepped`)

    def start(self) -> None:
        self._last_ok = time.monotonic()
        self._thread.start()
        self._watchdog.start()

    def stop(self) -> None:
        self._stop.set()

    def watch(self, generation: int, rank: int | None = None, workers: int | None = None, acted: int = 0) -> None:
        """From now on, also watch generation ``generation``'s abort flag (see :meth:`broken`), as
        its member of rank ``rank`` among ``workers`` (they set the pace: :meth:`interval_s`); rank
        0 follows the control sequence from ``acted`` on (the position the members agreed on)."""
        with self._lock:
            self._generation, self._rank, self._acted = generation, rank, acted
            self._marks = None  # a new generation's flag is read at the next beat
            self._stepped = float("-inf")  # only this generation's steps are liveness events
            if workers is not None:
                self._workers = workers
            self._broken.clear()

    def interval_s(self) -> float:
        """Seconds until the next beat (:func:`heartbeat_interval_s` for this worker now)."""
        with self._lock:
            workers, follows = self._workers, self._rank == 0
        return heartbeat_interval_s(workers, self.cfg.heartbeat_interval_s, self._timeout_s, follows)

    def stepped(self) -> None:
        """This member completed a step of the watched generation (its statistics all-reduce
        returned): a liveness event the coordinator also learns from rank 0's step report, so
        the next beat is due an interval after it (:func:`next_beat_at`)."""
        self._stepped = time.monotonic()

    def broken(self) -> bool:
        """True once the watched generation has been declared broken (read on the step path:
        no store round trip, the flag is polled by this thread)."""
        return self._broken.is_set()

    def _run(self) -> None:
        # A coordinator that is gone refuses at once: three failed calls in a row end the worker.
        # A store call on a connection whose peer is cut off (a partition: no reset, no answer)
        # can block for good whatever the client's timeout, so this thread also notes when it
        # last got through, and the watchdog (:meth:`_watch`) judges that silence.
        op_timeout = datetime.timedelta(seconds=max(0.2, min(5.0, self.cfg.options.coordinator_timeout_s / 3)))
        store = None
        misses = 0
        while not self._stop.is_set():
            try:
                if store is None:
                    store = dist.TCPStore(self.cfg.store_host, self.cfg.store_port, is_master=False,
                                          timeout=op_timeout)
                self._beat(store)
                self._last_ok = time.monotonic()
                misses = 0
            except Exception as exc:  # noqa: BLE001 - reconnect on the next beat
                store = None
                misses += 1
                self._last_error = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                if misses >= 3:  # refused three times in a row (each call failed, none hung): gone
                    print(f"virtualflow worker: the coordinator at {self.cfg.store_host}:{self.cfg.store_port} is "
                          f"unreachable ({self._last_error}); exiting", flush=True)
                    os._exit(3)
            self._wait_for_next_beat(time.monotonic())

    def _wait_for_next_beat(self, last_beat: float) -> None:
        """Sleep until the next beat is due (:func:`next_beat_at`), looking again when a wait
        ends: a step completed meanwhile moves the time on."""
        while True:
            with self._lock:
                follows = self._rank == 0 or self._rank is None  # outside a generation: no steps
            due = next_beat_at(last_beat, self._stepped, self.interval_s(), follows)
            wait_s = due - time.monotonic()
            if wait_s <= 0 or self._stop.wait(wait_s):
                return

    def _beat(self, store: dist.Store) -> None:
        """One beat: the counter; on rank 0, the control sequence; the watched abort flag, when
        the counter's abort marks moved since it was last read (:data:`ABORT_MARK`)."""
        marks = int(store.add(self.key, 1)) // ABORT_MARK
        with self._lock:
            g, follows, acted = self._generation, self._rank == 0, self._acted
            fresh = marks != self._marks
        seq = protocol.parse_seq(store.get(protocol.CONTROL_SEQ_KEY)) if follows else None
        if self.run is None:
            if g is not None:
                store.check([protocol.abort_key(g)])
            return
        self.control_seq = max(self.control_seq, acted)  # what the members acted on needs no reading
        if seq is not None and seq > self.control_seq:
            self.follow(store, seq)
        if g is not None and fresh:
            broken = aborted(store, self.run, g, self.rejections)
            with self._lock:
                if g == self._generation:
                    self._marks = marks
                    if broken:
                        self._broken.set()

    def _watch(self) -> None:
        """Exit the process (code 3) once the store has not answered for ``coordinator_timeout_s``:
        the coordinator is gone or cut off. A shorter outage is survived."""
        limit_s = self.cfg.options.coordinator_timeout_s
        while not self._stop.wait(min(0.25, limit_s / 10)):
            # A member whose steps complete skips its beats (:func:`next_beat_at`) and is not
            # blocked in any call: only time without either counts. An orphan still stops:
            # rank 0 always beats, exits when the coordinator is gone, and its peers' steps stop.
            silent_s = time.monotonic() - max(self._last_ok, self._stepped)
            if silent_s >= limit_s:
                why = f"; last error: {self._last_error}" if self._last_error else " (no answer)"
                print(f"virtualflow worker: the coordinator at {self.cfg.store_host}:{self.cfg.store_port} has been "
                      f"unreachable for {silent_s:.1f} s (coordinator_timeout_s={limit_s:g}){why}; exiting", flush=True)
                os._exit(3)

    def follow(self, store: dist.Store, seq: int) -> None:
        """Verify the commands after :attr:`control_seq`, in order, up to ``seq`` (at most 16 a
        beat); stop at the first that is missing or does not verify (a forged one is refused,
        and read again until the coordinator's own command replaces it)."""
        assert self.run is not None
        first = self.control_seq + 1
        for n in range(first, min(seq, first + 15) + 1):
            key = protocol.control_key(n)
            if not store.check([key]):
                return
            raw = store.get(key)
            try:
                command = protocol.parse_command(self.run, raw, n)
            except ValueError as exc:
                self.rejections(f"command {n}", key, raw, exc)
                return
            self.commands[n] = command
            self.commands.pop(n - 64, None)
            self.control_seq = n


STORE_REACH_TIMEOUT_S = 60.0
"""How long a starting worker tries to open a connection to the job's store before it gives up
naming the address (the store listens before any worker starts: no connection in this long
means the address is not reachable from this machine)."""


def connect_store(cfg: WorkerConfig, worker_id: int) -> dist.TCPStore:
    """The job's store; a store this machine cannot reach is a ``ConnectionError`` naming the
    address and the knob within :data:`STORE_REACH_TIMEOUT_S` (the store's own connect would
    retry for ``store_timeout_s``, 10 minutes by default)."""
    where = f"{cfg.store_host}:{cfg.store_port}"

    def unreachable(why: str) -> ConnectionError:
        return ConnectionError(
            f"worker {worker_id} ({socket.gethostname()}) cannot reach the job's store at {where}: {why}; the "
            f"coordinator listens there (listen= / --listen; on Ray, by default the driver's node address): that "
            f"address must be reachable from every worker's machine")

    deadline = time.monotonic() + min(cfg.store_timeout_s, STORE_REACH_TIMEOUT_S)
    while True:
        try:
            socket.create_connection((cfg.store_host, cfg.store_port), timeout=5.0).close()
            break
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise unreachable(exc.strerror or str(exc) or type(exc).__name__) from None
            time.sleep(0.2)
    try:
        return dist.TCPStore(cfg.store_host, cfg.store_port, is_master=False,
                             timeout=datetime.timedelta(seconds=cfg.store_timeout_s))
    except (RuntimeError, OSError) as exc:  # torch's DistNetworkError / DistStoreError are RuntimeErrors
        raise unreachable(str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)) from exc
