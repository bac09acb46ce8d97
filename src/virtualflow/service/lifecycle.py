"""The cluster service's job lifecycle: start, resize, stop (in threads), and each outcome recorded.

:class:`JobLifecycle` is the half of :class:`~virtualflow.service.runner.Service` that acts on
jobs: it enacts a round's decision (stops first, then resizes and starts in the decision's
order), stops jobs in threads of their own (:class:`Stopping`: a job being stopped keeps its
slots until it has stopped; a start that needs them waits in ``pending``) and records how each
job ended (done, failed, cancelled, queued again).

Invariants:

- a job is in at most one of ``running`` and ``stops``; a start never takes a slot a job being
  stopped still holds;
- a job fails for good only for what its own code did: a full disk (:meth:`_out_of_space`) or
  the service's own shortage of resources (:meth:`_hold_back`) queues it again instead;
- every outcome ends the job's allocation in the current round and tells the scheduler
  (:meth:`_left`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from virtualflow.backends.placement import Placement
from virtualflow.plan.batch_schedule import schedule_from_events
from virtualflow.records.rundir import read_json, read_jsonl
from virtualflow.service.core import Action, RoundDecision, Scheduler
from virtualflow.service.failures import (RESOURCE_BACKOFF_S, SERVICE_FREE_BYTES, disk_full, one_line,
                                          short_of_resources)
from virtualflow.service.launcher import ChildJob
from virtualflow.service.rows import JobRow
from virtualflow.service.state import ClusterDB
from virtualflow.service.watchdog import HangRule, StepClock

log = logging.getLogger("virtualflow.service.runner")  # one logger for every part of the Service

__all__ = ["JobLifecycle", "Running", "Stopping", "has_state", "final_step", "read_json"]


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


class JobLifecycle:
    """Starts, resizes, stops and outcomes of the service's jobs: a part of
    :class:`~virtualflow.service.runner.Service` (it shares the service's state, declared here)."""

    db: ClusterDB
    dir: str
    scheduler: Scheduler
    hang: HangRule
    running: dict[int, Running]
    stops: dict[int, Stopping]
    pending: list[Action]
    round_id: int | None
    settle_s: float
    threads: int
    emulate: bool
    launch: Callable[..., Any] | None
    launch_timeout_s: float
    _held: dict[int, tuple[float, int]]
    _no_space: dict[int, float]
    placement: Placement
    slowdowns_of: Callable[[JobRow], dict[str, float]]
    free_bytes: Callable[[str], float]

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
        # a larger batch goes before the job's resize (the new workers need its virtual nodes), a
        # smaller one after it (the job waits for the shrink before it takes the batch)
        larger = {j: b for j, b in decision.batches.items()
                  if j in self.running and b // rows[j].batch["vn_size"] >= self.running[j].workers}
        self._change_batches(larger, rows)
        self._run_pending()
        self._change_batches({j: b for j, b in decision.batches.items() if j not in larger}, rows)

    def _change_batches(self, batches: dict[int, int], rows: dict[int, JobRow]) -> None:
        """Change running elastic-batch jobs' batches in place (:meth:`virtualflow.JobHandle.change_batch`:
        V from the first step not yet run; the job's run records the step in ``events.jsonl``)."""
        for jid, b in sorted(batches.items()):
            run, cell = self.running.get(jid), rows[jid].batch
            if run is None or run.handle.done or cell is None:
                continue
            v, rule = b // cell["vn_size"], cell["lr_rule"]
            run.handle.change_batch(v, rule if isinstance(rule, str) else {int(k): float(m) for k, m in rule.items()})
            self.db.update_job(jid, batch={**cell, "now": b, "fewest": min(cell.get("fewest", v), v)})
            self.db.event("batch", jid, batch=b, virtual_nodes=v, previous=cell["now"])
            log.info("job %d: batch %d -> %d (%d virtual nodes of %d) from its next step", jid, cell["now"], b, v,
                     cell["vn_size"])

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
                    self._out_of_space(row, one_line(exc))
                    continue
                if short_of_resources(exc):  # nor when the service ran out of descriptors/processes
                    self.running.pop(row.id, None)
                    self._hold_back(row, one_line(exc))
                    continue
                # A launch that could not even begin (no run directory, ...): this job fails alone.
                self._fail(row.id, f"{a.kind} failed: {type(exc).__name__}: {' '.join(str(exc).split())}")
        self.pending = waiting

    def _start(self, row: JobRow, a: Action, *, restart: bool) -> None:
        assert a.acc_type is not None
        factor = self.slowdowns_of(row)[a.acc_type]
        self.db.claim_run_dir(row)  # another job's states there are moved aside, never resumed
        resume = row.run_dir if has_state(row.run_dir) else None
        opts: dict[str, Any] = dict(workers=a.workers, steps=row.steps, run_dir=row.run_dir,
                                    deterministic=row.deterministic, threads_per_worker=self.threads,
                                    resume=resume, balance=False, progress=False)
        if row.checkpoint_every:
            opts["checkpoint_every"] = row.checkpoint_every
        if factor > 1.0 and self.emulate:
            opts["slowdowns"] = [factor] * a.workers
        if row.batch is not None and resume is not None:
            opts["batch"] = self._recorded_batch(row)
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

    def _recorded_batch(self, row: JobRow) -> dict[str, Any]:
        """A resumed elastic-batch job's batch changes as its run recorded them (the ``batch``
        records of ``events.jsonl``: :func:`~virtualflow.plan.batch_schedule.schedule_from_events`),
        the launch's ``Job.batch_schedule`` and ``Job.lr_rule``; the row's batch becomes the last
        one recorded (a change asked but never run is not the run's)."""
        assert row.batch is not None
        schedule, rule = schedule_from_events(read_jsonl(os.path.join(row.run_dir, "events.jsonl")))
        now = schedule[-1][1] * row.batch["vn_size"] if schedule else row.batch["base"]
        if now != row.batch["now"]:
            self.db.update_job(row.id, batch={**row.batch, "now": now})
        return {"batch_schedule": [list(c) for c in schedule], "lr_rule": rule if schedule else None}

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
                self._out_of_space(row, one_line(error))
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
                                  **({"error": one_line(error)} if error is not None else {}))
            self._left(row.id)
            return False
        if error is not None and kind != "shutdown":
            self._fail(row.id, one_line(error))
            return False
        if error is None and steps >= row.steps:
            self._done(row.id, steps, result)
            return False
        info: dict[str, Any] = {"killed_before_first_step": result is None and error is None}
        if error is not None:
            info["reason"] = f"the service stopped while the job stopped: {one_line(error)}"
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
        free = self.free_bytes(row.run_dir)
        line = (f"job {row.id} stopped: it cannot write {row.run_dir} ({free / 2**20:.0f} MiB free there): {error}; "
                f"it is placed again, from its newest complete state, once {SERVICE_FREE_BYTES / 2**20:.0f} MiB more "
                f"are free there")
        self.db.set_job_state(row.id, "queued", event="preempt", acc_type=None, workers=0, slots=[],
                              info={"reason": line})
        log.error("%s", line)
        self._no_space[row.id] = free
        self._left(row.id)


def has_state(run_dir: str) -> bool:
    """Whether ``run_dir`` holds a state to resume from."""
    from virtualflow.records.rundir import state_files

    return bool(run_dir) and os.path.isdir(run_dir) and bool(state_files(run_dir))


def final_step(run_dir: str) -> int | None:
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
