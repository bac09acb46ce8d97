"""A simulated fleet: hundreds of workers that speak the real control-plane protocol to the real
coordinator and membership controller, and train nothing.

The coordinator side is :class:`bench.harness.fleet_plane.ControlPlane`, the launcher's own
loop in miniature over the real coordinator and membership controller; its launcher asks this
fleet for workers.

The worker side (:class:`FleetClient`) runs every simulated worker as a small state machine in
one thread, each with its own store connection, signing its reports with the run key through
the real :class:`~virtualflow.runtime.channel.Reporter`: join, then, on a thread of its own
while it regroups (the real worker's main thread blocks there; a fleet's members regroup at the
same time, not one after another), wait for the signed next pointer (the store's ``wait``), read
it and the generation record, report ``arrived`` and take part in the rendezvous as the real
worker does (:func:`~virtualflow.runtime.channel.rendezvous`, imported: count in, wait on the
generation's ready key, one abort check), form, train (a step is
``step_s`` of waiting; rank 0 sends the full step report), follow the control sequence (a
``regroup`` or ``stop`` takes effect at the step boundary after rank 0 has read it), abandon a
generation whose abort flag is set or whose member died (``fault``), leave when told, report
``done``; a member other than rank 0 reads each command the step announces itself, as the real
worker does. The heartbeat threads are :class:`Beater` loops (threads, or processes for large
fleets), each worker with a second connection as in the real worker, beating at the pace of the
real worker's law (:func:`~virtualflow.runtime.channel.heartbeat_interval_s`, imported): it
bumps ``vf/hb/<id>``, on rank 0 reads the control sequence and follows new commands, and
checks the formed generation's abort flag when the counter's abort marks moved (once per
abort and generation: the beat is one call). What a collective would tell the members (a peer
died, the agreed step) the fleet knows in memory: no gloo groups. Nobody polls the store but the
heartbeats. Deaths come as messages: ``exit`` (the process is gone: the launcher sees an exit code) or ``silent`` (a
partition: the worker stops speaking and beating, the launcher sees nothing).

Invariants: every store call of the fleet and of the coordinator is counted (:class:`Counting`:
calls and bytes), so a benchmark reads the store's load per step; the fleet's training progress
is one counter (``step``), applied once per boundary of the one generation that trains, so a
step recorded twice or never is the coordinator's doing, not the fleet's.
"""

from __future__ import annotations

import datetime
import queue
from concurrent.futures import ThreadPoolExecutor
import threading
import time
import traceback
from dataclasses import dataclass, field, fields
from typing import Any

import torch.distributed as dist

from virtualflow.comm import protocol
from virtualflow.runtime.channel import ABORT_MARK, Reporter, heartbeat_interval_s, next_beat_at, rendezvous
from virtualflow.runtime.worker_config import WorkerConfig

HEARTBEAT_INTERVAL_S = {f.name: f.default for f in fields(WorkerConfig)}["heartbeat_interval_s"]
"""The real worker's heartbeat interval (``WorkerConfig.heartbeat_interval_s``'s default)."""


_COUNT_LOCK = threading.Lock()


class Counting:
    """A store wrapper that counts calls and the bytes of values moved (keys not counted);
    thread-safe counting (the fleet's waits run on threads of their own)."""

    def __init__(self, store: Any, counts: dict[str, float]) -> None:
        self._store, self.counts = store, counts

    def _n(self, nbytes: int = 0) -> None:
        with _COUNT_LOCK:
            self.counts["ops"] = self.counts.get("ops", 0) + 1
            self.counts["bytes"] = self.counts.get("bytes", 0) + nbytes

    def set(self, key: str, value: Any) -> None:
        self._n(len(value))
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        value = self._store.get(key)
        self._n(len(value))
        return value

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._n(sum(len(v) for v in values))
        self._store.multi_set(keys, values)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self._store.multi_get(keys)
        self._n(sum(len(v) for v in values))
        return values

    def add(self, key: str, n: int) -> int:
        self._n()
        return self._store.add(key, n)

    def check(self, keys: list[str]) -> bool:
        self._n()
        return self._store.check(keys)

    def queue_push(self, key: str, value: Any) -> None:
        self._n(len(value))
        self._store.queue_push(key, value)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        value = self._store.queue_pop(key, block=block)
        self._n(len(value))
        return value

    def queue_len(self, key: str) -> int:
        self._n()
        return self._store.queue_len(key)

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        self._n()
        self._store.wait(keys, timeout)

    def __getattr__(self, name: str) -> Any:  # port, ...: passed through, not counted
        return getattr(self._store, name)


