"""The cluster service's process layer: rounds in real time, jobs through the public API.

:class:`Service` is a loop over rounds of ``round_s`` seconds. At a round's start it reads the
database (new submissions, cancellations), builds a :class:`~virtualflow.service.core.JobView`
per active job, asks the pure :class:`~virtualflow.service.core.Scheduler` for the round's
decision, records it (``rounds`` and ``allocations`` tables) and enacts its actions with the
public API, on the local backend (or on a Ray cluster: see below). **No job code runs in this
process**: each start runs :func:`virtualflow.launch` in a driver process of its own
(:mod:`virtualflow.service.launcher`: it imports, builds and checks the job under a time limit and
hosts its coordinator); this process sees the job through that driver's JSON lines only.

- ``start``: :func:`virtualflow.launch` (in the job's driver) with the placement's worker count, the type's slowdown
  for every worker (``slowdowns=``, emulated accelerator types), ``checkpoint_every`` and, when
  the job's run directory holds a state, ``resume=`` it;
- ``resize`` (elastic jobs, same type): :meth:`JobHandle.resize` in place; a newcomer gets the
  type's slowdown (:meth:`JobHandle.set_slowdown`) as soon as it is a member;
- ``preempt``: :meth:`JobHandle.stop` (the state reached is written: ``final.pt``), the job is
  queued again and resumes from it when next placed;
- ``restart``: preempt, then start on the new placement.

Stops run in threads of their own (:class:`Stopping`): a job being stopped keeps its slots
(pinned) until it has stopped, a start that needs them waits, and the loop goes on meanwhile. A
job is **hung** when it makes no step for longer than its own step time allows
(:mod:`virtualflow.service.watchdog`): it is killed and recorded failed; a stop is bounded by the
same limit.

During the round it polls every job (``poll_s``): progress and loss go to the database; a job
that ended is recorded done, a job that crashed is recorded failed (alone: its slots are free at
the next round); a cancelled one is stopped. The steps a job makes after its workers formed are
its **measured throughput** on that (type, workers), folded into the job's estimates at the end
of the round. Without active jobs the service idles and starts a round as soon as a job arrives.

On a **Ray cluster** (``cluster start --backend ray --address ADDR``) a slot of type ``T`` is one
unit of the Ray custom resource ``T``: every worker of a job placed on ``T`` is a Ray actor asking
for ``{T: 1}`` (and ``--cpus-per-worker`` CPUs), so Ray puts it on a node that has a ``T`` free.
The types' slowdowns then only inform the estimates (the hardware is real); ``--emulate-slowdowns``
applies them to the workers as on the local backend. The service checks at ``cluster start`` and at
every start that the Ray cluster has at least as many units of each type as the slots claim, and
the CPUs for all slots busy at once (:func:`ray_slot_shortage`); the service is the actors' owner,
so Ray ends them if the service dies.

**Deadlines** (``submit --deadline``): each round, after the policy's decision,
:func:`virtualflow.service.deadlines.admit` gives jobs that would otherwise miss their deadline
the slots of jobs with no deadline or a later one (earliest deadline first); the service keeps
each deadline job's estimated time to finish up to date (``eta_s``, for ``queue`` and the
dashboard) and records one ``deadline_missed`` event for a job whose deadline passes unfinished.

Crash safety: the database is the truth. A service that was killed (SIGKILL) and started again
closes the rounds left open, waits for the processes of the jobs it ran to exit (each driver sees
the service's pipe close and stops its job with the state written) and kills those still there
that are verifiably the job's (a marker in their environment, their start time: never a process
picked by its name), then records a job whose run directory says it completed as done (never run
again) and queues the others to resume from their newest state file (the steps after it are
recomputed, bit-identically in deterministic mode, and recorded once). ``cluster stop`` stops every
job with its state written and queues it, so nothing is lost across a planned stop either.
When the service cannot write its database (the disk is full) it pauses, saying so in one line,
and goes on once there is room (:meth:`Service.pause_for_space`); it never records a job failed
because it could not write.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from virtualflow.cluster.policies.base import get_policy
from virtualflow.service.core import (PRIOR_STEPS_PER_S, Action, JobView, RoundDecision, Scheduler, diff_actions,
                                      mechanism_knobs, mechanism_of, prior_rate, recovery_action, type_slowdowns,
                                      update_estimates)
from virtualflow.service.deadlines import admit, eta_s, newly_missed
from virtualflow.backends.orphans import wait_orphans as _wait_orphans  # noqa: F401 - the old name, for tests
from virtualflow.backends.placement import (Placement, check_ray_cluster, placement_from_config, placement_of,
                                            ray_slot_shortage)
from virtualflow.service.launcher import ChildJob
from virtualflow.service.state import ClusterDB, JobRow
from virtualflow.service.tables import gavel_table
from virtualflow.service.watchdog import HangRule, StepClock

log = logging.getLogger(__name__)

LOCK_NAME = "service.lock"

SERVICE_FREE_BYTES = 64 * 1024 * 1024
"""Free space the service asks for on its database's file system after "database or disk is full"
before it goes on (the database grows by its write-ahead log; 64 MiB is ample for many rounds)."""


RESOURCE_BACKOFF_S = (15.0, 600.0)
"""A job whose start failed because the *service* ran short of a process resource (descriptors,
processes, memory) is placed again after the first figure, doubling at each repeat up to the
second: the shortage is the machine's, not the job's, so it never fails the job for good."""


def short_of_resources(exc: BaseException) -> bool:
    """Whether ``exc`` says this process (or the machine) ran out of descriptors, processes or
    memory: EMFILE, ENFILE, EAGAIN (fork), ENOMEM. Transient, and no fault of the job's."""
    import errno

    return isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOMEM)


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` is SQLite's (or the OS's) "out of space"."""
    import errno

    if isinstance(exc, sqlite3.OperationalError):
        return "disk is full" in str(exc)  # SQLITE_FULL: "database or disk is full"
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


@dataclass
class Running:
    """A job this service runs now."""

    handle: Any
    acc_type: str
    workers: int
    slots: tuple[str, ...]
    slowdown: float
    slowed: set[int] = field(default_factory=set)
    """Worker ids that have their slowdown."""
    samples: list[tuple[float, int]] = field(default_factory=list)
    """(time, step) since the current (type, workers) formed."""
    last_step: int = -1
    last_write_s: float = 0.0
    start_step: int | None = 0
    """The step it started from (a job still there when preempted is killed: nothing to save);
    None until its driver has built the job and reported it."""
    started_s: float = 0.0
    clock: StepClock | None = None
    """Its step progress since the launch (the hang watch: :mod:`virtualflow.service.watchdog`)."""
    start_event: dict[str, Any] | None = None
    """The ``start`` event's data, recorded (dated ``started_s``) once the job reports its step."""


@dataclass
class Stopping:
    """A job being stopped (preempted, moved, cancelled, or at shutdown) in a thread of its own:
    it keeps its slots until its stop has ended, the loop goes on meanwhile."""

    run: Running
    kind: str
    """``preempt``, ``restart``, ``cancel``, ``quarantine``, ``shutdown`` (recorded when it ends) or ``call``
    (a caller of :meth:`Service._stop_all` records it)."""
    reason: str
    then: Action | None = None
    """A restart's start, done once the stop has ended (if the job goes on)."""
    thread: threading.Thread | None = None
    outcome: tuple[Any, BaseException | None] | None = None
    """(Result or None, error or None) once the stop has ended."""


class ServiceLock:
    """One service per cluster directory: an exclusive ``flock`` on ``service.lock`` held for the
    service's lifetime (released by the kernel when the process dies, SIGKILL included)."""

    def __init__(self, cluster_dir: str) -> None:
        self.path = os.path.join(cluster_dir, LOCK_NAME)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise ValueError(f"a cluster service already runs in {cluster_dir} (it holds {self.path}); stop it "
                             f"with virtualflow cluster stop --dir {cluster_dir}") from None
        os.ftruncate(self.fd, 0)
        os.write(self.fd, str(os.getpid()).encode())

    @staticmethod
    def held(cluster_dir: str) -> bool:
        path = os.path.join(cluster_dir, LOCK_NAME)
        if not os.path.exists(path):
            return False
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def release(self) -> None:
        os.close(self.fd)


class Service:
    """The service of one cluster directory (created by ``cluster start``: see :func:`init_cluster`)."""

    def __init__(self, cluster_dir: str, *, poll_s: float = 0.25, launch: Callable[..., Any] | None = None) -> None:
        self.dir = os.path.abspath(cluster_dir)
        self.db = ClusterDB(self.dir)
        cfg = self.db.config()
        self.slots: dict[str, int] = {str(k): int(v) for k, v in cfg["slots"].items()}
        self.types = tuple(self.slots)
        self.policy_name: str = cfg["policy"]
        self.round_s = float(cfg["round_s"])
        self.overrides: dict[str, float] = {str(k): float(v) for k, v in (cfg.get("slowdowns") or {}).items()}
        self.threads = int(cfg.get("threads_per_worker", 1))
        self.min_run_s = float(cfg.get("min_run_s", 0.0))
        self.placement: Placement = placement_from_config(cfg)
        """Where the slots are (local or Ray), chosen once here: :mod:`virtualflow.backends.placement`."""
        self.emulate = self.placement.emulates_slowdowns
        """Whether workers get their type's slowdown (always on the local backend, where types are
        emulated; on Ray only with ``--emulate-slowdowns``: the types are real resources there)."""
        self.poll_s = poll_s
        self.launch = launch
        """``launch(target, **options) -> handle``; None (the default): each job runs under a child
        process of its own (:class:`virtualflow.service.launcher.ChildJob`): this process never
        imports, builds or runs a job's code."""
        self.launch_timeout_s = float(cfg.get("launch_timeout_s", 60.0))
        """How long a job's driver may take to import, build and check the job before it fails."""
        self.hang = HangRule(factor=float(cfg.get("hang_factor", 10.0)), floor_s=float(cfg.get("hang_floor_s", 120.0)),
                             first_step_s=float(cfg.get("hang_first_step_s", 600.0)))
        self.settle_s = min(2.0, self.round_s / 4)
        """How long the enactment of a round waits for its stops before it goes on without them."""
        self.stops: dict[int, Stopping] = {}
        """Jobs being stopped (see :class:`Stopping`)."""
        self.pending: list[Action] = []
        """Starts waiting for slots that jobs being stopped still hold."""
        self.paused: str | None = None
        """Why the service is paused (it cannot write its database), or None."""
        self._no_space: dict[int, float] = {}
        """Jobs that ended for lack of space -> the free bytes at their run directory then: they
        are not placed again before ``SERVICE_FREE_BYTES`` more are free there."""
        self._held: dict[int, tuple[float, int]] = {}
        """Jobs whose start failed for want of the service's own resources -> (monotonic time before
        which they are not placed again, how many times in a row): see ``RESOURCE_BACKOFF_S``."""
        self.mechanism = mechanism_of(cfg.get("mechanism"), self.round_s)
        self.scheduler = Scheduler(self.slots, get_policy(self.policy_name), round_s=self.round_s,
                                   mechanism=self.mechanism)
        self.table = gavel_table()  # per-job-type slowdowns (submit --job-type) come from it too
        self.default_slowdowns = type_slowdowns(self.types, self.table, self.overrides)
        self.running: dict[int, Running] = {}
        self.round_id: int | None = None
        self._job_slowdowns: dict[int, dict[str, float]] = {}
        self._stop = False
        self._prior = PRIOR_STEPS_PER_S  # the scheduler's rate for unmeasured jobs, as of the last round
        self._deadlines_checked_s = 0.0

    # -- set-up and recovery ---------------------------------------------------------------
    def slowdowns_of(self, row: JobRow) -> dict[str, float]:
        got = self._job_slowdowns.get(row.id)
        if got is None:
            got = self.default_slowdowns
            if row.job_type is not None and self.table.has(row.job_type, 1):
                got = type_slowdowns(self.types, self.table, self.overrides, job_type=row.job_type)
            self._job_slowdowns[row.id] = got
        return got

    def recover(self) -> None:
        """After a crash: close open rounds, wait for orphaned workers, settle every job that was
        running (done, or queued to resume)."""
        now = time.time()
        self.db.close_open_rounds(now)
        rows = self.db.jobs(("running",))
        self.placement.reap_orphans([row.run_dir for row in rows])
        for row in rows:
            summary = _read_json(os.path.join(row.run_dir, "summary.json"))
            has_state = _has_state(row.run_dir)
            what = recovery_action(row.state, summary, has_state, row.steps,
                                   _final_step(row.run_dir) if has_state else None)
            if what == "done":
                self.db.set_job_state(row.id, "done", event="done", finished_s=now, steps_done=row.steps,
                                      acc_type=None, workers=0, slots=[])
                log.info("job %d had completed before the service stopped: recorded done", row.id)
            else:
                self.db.set_job_state(row.id, "queued", event="requeued", acc_type=None, workers=0, slots=[],
                                      info={"reason": f"service restarted ({what})"})
                log.info("job %d was running when the service stopped: queued to %s", row.id,
                         "resume from its newest state" if has_state else "start again")
        self.db.settle(now)  # a cancel made while the service was down: cancelled now, not resumed

    # -- the loop ---------------------------------------------------------------------------
    def request_stop(self, *_: Any) -> None:
        self._stop = True

    def stopping(self) -> bool:
        return self._stop or bool(self.db.get_meta("stop_requested", False))

    def run(self) -> None:
        """Recover, then play rounds until ``cluster stop`` (or SIGTERM/SIGINT); stop the jobs
        with their state kept on the way out."""
        lock = ServiceLock(self.dir)
        dashboard = None
        try:
            while True:  # a full disk at start-up pauses like one later (recovery only writes the database)
                try:
                    self.db.set_meta("stop_requested", False)
                    if self.db.get_meta("epoch_s") is None:
                        self.db.set_meta("epoch_s", time.time())
                    self.epoch_s = float(self.db.get_meta("epoch_s"))
                    self._heartbeat(state="recovering")
                    self.placement.check_slots(self.slots)
                    self.recover()
                    break
                except sqlite3.OperationalError as exc:
                    if not disk_full(exc):
                        raise
                    self.pause_for_space(exc)
                    if self.stopping():
                        return
            dashboard = self._start_dashboard()
            self._heartbeat(state="running")
            self.db.event("service_start", pid=os.getpid(), policy=self.policy_name, slots=self.slots,
                          round_s=self.round_s)
            log.info("cluster service in %s: slots %s (slowdowns %s), policy %s, rounds of %.1f s", self.dir,
                     self.slots, {t: round(f, 3) for t, f in self.default_slowdowns.items()}, self.policy_name,
                     self.round_s)
            while not self.stopping():
                try:
                    if not self._active_rows():
                        self._tick()
                        time.sleep(self.poll_s)
                        continue
                    self.play_round()
                except sqlite3.OperationalError as exc:
                    if not disk_full(exc):
                        raise
                    self.pause_for_space(exc)
        finally:
            self.shutdown()
            if dashboard is not None:
                dashboard.should_exit = True
            lock.release()

    def _start_dashboard(self) -> Any:
        """With ``dashboard_port`` in the configuration (``cluster start --dashboard-port``), serve
        the dashboard on 127.0.0.1 from a thread of the service; its address goes to ``meta``."""
        port = self.db.config().get("dashboard_port")
        if port is None:
            self.db.set_meta("dashboard", None)
            return None
        import threading

        from virtualflow.service.dashboard import bind, make_server

        sock = bind("127.0.0.1", int(port))
        server = make_server(self.dir)
        threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                         name="dashboard").start()
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/"
        self.db.set_meta("dashboard", url)
        log.info("dashboard: %s", url)
        return server

    def _active_rows(self) -> list[JobRow]:
        rows = [r for r in self.db.jobs(("queued", "running")) if not r.cancel_requested]
        for r in rows:
            if r.id in self._no_space and (r.state != "queued"
                                           or _free_bytes(r.run_dir) >= self._no_space[r.id] + SERVICE_FREE_BYTES):
                del self._no_space[r.id]
                log.info("job %d may run again: %.0f MiB free at %s", r.id, _free_bytes(r.run_dir) / 2**20, r.run_dir)
        now = time.monotonic()
        return [r for r in rows if r.id not in self._no_space
                and not (r.state == "queued" and self._held.get(r.id, (0.0, 0))[0] > now)]

    def play_round(self) -> None:
        """One round: decide, record, enact, run for ``round_s`` while polling, measure."""
        start = time.time()
        self._settle_stops()
        if self.pending:  # starts the last round could not make yet: this round decides again
            log.info("round: %d start(s) still waiting for the slots of jobs being stopped are decided again",
                     len(self.pending))
            self.pending = []
        rows = {r.id: r for r in self._active_rows()}
        views = [self._view(r) for r in rows.values()]
        # A job still starting (or within --min-run-s) keeps its placement; so does one being
        # stopped: it holds its slots until it has stopped.
        pinned = {jid for jid, run in self.running.items()
                  if run.start_step is None or run.last_step <= run.start_step or start - run.started_s < self.min_run_s}
        pinned |= set(self.stops) & set(rows)
        decision = self.scheduler.plan(views, start - self.epoch_s, pinned)
        if decision.fallback is not None:  # the policy failed: the round runs on the fallback's decision
            self.db.event("policy_fallback", policy=self.policy_name, reason=decision.fallback)
            log.warning("round: %s", decision.fallback)
        decision, admitted = self.admit_deadlines(decision, views, rows, pinned, start)
        placements = []
        for jid, slots in sorted(decision.slots.items()):
            p = decision.plan.placements.get(jid)
            acc_type, workers = slots[0].rpartition("-")[0], len(slots)
            change = p.change if p is not None and (p.acc_type, p.gpus) == (acc_type, workers) else "pinned"
            if jid in admitted:
                change = "deadline"
            placements.append({"job_id": jid, "acc_type": acc_type, "workers": workers, "slots": list(slots),
                               "change": change})
        self.round_id = self.db.add_round(start_s=start, policy=self.policy_name, solved=decision.solved,
                                          decision_s=decision.decision_s, active=len(views), placements=placements)
        log.info("round %d: %s", self.round_id, ", ".join(
            f"job {p['job_id']} on {p['workers']}x{p['acc_type']} ({p['change']})" for p in placements) or "idle")
        self.enact(decision, rows)
        end = start + self.round_s
        while time.time() < end and not self.stopping():
            self._tick()
            time.sleep(min(self.poll_s, max(end - time.time(), 0.0)))
        self._end_round(time.time() - start)

    def admit_deadlines(self, decision: RoundDecision, views: list[JobView], rows: dict[int, JobRow],
                        pinned: set[int], now: float) -> tuple[RoundDecision, set[int]]:
        """Earliest-deadline-first admission over the policy's decision (the pure rule:
        :func:`virtualflow.service.deadlines.admit`); refreshes the deadline jobs' ETAs. Returns the
        decision to enact and the ids of the jobs admitted ahead of the policy."""
        self._prior = prior_rate(views)
        deadlines = {jid: r.deadline_s for jid, r in rows.items() if r.deadline_s is not None}
        if not deadlines:
            return decision, set()
        for v in views:
            if v.job_id in deadlines:
                self.db.update_job(v.job_id, eta_s=eta_s(v, self.slots, self._prior))
        t0 = time.perf_counter()
        placed = {jid: (slots[0].rpartition("-")[0], len(slots)) for jid, slots in decision.slots.items() if slots}
        adm = admit(views, placed, deadlines, now_s=now, round_s=self.round_s, slots=self.slots, pinned=pinned,
                    prior=self._prior)
        if not adm.swaps:
            return decision, set()
        actions, slots = diff_actions(views, adm.placements, self.slots, pinned)
        for sw in adm.swaps:
            self.db.event("deadline_priority", sw.job_id, acc_type=sw.acc_type, workers=sw.workers,
                          slack_s=sw.slack_s, shrunk=[list(x) for x in sw.shrunk], preempted=list(sw.preempted))
            log.info("job %d would miss its deadline if it waited a round (slack %.0f s): placed on %dx%s ahead of "
                     "the policy%s%s", sw.job_id, sw.slack_s, sw.workers, sw.acc_type,
                     "; shrinks " + ", ".join(f"job {j} to {to}" for j, _, to in sw.shrunk) if sw.shrunk else "",
                     "; preempts " + ", ".join(f"job {j}" for j in sw.preempted) if sw.preempted else "")
        return (RoundDecision(decision.plan, actions, slots, decision.solved,
                              decision.decision_s + time.perf_counter() - t0), {sw.job_id for sw in adm.swaps})

    def check_deadlines(self, now: float) -> None:
        """Record one ``deadline_missed`` event for each unfinished job whose deadline has passed."""
        rows = [r for r in self.db.jobs(("queued", "running")) if r.deadline_s is not None]
        for jid in newly_missed(((r.id, r.deadline_s, r.deadline_missed) for r in rows), now):
            r = next(r for r in rows if r.id == jid)
            self.db.update_job(jid, deadline_missed=True)
            self.db.event("deadline_missed", jid, now=now, deadline_s=r.deadline_s, late_s=now - r.deadline_s,
                          steps_done=r.steps_done, steps=r.steps, state=r.state)
            log.warning("job %d missed its deadline (%d/%d steps done)", jid, r.steps_done, r.steps)

    def enact(self, decision: RoundDecision, rows: dict[int, JobRow]) -> None:
        """Stop the preempted and moved jobs (all at once, each in a thread: a stop ends at the
        job's next step boundary), wait for them up to ``settle_s``, then resize and start in the
        decision's order. A start whose slots a job still being stopped holds (and a move's start)
        waits until that stop has ended (:meth:`_tick` makes it); the loop never waits for a stop."""
        for a in decision.actions:
            if a.kind in ("preempt", "restart"):
                if a.job_id in self.running:
                    self._begin_stop(a.job_id, a.kind, "preempted by the cluster scheduler" if a.kind == "preempt"
                                     else f"moved to {a.workers}x{a.acc_type} by the cluster scheduler",
                                     then=a if a.kind == "restart" else None)
                elif a.job_id not in self.stops:  # it ended meanwhile (the tick records how) or never ran
                    goes_on = self._stopped(rows[a.job_id], None, None, a.kind)
                    if a.kind == "restart" and goes_on:
                        self.pending.append(a)
        self._settle_stops(wait_s=self.settle_s)
        for a in decision.actions:
            if a.kind in ("resize", "start"):
                self.pending.append(a)  # a grow, like a start, waits for slots a stopping job holds
        self._run_pending()

    def _run_pending(self) -> None:
        """Make the waiting starts and resizes whose slots no job being stopped holds any more."""
        held = {s for st in self.stops.values() for s in st.run.slots}
        waiting = []
        for a in self.pending:
            if a.job_id in self.stops or held & set(a.slots):
                waiting.append(a)
                continue
            row = self.db.job(a.job_id)
            if a.kind == "resize":
                if row is not None:
                    try:
                        self._resize(row, a)
                    except (ValueError, TypeError, RuntimeError, OSError) as exc:
                        self._fail(a.job_id, f"resize failed: {type(exc).__name__}: {' '.join(str(exc).split())}")
                continue
            if row is None or row.state != "queued" or row.cancel_requested or a.job_id in self.running:
                continue  # it ended, was cancelled or started meanwhile
            try:
                self._start(row, a, restart=a.kind == "restart")
            except (ValueError, TypeError, RuntimeError, OSError) as exc:
                if disk_full(exc):  # the service could not write for it: not the job's fault
                    self.running.pop(row.id, None)
                    self._out_of_space(row, _one_line(exc))
                    continue
                if short_of_resources(exc):  # nor when the service ran out of descriptors/processes
                    self.running.pop(row.id, None)
                    self._hold_back(row, _one_line(exc))
                    continue
                # A launch that could not even begin (no run directory, ...): this job fails alone.
                self._fail(row.id, f"{a.kind} failed: {type(exc).__name__}: {' '.join(str(exc).split())}")
        self.pending = waiting

    # -- actions ----------------------------------------------------------------------------
    def _start(self, row: JobRow, a: Action, *, restart: bool) -> None:
        assert a.acc_type is not None
        factor = self.slowdowns_of(row)[a.acc_type]
        self.db.claim_run_dir(row)  # another job's states there are moved aside, never resumed
        resume = row.run_dir if _has_state(row.run_dir) else None
        opts: dict[str, Any] = dict(workers=a.workers, steps=row.steps, run_dir=row.run_dir,
                                    deterministic=row.deterministic, threads_per_worker=self.threads,
                                    resume=resume, balance=False, progress=False)
        if row.checkpoint_every:
            opts["checkpoint_every"] = row.checkpoint_every
        if factor > 1.0 and self.emulate:
            opts["slowdowns"] = [factor] * a.workers
        opts.update(self.placement.worker_options(a.acc_type))
        launch = self.launch if self.launch is not None else self._driver_for(row)
        handle = launch(row.target, **opts)
        now = time.time()
        run = Running(handle=handle, acc_type=a.acc_type, workers=a.workers, slots=a.slots,
                      slowdown=factor if self.emulate else 1.0, slowed=set(range(a.workers)), start_step=None,
                      started_s=now, clock=StepClock(now))
        self.running[row.id] = run
        fields: dict[str, Any] = dict(acc_type=a.acc_type, workers=a.workers, slots=list(a.slots),
                                      starts=row.starts + 1)
        if row.started_s is None:
            fields["started_s"] = now
        if restart or resume is not None:
            fields["restarts"] = row.restarts + 1
        self.db.set_job_state(row.id, "running", **fields)
        self._held.pop(row.id, None)  # a back-off for want of resources ends with a start
        run.start_event = {**{k: v for k, v in fields.items() if isinstance(v, (int, float, str, type(None)))},
                           "resumed": resume is not None}
        self._note_start(row.id, run)

    def _driver_for(self, row: JobRow) -> Callable[..., Any]:
        """The default ``launch``: the job runs under a driver process of its own, marked with the
        job's run directory (:mod:`virtualflow.service.launcher`)."""
        def launch(target: str, **options: Any) -> ChildJob:
            return ChildJob(target, options, marker=row.run_dir, launch_timeout_s=self.launch_timeout_s,
                            log_path=os.path.join(self.dir, "logs", f"job-{row.id}.log"))

        return launch

    def _note_start(self, jid: int, run: Running) -> None:
        """Once the job reports the step it starts from, record its ``start`` event (dated when it
        was launched: replay measures the launch from it) with that step."""
        if run.start_event is None:
            return
        try:
            step = run.handle.status().get("step")
        except Exception:  # noqa: BLE001 - between states; next tick
            return
        if not isinstance(step, int):
            return
        run.start_step = step
        self.db.event("start", jid, now=run.started_s, **run.start_event, from_step=step)
        run.start_event = None

    def _begin_stop(self, jid: int, kind: str, reason: str, then: Action | None = None) -> Stopping:
        """Stop a running job in a thread of its own, with its state written (a job that has not
        made a step since it started is killed instead: it has nothing to write and would first
        have to finish starting). The stop may take as long as the job's hang limit
        (:class:`~virtualflow.service.watchdog.HangRule`); a job that does not stop by then is
        killed and the stop's error says so. Its outcome is recorded by :meth:`_settle_stops`."""
        run = self.running.pop(jid)
        limit = self.hang.limit_s(run.clock.step_times if run.clock is not None else [])
        st = Stopping(run=run, kind=kind, reason=reason, then=then)

        def stop() -> None:
            try:
                step = run.handle.status().get("step")
                if (run.start_step is None or not isinstance(step, int) or step <= run.start_step) \
                        and not run.handle.done:
                    run.handle.kill()
                    _wait_quietly(run.handle, 30.0)  # its run directory is free again once it is gone
                    st.outcome = (None, None)
                    return
                st.outcome = (run.handle.stop(timeout_s=limit, reason=reason), None)
            except TimeoutError:
                st.outcome = (None, TimeoutError(
                    f"it did not reach a step boundary within {limit:.0f} s of being stopped ({reason}; the limit "
                    f"follows its step time: hang_factor={self.hang.factor:g}, hang_floor_s={self.hang.floor_s:g}): "
                    f"hung, killed"))
            except Exception as exc:  # noqa: BLE001 - judged when recorded
                st.outcome = (None, exc)

        st.thread = threading.Thread(target=stop, name=f"stop-job-{jid}", daemon=True)
        self.stops[jid] = st
        st.thread.start()
        return st

    def _settle_stops(self, wait_s: float = 0.0) -> None:
        """Record the stops that have ended (waiting up to ``wait_s`` for the others), then make
        the starts that were waiting for them."""
        deadline = time.monotonic() + wait_s
        for jid, st in list(self.stops.items()):
            if st.kind == "call":
                continue
            assert st.thread is not None
            st.thread.join(max(0.0, deadline - time.monotonic()))
            if st.thread.is_alive():
                continue
            del self.stops[jid]
            row = self.db.job(jid)
            if row is None:
                continue
            result, error = st.outcome or (None, None)
            if error is not None and st.kind in ("preempt", "restart") and (
                    getattr(st.run.handle, "disk_full", False) or disk_full(error)):
                self._out_of_space(row, _one_line(error))
                continue
            goes_on = self._stopped(row, result, error, st.kind)
            if st.then is not None and goes_on:
                self.pending.append(st.then)
        self._run_pending()

    def _stop_all(self, reasons: dict[int, str]) -> dict[int, tuple[Any, BaseException | None]]:
        """Stop these jobs at once and wait (each at most its hang limit); the caller records the
        outcomes. Returns job id -> (Result or None, error or None)."""
        stops = {jid: self._begin_stop(jid, "call", reason) for jid, reason in reasons.items() if jid in self.running}
        out = {}
        for jid, st in stops.items():
            assert st.thread is not None
            st.thread.join()
            self.stops.pop(jid, None)
            out[jid] = st.outcome or (None, None)
        return out

    def _stopped(self, row: JobRow, result: Any, error: BaseException | None, kind: str = "preempt") -> bool:
        """Record a stopped job; True if it is to run on (False: it ended: done, failed or
        cancelled). At shutdown a stop that failed queues the job (to resume from its newest
        state): the service stopped it, so its failure is not the job's to carry."""
        steps = result.steps if result is not None else row.steps_done
        if kind == "quarantine":
            self.db.set_job_state(row.id, "queued", event="preempt", acc_type=None, workers=0, slots=[],
                                  info={"reason": f"quarantined: {row.quarantine}"},
                                  **({"steps_done": result.steps} if result is not None else {}))
            self._left(row.id)
            return False
        if kind == "cancel":
            self.db.set_job_state(row.id, "cancelled", event="cancelled", finished_s=time.time(), steps_done=steps,
                                  acc_type=None, workers=0, slots=[],
                                  **({"error": _one_line(error)} if error is not None else {}))
            self._left(row.id)
            return False
        if error is not None and kind != "shutdown":
            self._fail(row.id, _one_line(error))
            return False
        if error is None and steps >= row.steps:
            self._done(row.id, steps, result)
            return False
        info: dict[str, Any] = {"killed_before_first_step": result is None and error is None}
        if error is not None:
            info["reason"] = f"the service stopped while the job stopped: {_one_line(error)}"
        self.db.set_job_state(row.id, "queued", event="preempt", steps_done=steps, acc_type=None,
                              workers=0, slots=[], info=info)
        return True

    def _resize(self, row: JobRow, a: Action) -> None:
        run = self.running.get(row.id)
        if run is None or run.handle.done:
            return  # it ended meanwhile; the next tick records how
        run.handle.resize(a.workers)
        run.workers, run.slots, run.samples = a.workers, a.slots, []
        if run.clock is not None:
            run.clock.restart(time.time())  # the step at the switch takes longer
        self.db.update_job(row.id, workers=a.workers, slots=list(a.slots), resizes=row.resizes + 1)
        self.db.event("resize", row.id, workers=a.workers, acc_type=a.acc_type)

    # -- polling ----------------------------------------------------------------------------
    def _tick(self) -> None:
        now = time.time()
        self._heartbeat(state="running")
        self.db.settle(now)  # cancels made while a job was queued or the service down; quarantined rows
        if now - self._deadlines_checked_s >= 1.0:
            self._deadlines_checked_s = now
            self.check_deadlines(now)
        self._settle_stops()
        began_stop = False
        for jid in list(self.running):
            run = self.running[jid]
            row = self.db.job(jid)
            if row is None:
                continue
            if run.handle.done:
                self.running.pop(jid)
                try:
                    result = run.handle.wait(0)
                except Exception as exc:  # noqa: BLE001 - the job crashed: it fails alone
                    if getattr(run.handle, "disk_full", False):
                        self._out_of_space(row, _one_line(exc))
                    else:
                        self._fail(jid, _one_line(exc))
                    continue
                if result.steps >= row.steps:
                    self._done(jid, result.steps, result)
                else:  # stopped from outside the service (e.g. a signal): queue it again
                    self.db.set_job_state(jid, "queued", event="preempt", steps_done=result.steps, acc_type=None,
                                          workers=0, slots=[], info={"reason": "stopped outside the service"})
                continue
            if row.quarantine is not None:  # its row became unusable while it ran: stopped, state kept
                self._begin_stop(jid, "quarantine", "quarantined")  # recorded once it has stopped
                began_stop = True
                continue
            if row.cancel_requested:
                self._begin_stop(jid, "cancel", "cancelled")  # recorded cancelled once it has stopped
                began_stop = True
                continue
            self._note_start(jid, run)
            try:
                st = run.handle.status()
            except Exception:  # noqa: BLE001 - between states; next tick
                continue
            if run.clock is not None:
                times = st.get("step_times")
                run.clock.observe(now, st.get("step") if isinstance(st.get("step"), int) else None,
                                  times if isinstance(times, list) else None)
                hung = self.hang.verdict(run.clock, now)
                if hung is not None:
                    if _free_bytes(row.run_dir) < SERVICE_FREE_BYTES:  # stuck for want of space: not its fault
                        self.running.pop(jid)
                        run.handle.kill()
                        self._out_of_space(row, f"no progress ({hung}); its processes were killed")
                    else:
                        self._fail(jid, f"hung: {hung}; its processes were killed")
                    continue
            step = int(st.get("step") or 0)
            members = [w for w in st.get("workers", []) if w.get("rank") is not None]
            if run.slowdown > 1.0:
                for w in members:
                    wid = w.get("id")
                    if isinstance(wid, int) and wid not in run.slowed:
                        run.handle.set_slowdown(wid, run.slowdown)
                        run.slowed.add(wid)
            formed = st.get("state") == "running" and len(members) == run.workers
            if formed and (not run.samples or step != run.samples[-1][1]):
                run.samples.append((now, step))
            elif not formed:
                run.samples = []
            if step != run.last_step and now - run.last_write_s >= 0.5:
                loss = st.get("loss")
                fields = {"steps_done": step, "loss": float(loss) if isinstance(loss, (int, float)) else None}
                if row.deadline_s is not None:
                    view = self._view(row)
                    view.steps_done = step
                    fields["eta_s"] = eta_s(view, self.slots, self._prior)
                self.db.update_job(jid, **fields)
                run.last_step, run.last_write_s = step, now
        if began_stop:  # a quick stop is recorded at once (within a poll interval: the loop sleeps that anyway)
            self._settle_stops(wait_s=max(self.poll_s, 0.05))

    def _end_round(self, held_s: float) -> None:
        for jid, run in self.running.items():
            row = self.db.job(jid)
            if row is None:
                continue
            received = dict(row.received)
            received[run.acc_type] = received.get(run.acc_type, 0.0) + held_s
            fields: dict[str, Any] = {"received": received}
            s = run.samples
            if len(s) >= 3 and s[-1][1] - s[0][1] >= 2 and s[-1][0] > s[0][0]:
                rate = (s[-1][1] - s[0][1]) / (s[-1][0] - s[0][0])
                fields["estimates"] = update_estimates(row.estimates, run.acc_type, run.workers, rate)
                self.db.event("throughput", jid, acc_type=run.acc_type, workers=run.workers, steps_per_s=rate)
                run.samples = s[-1:]
            self.db.update_job(jid, **fields)
        self.scheduler.end_round()
        if self.round_id is not None:
            self.db.end_round(self.round_id, time.time())

    # -- outcomes ---------------------------------------------------------------------------
    def _done(self, jid: int, steps: int, result: Any) -> None:
        loss = result.history[-1].get("loss") if result is not None and result.history else None
        self.db.set_job_state(jid, "done", event="done", finished_s=time.time(), steps_done=steps,
                              loss=loss if isinstance(loss, (int, float)) else None, acc_type=None, workers=0, slots=[])
        log.info("job %d done (%d steps)", jid, steps)
        self._left(jid)

    def _fail(self, jid: int, error: str) -> None:
        run = self.running.pop(jid, None)
        if run is not None and not run.handle.done:
            try:
                run.handle.kill()
            except Exception:  # noqa: BLE001
                pass
        self.db.set_job_state(jid, "failed", event="failed", finished_s=time.time(), error=error[:2000],
                              acc_type=None, workers=0, slots=[])
        log.warning("job %d failed: %s", jid, error)
        self._left(jid)

    def _left(self, jid: int) -> None:
        self.scheduler.finished(jid)
        if self.round_id is not None:
            self.db.end_allocation(self.round_id, jid, time.time())

    def _hold_back(self, row: JobRow, error: str) -> None:
        """The job could not be started because the service itself ran short of descriptors,
        processes or memory (``short_of_resources``). Not the job's fault and not final: it stays
        queued and is placed again after a back-off that doubles while the shortage lasts."""
        _, times = self._held.get(row.id, (0.0, 0))
        first, most = RESOURCE_BACKOFF_S
        wait_s = min(most, first * 2 ** times)
        self._held[row.id] = (time.monotonic() + wait_s, times + 1)
        line = (f"job {row.id} could not be started: the cluster service ran short of resources ({error}); it stays "
                f"queued and is placed again in {wait_s:.0f} s (raise the service's limits, e.g. ulimit -n, if this "
                f"repeats)")
        if row.state != "queued":
            self.db.set_job_state(row.id, "queued", event="preempt", acc_type=None, workers=0, slots=[],
                                  info={"reason": line})
        else:
            self.db.event("held", row.id, reason=line)
        log.error("%s", line)
        self._left(row.id)

    def _out_of_space(self, row: JobRow, error: str) -> None:
        """The job ended because its files could not be written (its driver says: out of space).
        Not the job's fault and not final: it is queued to resume from its newest complete state."""
        free = _free_bytes(row.run_dir)
        line = (f"job {row.id} stopped: it cannot write {row.run_dir} ({free / 2**20:.0f} MiB free there): {error}; "
                f"it is placed again, from its newest complete state, once {SERVICE_FREE_BYTES / 2**20:.0f} MiB more "
                f"are free there")
        self.db.set_job_state(row.id, "queued", event="preempt", acc_type=None, workers=0, slots=[],
                              info={"reason": line})
        log.error("%s", line)
        self._no_space[row.id] = free
        self._left(row.id)

    def pause_for_space(self, exc: BaseException) -> None:
        """The service cannot write its database (the file system is full): say so in one line,
        then wait until ``SERVICE_FREE_BYTES`` are free and a write succeeds. The jobs run on in
        their own processes meanwhile (what they report is recorded afterwards); nothing is
        recorded in between, nothing is marked failed, nothing already written is lost."""
        path = self.db.path
        free = _free_bytes(self.dir)
        self.paused = (f"cluster service paused: it cannot write {path} ({' '.join(str(exc).split())}); "
                       f"{free / 2**20:.1f} MiB free there, it needs {SERVICE_FREE_BYTES / 2**20:.0f} MiB: free space "
                       f"on that file system and it goes on by itself")
        log.error("%s", self.paused)
        while not self._stop:
            time.sleep(max(self.poll_s, 0.5))
            try:
                if self.db.get_meta("stop_requested", False):
                    break
                if _free_bytes(self.dir) < SERVICE_FREE_BYTES:
                    continue
                self._heartbeat(state="running")  # a write: the proof that it can go on
            except sqlite3.OperationalError as again:
                if not disk_full(again):
                    raise
                continue
            break
        log.warning("cluster service: %s", "stopping while paused" if self.stopping() else
                    f"resumed ({_free_bytes(self.dir) / 2**20:.0f} MiB free in {self.dir})")
        self.paused = None
        if self.round_id is not None and not self.stopping():
            self.db.end_round(self.round_id, time.time())  # the round cut short by the pause
            self.round_id = None

    def _view(self, row: JobRow) -> JobView:
        run = self.running.get(row.id)
        if run is None and row.id in self.stops:
            run = self.stops[row.id].run  # it holds its slots until it has stopped
        return JobView(job_id=row.id, steps=row.steps, steps_done=row.steps_done, elastic=row.elastic,
                       min_workers=row.min_workers, max_workers=row.max_workers, priority=row.priority,
                       arrival_s=row.submitted_s - self.epoch_s, slowdowns=self.slowdowns_of(row),
                       estimates=row.estimates, received_s=row.received,
                       running=(run.acc_type, run.workers) if run is not None else None,
                       slots=run.slots if run is not None else ())

    def _heartbeat(self, state: str) -> None:
        self.db.set_meta("service", {"pid": os.getpid(), "heartbeat_s": time.time(), "state": state,
                                     "round": self.round_id, "running": sorted(self.running),
                                     "stopping": sorted(self.stops)})

    def shutdown(self) -> None:
        """Stop every running job with its state written and queue it (``cluster stop``), waiting
        for every stop (each at most its job's hang limit). A job whose stop failed is queued, never
        marked failed: the service stopped it. When the database cannot be written (disk full),
        what could not be recorded stays as it was: the next start recovers it from the run
        directories."""
        for jid in list(self.running):
            self._begin_stop(jid, "shutdown", "cluster service stopped")
        for st in list(self.stops.values()):
            if st.thread is not None:
                st.thread.join()
        try:
            self._settle_stops()
            if self.round_id is not None:
                self.db.end_round(self.round_id, time.time())
            self._heartbeat(state="stopped")
            self.db.event("service_stop", pid=os.getpid())
        except sqlite3.OperationalError as exc:
            if not disk_full(exc):
                raise
            log.error("cluster service stopped without recording it: it cannot write %s (%s; %.1f MiB free); "
                      "the next cluster start recovers every job from its run directory", self.db.path,
                      " ".join(str(exc).split()), _free_bytes(self.dir) / 2**20)


def init_cluster(cluster_dir: str, *, slots: dict[str, int], policy: str, round_s: float,
                 slowdowns: dict[str, float] | None = None, threads_per_worker: int = 1,
                 min_run_s: float = 0.0, dashboard_port: int | None = None, backend: str = "local",
                 address: str | None = None, cpus_per_worker: float = 1.0,
                 emulate_slowdowns: bool = False, mechanism: str = "default", launch_timeout_s: float = 60.0,
                 hang_factor: float = 10.0, hang_floor_s: float = 120.0,
                 hang_first_step_s: float = 600.0) -> ClusterDB:
    """Create (or reconfigure) a cluster directory: the database with the configuration, a
    private dashboard token. Validates everything first (nothing is written on error); with
    ``backend="ray"`` that includes connecting to the Ray cluster at ``address`` and checking that
    it has the resources the slots claim (:func:`check_ray_cluster`).

    The directory is private (:func:`~virtualflow.service.state.check_cluster_dir`): an existing
    one that is a symbolic link, another user's, or writable by others, or a database or token
    there that others may read or write, is refused naming the ``chmod`` that fixes it; what is
    created here is 0700 (directory) and 0600 (database, token). A database made anew in a
    directory whose earlier jobs it does not know (emptied, deleted) continues their ids above the
    highest handed out (``db.recreated_over``; a ``database_new`` event)."""
    if not slots:
        raise ValueError("--slots is empty; give accelerator types and counts, e.g. --slots v100=2,k80=2")
    get_policy(policy)  # raises for an unknown policy, naming the choices
    knobs = mechanism_knobs(mechanism)  # raises for an unknown name, naming the choices
    if not (round_s > 0 and round_s < 1e6):
        raise ValueError(f"--round-s {round_s} must be a positive number of seconds")
    if dashboard_port is not None and not 0 <= dashboard_port <= 65535:
        raise ValueError(f"--dashboard-port {dashboard_port} must be a TCP port (0: any free port)")
    if not (min_run_s >= 0 and min_run_s < 1e6):
        raise ValueError(f"--min-run-s {min_run_s} must be a number of seconds >= 0")
    for flag, value, low, high in (("--launch-timeout-s", launch_timeout_s, 1.0, 86400.0),
                                   ("--hang-factor", hang_factor, 1.0, 1000.0),
                                   ("--hang-floor-s", hang_floor_s, 1.0, 86400.0),
                                   ("--hang-first-step-s", hang_first_step_s, 1.0, 86400.0)):
        if not (isinstance(value, (int, float)) and low <= value <= high):
            raise ValueError(f"{flag} {value!r} must be between {low:g} and {high:g}")
    types = tuple(slots)
    overrides = dict(slowdowns or {})
    unknown = [t for t in overrides if t not in slots]
    if unknown:
        raise ValueError(f"--slowdowns names type(s) {unknown} that are not in --slots {list(slots)}")
    type_slowdowns(types, gavel_table(), overrides)  # every type's speed is known
    placement = placement_of(backend, address=address, cpus_per_worker=cpus_per_worker,
                             emulate_slowdowns=emulate_slowdowns)
    placement.check_slots(slots)  # on Ray: connects and checks the resources the slots claim
    db = ClusterDB(cluster_dir, create=True)  # checks the directory (and makes it 0700 if missing)
    if db.recreated_over is not None:
        db.event("database_new", earlier_ids_up_to=db.recreated_over)
        log.warning("%s was new, but this directory handed out job ids up to %d before: new ids continue above",
                    db.path, db.recreated_over)
    db.set_meta("config", {"slots": slots, "policy": policy, "round_s": round_s, "slowdowns": overrides,
                           "threads_per_worker": threads_per_worker, "min_run_s": min_run_s,
                           "dashboard_port": dashboard_port, "backend": backend, "address": address,
                           "cpus_per_worker": cpus_per_worker, "emulate_slowdowns": emulate_slowdowns,
                           "mechanism": knobs, "launch_timeout_s": launch_timeout_s, "hang_factor": hang_factor,
                           "hang_floor_s": hang_floor_s, "hang_first_step_s": hang_first_step_s})
    token_path = os.path.join(cluster_dir, "token")
    if not os.path.exists(token_path):
        from virtualflow.comm import auth

        auth.write_token(token_path, auth.new_token())
    return db


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _has_state(run_dir: str) -> bool:
    from virtualflow.rundir import state_files

    return bool(run_dir) and os.path.isdir(run_dir) and bool(state_files(run_dir))


def _final_step(run_dir: str) -> int | None:
    """The step of the run directory's ``final.pt`` (None without a readable one)."""
    from virtualflow.runtime.checkpoint import load_state

    path = os.path.join(run_dir, "final.pt")
    if not os.path.isfile(path):
        return None
    try:
        return int(load_state(path)["step"])
    except Exception:  # noqa: BLE001 - unreadable: judged by the other files (resume skips it too)
        return None


def _wait_quietly(handle: Any, timeout_s: float) -> None:
    """Wait for a killed job's handle to end, whatever it reports."""
    try:
        handle.wait(timeout_s)
    except Exception:  # noqa: BLE001 - killed: its outcome is known
        pass


def _one_line(error: BaseException | str) -> str:
    """An error as one line: a job's own failure (``TrainingError``, the driver's report) or a
    stop's time-out by its message, anything else with its type."""
    text = str(error) if isinstance(error, (str, RuntimeError, TimeoutError)) else f"{type(error).__name__}: {error}"
    return " ".join(text.split())


def _free_bytes(path: str) -> float:
    """Free bytes on the file system of ``path`` (or of its nearest existing parent)."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return float(shutil.disk_usage(path or "/").free)
    except OSError:
        return float("nan")
