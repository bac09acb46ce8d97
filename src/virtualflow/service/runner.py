"""The cluster service's process layer: rounds in real time, jobs through the public API.

:class:`Service` is a loop over rounds of ``round_s`` seconds. At a round's start it reads the
database (new submissions, cancellations), builds a :class:`~virtualflow.service.core.JobView`
per active job, asks the pure :class:`~virtualflow.service.core.Scheduler` for the round's
decision, records it (``rounds`` and ``allocations`` tables) and enacts its actions with the
public API, on the local backend (or on a Ray cluster: see below). **No job code runs in this
process**: each start runs :func:`virtualflow.launch` in a driver process of its own
(:mod:`virtualflow.service.launcher`: it imports, builds and checks the job under a time limit and
hosts its coordinator); this process sees the job through that driver's JSON lines only.

Where things are: this module holds :class:`Service` (set-up, recovery, the loop, pausing on a
full disk, shutdown) and :class:`ServiceLock`; a round (decide, record, enact, poll, measure) is
:mod:`virtualflow.service.rounds`, starting, resizing and stopping jobs and recording how they
ended is :mod:`virtualflow.service.lifecycle`, ``cluster start``'s validation is
:mod:`virtualflow.service.setup`, and where workers run (local or Ray) is the placement chosen once
from the configuration (:mod:`virtualflow.backends.placement`): the service never branches on a
backend's name.

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
import logging
import os
import sqlite3
import time
from typing import Any, Callable

from virtualflow.backends.orphans import wait_orphans as _wait_orphans  # noqa: F401 - the old name, for tests
from virtualflow.backends.placement import (Placement, check_ray_cluster, placement_from_config,  # noqa: F401
                                            ray_slot_shortage)
from virtualflow.cluster.policies.base import get_policy
from virtualflow.service.core import (PRIOR_STEPS_PER_S, Action, JobView, Scheduler, mechanism_of, recovery_action,
                                      type_slowdowns)
from virtualflow.service.failures import (RESOURCE_BACKOFF_S, SERVICE_FREE_BYTES, disk_full,  # noqa: F401
                                          short_of_resources)
from virtualflow.service.failures import free_bytes as _free_bytes
from virtualflow.service.lifecycle import (JobLifecycle, Running, Stopping, final_step, has_state,  # noqa: F401
                                           read_json)
from virtualflow.service.rounds import RoundPlay
from virtualflow.service.setup import init_cluster  # noqa: F401 - its home before the split
from virtualflow.service.rows import JobRow
from virtualflow.service.state import ClusterDB
from virtualflow.service.tables import gavel_table
from virtualflow.service.watchdog import HangRule

log = logging.getLogger(__name__)

__all__ = ["Service", "ServiceLock", "init_cluster", "gavel_table", "ray_slot_shortage", "check_ray_cluster",
           "SERVICE_FREE_BYTES", "RESOURCE_BACKOFF_S", "disk_full", "short_of_resources", "Running", "Stopping",
           "LOCK_NAME"]

LOCK_NAME = "service.lock"


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


class Service(RoundPlay, JobLifecycle):
    """The service of one cluster directory (created by ``cluster start``: see :func:`init_cluster`).

    Its parts are split by concept over one level of bases that share its state: this class
    (set-up, recovery, the loop, pausing on a full disk, shutdown), :class:`RoundPlay` (a round:
    decide, record, enact, poll, measure) and :class:`~virtualflow.service.lifecycle.JobLifecycle`
    (start, resize, stop, outcomes)."""

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
            summary = read_json(os.path.join(row.run_dir, "summary.json"))
            stated = has_state(row.run_dir)
            what = recovery_action(row.state, summary, stated, row.steps,
                                   final_step(row.run_dir) if stated else None)
            if what == "done":
                self.db.set_job_state(row.id, "done", event="done", finished_s=now, steps_done=row.steps,
                                      acc_type=None, workers=0, slots=[])
                log.info("job %d had completed before the service stopped: recorded done", row.id)
            else:
                self.db.set_job_state(row.id, "queued", event="requeued", acc_type=None, workers=0, slots=[],
                                      info={"reason": f"service restarted ({what})"})
                log.info("job %d was running when the service stopped: queued to %s", row.id,
                         "resume from its newest state" if stated else "start again")
        self.db.settle(now)  # a cancel made while the service was down: cancelled now, not resumed

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
            if r.id in self._no_space and (r.state != "queued" or self.free_bytes(r.run_dir)
                                           >= self._no_space[r.id] + SERVICE_FREE_BYTES):
                del self._no_space[r.id]
                log.info("job %d may run again: %.0f MiB free at %s", r.id, self.free_bytes(r.run_dir) / 2**20,
                         r.run_dir)
        now = time.monotonic()
        return [r for r in rows if r.id not in self._no_space
                and not (r.state == "queued" and self._held.get(r.id, (0.0, 0))[0] > now)]

    def pause_for_space(self, exc: BaseException) -> None:
        """The service cannot write its database (the file system is full): say so in one line,
        then wait until ``SERVICE_FREE_BYTES`` are free and a write succeeds. The jobs run on in
        their own processes meanwhile (what they report is recorded afterwards); nothing is
        recorded in between, nothing is marked failed, nothing already written is lost."""
        path = self.db.path
        free = self.free_bytes(self.dir)
        self.paused = (f"cluster service paused: it cannot write {path} ({' '.join(str(exc).split())}); "
                       f"{free / 2**20:.1f} MiB free there, it needs {SERVICE_FREE_BYTES / 2**20:.0f} MiB: free space "
                       f"on that file system and it goes on by itself")
        log.error("%s", self.paused)
        while not self._stop:
            time.sleep(max(self.poll_s, 0.5))
            try:
                if self.db.get_meta("stop_requested", False):
                    break
                if self.free_bytes(self.dir) < SERVICE_FREE_BYTES:
                    continue
                self._heartbeat(state="running")  # a write: the proof that it can go on
            except sqlite3.OperationalError as again:
                if not disk_full(again):
                    raise
                continue
            break
        log.warning("cluster service: %s", "stopping while paused" if self.stopping() else
                    f"resumed ({self.free_bytes(self.dir) / 2**20:.0f} MiB free in {self.dir})")
        self.paused = None
        if self.round_id is not None and not self.stopping():
            self.db.end_round(self.round_id, time.time())  # the round cut short by the pause
            self.round_id = None

    def _view(self, row: JobRow) -> JobView:
        run = self.running.get(row.id)
        if run is None and row.id in self.stops:
            run = self.stops[row.id].run  # it holds its slots until it has stopped
        top = row.max_workers
        if row.batch is not None and run is None:  # a (re)start runs every recorded batch: a VN per worker
            top = max(row.min_workers, min(top, row.batch.get("fewest", top)))
        return JobView(job_id=row.id, steps=row.steps, steps_done=row.steps_done, elastic=row.elastic,
                       min_workers=row.min_workers, max_workers=top, priority=row.priority, batch=row.batch,
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
                      " ".join(str(exc).split()), self.free_bytes(self.dir) / 2**20)

    def free_bytes(self, path: str) -> float:
        """Free bytes at ``path`` (the service's one probe of free space)."""
        return _free_bytes(path)