@dataclass(slots=True)
class FleetSpec:
    """What every simulated worker needs to reach the job (what a real one gets in its config)."""

    host: str
    port: int
    key: str
    job: str
    step_s: float
    total_steps: int
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    """The base of the heartbeat's law (the real worker's ``heartbeat_interval_s``)."""
    timeout_s: float = 3.0
    """The smaller of the job's heartbeat and coordinator timeouts (the law's cap)."""
    initial_workers: int = 1
    """The fleet's size before a worker is in a generation (the real worker's ``initial_workers``)."""
    beaters: int = 1
    """Heartbeat loops (threads in one process; processes with :func:`start_fleet`)."""
    pool: int = 0
    """0: every worker has its own connections (two, as a real worker); n: the client's workers
    share n connections and each beater uses one (small in-process fleets: fewer connections)."""


class Connections:
    """Store connections: a new one per call, or round robin over a pool of ``pool``."""

    def __init__(self, spec: FleetSpec, counts: dict[str, float], pool: int) -> None:
        self.spec, self.counts, self.pool = spec, counts, pool
        self._pool: list[Counting] = []

    def __call__(self) -> "Counting":
        if not self.pool:
            return Counting(connect(self.spec), self.counts)
        if len(self._pool) < self.pool:
            self._pool.append(Counting(connect(self.spec), self.counts))
            return self._pool[-1]
        self._pool.append(self._pool.pop(0))
        return self._pool[-1]


def connect(spec: FleetSpec) -> dist.TCPStore:
    return dist.TCPStore(spec.host, spec.port, is_master=False, timeout=datetime.timedelta(seconds=60))


class Beater:
    """The heartbeat threads of a slice of the fleet, one loop: per worker, at the interval the
    real worker's law gives it (:func:`~virtualflow.runtime.channel.heartbeat_interval_s`: its
    rank in the formed generation and that generation's size), what ``runtime/channel.py``'s
    ``Heartbeat`` does (beat; on rank 0, read the control sequence and follow new commands; check
    the formed generation's abort flag when the counter's abort marks moved). Messages:
    ``("beat", wid)``, ``("quiet", wid)``, ``("watch", g, members)``, ``("stepped", g, t)`` (the
    members of ``g`` completed a step at ``time.monotonic()`` ``t``: a member other than rank 0
    beats next an interval after it, as the real worker does:
    :func:`~virtualflow.runtime.channel.next_beat_at`), ``("stop",)``."""

    def __init__(self, spec: FleetSpec, inbox: Any, outbox: Any, name: str) -> None:
        self.spec, self.inbox, self.outbox, self.name = spec, inbox, outbox, name
        self.counts: dict[str, float] = {}
        self.connect = Connections(spec, self.counts, 1 if spec.pool else 0)
        self.run = protocol.RunKey(spec.key, spec.job)
        self.stores: dict[int, Any] = {}
        self.seen: dict[int, int] = {}
        self.watch: int | None = None
        self.ranks: dict[int, int] = {}  # worker -> rank in the watched generation
        self.size = spec.initial_workers
        self.due: dict[int, float] = {}  # worker -> when it last beat
        self.stepped = float("-inf")  # when the watched generation last completed a step
        self.marks: dict[int, tuple[int, int]] = {}  # worker -> (generation, abort marks) its flag was read at
        self.beats = 0

    def loop(self) -> None:
        try:
            self._loop()
        except Exception:  # noqa: BLE001 - the benchmark must see why its fleet stopped
            self.outbox.put(("error", self.name, traceback.format_exc()))

    def _loop(self) -> None:
        while True:
            while True:
                try:
                    msg = self.inbox.get_nowait()
                except queue.Empty:
                    break
                if msg[0] == "stop":
                    return
                if msg[0] == "stats":
                    self.outbox.put(("stats", self.name, {**self.counts, "beats": self.beats}))
                elif msg[0] == "beat":
                    self.stores[msg[1]] = self.connect()
                    self.seen[msg[1]], self.due[msg[1]] = 0, 0.0
                elif msg[0] == "quiet":
                    self.stores.pop(msg[1], None)
                elif msg[0] == "watch":
                    self.watch, self.size = msg[1], len(msg[2])
                    self.ranks = {w: r for r, w in enumerate(msg[2])}
                    self.stepped = float("-inf")
                elif msg[0] == "stepped" and msg[1] == self.watch:
                    self.stepped = msg[2]
            now = time.monotonic()
            wake = now + self.spec.heartbeat_interval_s
            paces = [heartbeat_interval_s(self.size, self.spec.heartbeat_interval_s, self.spec.timeout_s, follows)
                     for follows in (False, True)]
            for wid, store in list(self.stores.items()):
                rank = self.ranks.get(wid)
                interval = paces[rank == 0]
                due = next_beat_at(self.due[wid], self.stepped, interval, rank is None or rank == 0)
                if now >= due:
                    self.beat(wid, store, rank == 0)
                    self.due[wid] = now
                    due = now + interval
                wake = min(wake, due)
            time.sleep(min(self.spec.heartbeat_interval_s, max(0.0, wake - time.monotonic())))

    def beat(self, wid: int, store: Any, follows: bool) -> None:
        marks = int(store.add(protocol.heartbeat_key(wid), 1)) // ABORT_MARK
        self.beats += 1
        seq = (protocol.parse_seq(store.get(protocol.CONTROL_SEQ_KEY)) or 0) if follows else 0
        while self.seen[wid] < seq:
            n = self.seen[wid] + 1
            if not store.check([protocol.control_key(n)]):
                break
            protocol.parse_command(self.run, store.get(protocol.control_key(n)), n)
            self.seen[wid] = n
        g = self.watch
        if g is not None and self.marks.get(wid) != (g, marks):  # the flag, once per mark and generation
            self.marks[wid] = (g, marks)
            if store.check([protocol.abort_key(g)]):
                protocol.parse_abort(self.run, store.get(protocol.abort_key(g)), g)


@dataclass(slots=True)
class SimWorker:
    """One simulated worker's protocol state (its heartbeat is a :class:`Beater`'s)."""

    wid: int
    store: Any
    report: Reporter
    state: str = "next"  # next | regrouping | ready | training | gone
    after: int = -1  # the generation whose next pointer it reads
    gen: int = -1
    rank: int = -1
    silent: bool = False


WAIT_TIMEOUT_S = 60.0
"""How long a simulated worker waits in one store ``wait`` (its next pointer: it waits again;
its rendezvous: the generation is given up, as the real worker does after ``store_timeout_s``)."""


@dataclass(slots=True)
class SimGeneration:
    """A generation as the fleet knows it: its record, its members through the rendezvous
    (``ready``: the group is checked only once they all are, not once per member), when it
    formed, its next step boundary and the control position its members have acted on."""

    record: protocol.GenerationRecord
    ready: set[int] = field(default_factory=set)
    formed_at: float | None = None
    boundary: float = 0.0
    control: int = 0


class FleetClient:
    """Every simulated worker, in one loop (see the module docstring). ``inbox`` takes
    ``("start", wid)``, ``("kill", wid)``, ``("die", wid, "exit"|"silent")``, ``("stats",)`` and
    ``("stop",)``; ``outbox`` gets ``("exit", wid, code)`` and ``("stats", source, counts)`` (from
    the client and from each beater)."""

    def __init__(self, spec: FleetSpec, inbox: Any, outbox: Any, beater_inboxes: list[Any]) -> None:
        self.spec, self.inbox, self.outbox, self.beaters = spec, inbox, outbox, beater_inboxes
        self.run = protocol.RunKey(spec.key, spec.job)
        self.counts: dict[str, float] = {}
        self.connect = Connections(spec, self.counts, spec.pool)
        self.workers: dict[int, SimWorker] = {}
        self.gens: dict[int, SimGeneration] = {}
        self.lock = threading.Lock()  # self.gens, between the members' regroup threads
        self.step = 0  # the fleet's training state: steps applied
        self.training: int | None = None  # the generation that trains
        self.last_report: dict[str, Any] | None = None
        # rank 0's heartbeat, following commands (counted apart: heartbeat calls, not the members')
        self.control_counts: dict[str, float] = {}
        self.control = Counting(connect(spec), self.control_counts)
        self.control_seq, self.commands = 0, {}
        self.follow_due = self.abort_due = 0.0
        self.done: queue.Queue[tuple[SimWorker, str]] = queue.Queue()  # (worker, how its regroup ended)
        # A regrouping worker holds a thread: at most every worker of the fleet (W + W/8 <= 1,152
        # in the benchmark) regroups at once.
        self.threads = ThreadPoolExecutor(max_workers=4096, thread_name_prefix="fleet-member")
        self.pending: list[SimWorker] = []  # in state "next", not regrouping yet
        self.forming: set[int] = set()  # generations with a released member, not formed yet
        self.forming_due = 0.0
        self.applied: list[int] = []  # every step applied, in order (the fleet's own check)
        self.push_s: list[float] = []  # rank 0's step report pushes: what the step path pays

    # -- the loop -------------------------------------------------------------------------------
    def loop(self) -> None:
        try:
            self._loop()
        except Exception:  # noqa: BLE001 - the benchmark must see why its fleet stopped
            self.outbox.put(("error", "client", traceback.format_exc()))

    def _loop(self) -> None:
        while True:
            now = time.monotonic()
            if not self._messages():
                return
            self._regrouped(now)
            while self.pending:  # workers due to look for their next generation
                w = self.pending.pop()
                if w.state == "next" and not w.silent and self.workers.get(w.wid) is w:
                    self._regroup(w)
            self._forming(now)
            self._train(now)
            time.sleep(0.0005)

    def _messages(self) -> bool:
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return True
            if msg[0] == "stop":
                for b in self.beaters:
                    b.put(("stop",))
                return False
            if msg[0] == "stats":
                for b in self.beaters:
                    b.put(("stats",))
                c = self.control_counts
                ops = self.counts.get("ops", 0)
                self.outbox.put(("stats", "client", {"ops": ops + c.get("ops", 0), "member_ops": ops,
                                                   "bytes": self.counts.get("bytes", 0) + c.get("bytes", 0),
                                                   "step": self.step, "applied": list(self.applied),
                                                   "push_s": self.push_s[-2000:]}))
            elif msg[0] == "start":
                store = self.connect()
                w = self.workers[msg[1]] = SimWorker(msg[1], store, Reporter(store, self.run, msg[1]))
                self._beater(w.wid).put(("beat", w.wid))
                w.report({"type": "join", "setup_s": 0.0, "dataset": None})
                self.pending.append(w)
            elif msg[0] in ("kill", "die"):
                w = self.workers.get(msg[1])
                if w is not None and w.state != "gone":
                    self._beater(w.wid).put(("quiet", w.wid))
                    if msg[0] == "die" and msg[2] == "silent":
                        w.silent = True
                    else:
                        w.state = "gone"
                        if msg[0] == "die":
                            self.outbox.put(("exit", w.wid, -9))

    def _beater(self, wid: int) -> Any:
        return self.beaters[wid % len(self.beaters)]

    def _exit(self, w: SimWorker, code: int) -> None:
        w.state = "gone"
        self._beater(w.wid).put(("quiet", w.wid))
        self.outbox.put(("exit", w.wid, code))

    # -- one worker's protocol --------------------------------------------------------------------
    def _regroup(self, w: SimWorker) -> None:
        """Hand ``w``'s way into its next generation to a thread of its own, as the real worker's
        main thread does it (it blocks in the store's ``wait``; the members of a fleet do it at
        the same time, not one after another)."""
        w.state = "regrouping"
        if self.spec.pool and w.after == -1:  # blocking calls need the worker's own connection
            w.store = w.report.store = Counting(connect(self.spec), self.counts)
        self.threads.submit(self._regroup_thread, w)

    def _regroup_thread(self, w: SimWorker) -> None:
        try:
            self.done.put((w, self._next_generation(w)))
        except Exception:  # noqa: BLE001 - the benchmark must see why its fleet stopped
            self.outbox.put(("error", f"worker {w.wid}", traceback.format_exc()))

    def _next_generation(self, w: SimWorker) -> str:
        """The real worker's ``next_generation`` and ``_form`` up to its group: wait for the
        signed next pointer, read it and the generation record, report ``arrived``, and
        :func:`~virtualflow.runtime.channel.rendezvous` (imported). Returns ``ready``, ``fault``,
        ``leave``, ``exit`` or ``stopped`` (the worker died or fell silent meanwhile)."""
        key = protocol.next_key(w.wid, w.after)
        while True:
            try:
                w.store.wait([key], datetime.timedelta(seconds=WAIT_TIMEOUT_S))
                break
            except Exception:  # noqa: BLE001 - torch's DistStoreError: timed out; wait again
                if w.state != "regrouping" or w.silent:
                    return "stopped"
        if w.state != "regrouping" or w.silent:
            return "stopped"
        to = protocol.parse_next(self.run, w.store.get(key), w.wid, w.after)
        if to == protocol.FAIL:
            return "exit"
        if to.startswith(protocol.LEAVE):
            return "leave"
        g = int(to)
        raw = w.store.get(protocol.generation_key(g))  # every member reads the record itself
        with self.lock:
            if g not in self.gens:
                self.gens[g] = SimGeneration(protocol.parse_generation(self.run, raw, g))
            record = self.gens[g].record
        w.gen, w.rank, w.after = g, record.members.index(w.wid), g
        w.report({"type": "arrived", "generation": g})
        if not rendezvous(w.store, g, len(record.members), WAIT_TIMEOUT_S, lambda: self._aborted(w.store, g)):
            return "fault"
        return "ready"

    def _regrouped(self, now: float) -> None:
        """Workers whose regroup ended go on (one gone or silent meanwhile stays so)."""
        while True:
            try:
                w, outcome = self.done.get_nowait()
            except queue.Empty:
                return
            if w.state != "regrouping" or w.silent or self.workers.get(w.wid) is not w or outcome == "stopped":
                continue
            if outcome == "exit":
                self._exit(w, 0)
            elif outcome == "leave":
                w.report({"type": "leave", "step": self.step})
                self._exit(w, 0)
            elif outcome == "fault":
                self._fault(w, "regroup")
            else:
                w.state = "ready"
                self.forming.add(w.gen)
                gen = self.gens[w.gen]
                gen.ready.add(w.wid)
                if len(gen.ready) == len(gen.record.members):
                    self._maybe_form(w.gen, now)

    def _forming(self, now: float) -> None:
        """What a forming group tells its ready members, at the heartbeat's pace: a peer that
        exited breaks it at once (gloo's connection fails); a silent one, once the coordinator's
        abort flag says so (one check per generation: members share what a collective would)."""
        if now < self.forming_due or not self.forming:
            return
        self.forming_due = now + self.spec.heartbeat_interval_s
        for g in list(self.forming):
            members = self._members(g)
            if any(m.state == "training" for m in members) or all(m.state != "ready" for m in members):
                self.forming.discard(g)
                continue
            if any(m.state == "gone" for m in members) or (any(m.silent for m in members)
                                                           and self._aborted(self.control, g)):
                self.forming.discard(g)
                for m in members:
                    if m.state == "ready" and m.gen == g:
                        self._fault(m, "regroup")

    def _aborted(self, store: Any, g: int) -> bool:
        key = protocol.abort_key(g)
        if not store.check([key]):
            return False
        protocol.parse_abort(self.run, store.get(key), g)
        return True

    def _fault(self, w: SimWorker, phase: str) -> None:
        w.report({"type": "fault", "generation": w.gen, "phase": phase, "step": self.step, "error": "simulated"})
        w.state, w.after = "next", w.gen
        self.pending.append(w)
        if w.gen in self.gens:
            self.gens[w.gen].ready.discard(w.wid)

    def _members(self, g: int) -> list[SimWorker]:
        return [self.workers[m] for m in self.gens[g].record.members]

    def _maybe_form(self, g: int, now: float) -> None:
        members = self._members(g)
        if any(m.state != "ready" or m.gen != g for m in members):
            return
        gen = self.gens[g]
        gen.formed_at, gen.boundary, gen.control = now, now + self.spec.step_s, self.control_seq
        self.training = g
        for m in members:
            m.state = "training"
        for b in self.beaters:
            b.put(("watch", g, list(gen.record.members)))
        rank0 = members[0]
        rank0.store.set(protocol.formed_key(g), "1")
        rank0.report({"type": "formed", "generation": g, "members": gen.record.members, "step": self.step,
                      "hold": gen.record.hold, "group_s": 0.0, "transfer_s": 0.0, "bytes": 0, "source": None,
                      "receivers": [], "form_s": now - gen.formed_at, "time": time.time(),
                      "exchange": None, "exchange_reason": None})
        if self.last_report is not None:  # the most advanced member re-sends the last step record
            rank0.report(self.last_report)

    # -- the generation that trains -----------------------------------------------------------------
    def _follow(self, now: float) -> None:
        """Rank 0's heartbeat: follow the control sequence (verified, in order)."""
        if now < self.follow_due:
            return
        self.follow_due = now + self.spec.heartbeat_interval_s
        seq = protocol.parse_seq(self.control.get(protocol.CONTROL_SEQ_KEY)) or 0
        while self.control_seq < seq:
            n = self.control_seq + 1
            self.commands[n] = protocol.parse_command(self.run, self.control.get(protocol.control_key(n)), n)
            self.control_seq = n

    def _train(self, now: float) -> None:
        self._follow(now)
        g = self.training
        if g is None:
            return
        gen, members = self.gens[g], self._members(g)
        alive = [m for m in members if m.state == "training" and not m.silent]
        if len(alive) < len(members):
            # A peer is gone: the collective breaks at once for an exit; a silent peer hangs it
            # until the coordinator's abort flag (read by rank 0's heartbeat) tells the members.
            exited = any(m.state == "gone" for m in members)
            if not exited and now < self.abort_due:
                return
            self.abort_due = now + self.spec.heartbeat_interval_s
            if exited or self._aborted(self.control, g):
                self.training = None
                for m in alive:
                    self._fault(m, "step")
            return
        if now < gen.boundary:
            return
        self.applied.append(self.step)
        self.step += 1
        for b in self.beaters:  # every member completed the step's all-reduce: their next beats move on
            b.put(("stepped", g, time.monotonic()))
        report = {"type": "step", "step": self.step - 1, "loss": 1.0 / self.step, "samples": len(gen.record.members),
                  "step_time_s": self.spec.step_s, "workers": len(members), "generation": g,
                  "vns": gen.record.assignment, "members": gen.record.members,
                  "compute_s": [self.spec.step_s] * len(members), "vn_sizes": gen.record.vn_sizes, "time": time.time(),
                  "metrics": {}, "grad_norm": None, "skipped": False, "loss_scale": None, "lr": 0.1,
                  "peak_tflops": None, "stop_reason": None}
        self.last_report = report
        t_push = time.perf_counter()
        members[0].report(report)
        self.push_s.append(time.perf_counter() - t_push)
        gen.boundary += self.spec.step_s
        ops = [self.commands[n]["op"] for n in range(gen.control + 1, self.control_seq + 1)]
        for m in members[1:]:  # the others read what the reduction announced (rank 0 followed it)
            for n in range(gen.control + 1, self.control_seq + 1):
                protocol.parse_command(self.run, m.store.get(protocol.control_key(n)), n)
        gen.control = self.control_seq
        if self.step >= self.spec.total_steps or "stop" in ops:
            for m in members:
                m.report({"type": "done", "step": self.step, "rank": m.rank, "peak_rss_mib": 0.0,
                          "peak_device_mib": None, "optimizer_bytes": 0, "replica_bytes": 0,
                          "replica_refresh_s": 0.0, "redundant_forwards": {}})
                self._exit(m, 0)
            self.training = None
        elif "regroup" in ops:
            self.training = None
            for m in members:
                m.state, m.after = "next", g
                self.pending.append(m)


def start_fleet(spec: FleetSpec, inbox: Any, outbox: Any, ctx: Any) -> tuple[list[Any], list[Any]]:
    """The fleet in processes of ``ctx`` (``multiprocessing`` spawn): the client loop in one, its
    beaters in ``spec.beaters`` others; returns them (started, daemons) and the beaters' queues,
    which the caller keeps until the processes end (a queue collected here before a spawned child
    has opened it is gone for the child)."""
    boxes = [ctx.Queue() for _ in range(spec.beaters)]
    procs = [ctx.Process(target=run_beater, args=(spec, box, outbox, f"beater{i}"), daemon=True)
             for i, box in enumerate(boxes)]
    procs.append(ctx.Process(target=run_client, args=(spec, inbox, outbox, boxes), daemon=True))
    for p in procs:
        p.start()
    return procs, boxes


def run_client(spec: FleetSpec, inbox: Any, outbox: Any, boxes: list[Any]) -> None:
    FleetClient(spec, inbox, outbox, boxes).loop()


def run_beater(spec: FleetSpec, inbox: Any, outbox: Any, name: str) -> None:  # (spawn needs named targets)
    Beater(spec, inbox, outbox, name).loop()


def in_process_fleet(plane: Any, step_s: float, beaters: int = 1,
                     heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S, pool: int = 4) -> tuple[threading.Thread, list[Any]]:
    """The fleet of ``plane`` as threads of this process (tests, small fleets; ``pool`` shared
    connections, see :attr:`FleetSpec.pool`): returns the client thread and the beaters' threads
    (stopped by a ``("stop",)`` in ``plane.inbox``)."""
    spec = FleetSpec(step_s=step_s, heartbeat_interval_s=heartbeat_interval_s, beaters=beaters, pool=pool,
                     **plane.spec_fields)
    boxes: list[Any] = [queue.Queue() for _ in range(beaters)]
    threads = [threading.Thread(target=Beater(spec, box, plane.outbox, f"beater{i}").loop, daemon=True)
               for i, box in enumerate(boxes)]
    client = threading.Thread(target=FleetClient(spec, plane.inbox, plane.outbox, boxes).loop, daemon=True)
    for t in threads + [client]:
        t.start()
    return client, threads
