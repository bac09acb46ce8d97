"""The cluster service's rounds: decide, record, enact, poll the jobs, measure them.

:class:`RoundPlay` is the half of :class:`~virtualflow.service.runner.Service` that plays a
round: at its start it asks the pure :class:`~virtualflow.service.core.Scheduler` for a decision
over the active jobs (a job still starting, within ``min_run_s`` or being stopped is pinned), lets
:func:`virtualflow.service.deadlines.admit` give jobs that would miss their deadline the slots they
need, records the round and enacts it (:class:`~virtualflow.service.lifecycle.JobLifecycle`).
During the round it polls every job (:meth:`_tick`, every ``poll_s``): progress, loss and ETA go
to the database, a job that ended or hung is recorded, a cancelled or quarantined one is stopped,
a newcomer gets its type's slowdown. At the round's end the steps each job made on a formed
(type, workers) are its **measured throughput**, folded into its estimates (:meth:`_end_round`).

Invariants: a round's decision is recorded before any of it is enacted; a job is measured only
while all its workers are members (``samples`` restart when it is not formed); a hung job is
failed only when its disk has room (stuck for want of space, it is queued again instead).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from virtualflow.service.core import JobView, RoundDecision, Scheduler, diff_actions, prior_rate, update_estimates
from virtualflow.service.deadlines import admit, eta_s, newly_missed
from virtualflow.service.failures import SERVICE_FREE_BYTES, one_line
from virtualflow.service.lifecycle import Running, Stopping
from virtualflow.service.rows import JobRow
from virtualflow.service.state import ClusterDB
from virtualflow.service.watchdog import HangRule

log = logging.getLogger("virtualflow.service.runner")  # one logger for every part of the Service

__all__ = ["RoundPlay"]


class RoundPlay:
    """One round of the service and its polling: a part of
    :class:`~virtualflow.service.runner.Service` (it shares the service's state, declared here;
    the actions it takes are :class:`~virtualflow.service.lifecycle.JobLifecycle`'s)."""

    db: ClusterDB
    scheduler: Scheduler
    hang: HangRule
    running: dict[int, Running]
    stops: dict[int, Stopping]
    pending: list
    round_id: int | None
    slots: dict[str, int]
    policy_name: str
    round_s: float
    poll_s: float
    min_run_s: float
    epoch_s: float
    _prior: float
    _deadlines_checked_s: float
    _view: Callable[[JobRow], JobView]
    _active_rows: Callable[[], list[JobRow]]
    _heartbeat: Callable[[str], None]
    stopping: Callable[[], bool]
    free_bytes: Callable[[str], float]
    slowdowns_of: Callable[[JobRow], dict[str, float]]
    enact: Callable[[RoundDecision, dict[int, JobRow]], None]
    _settle_stops: Callable[..., None]
    _begin_stop: Callable[..., Stopping]
    _note_start: Callable[[int, Running], None]
    _done: Callable[[int, int, Any], None]
    _fail: Callable[[int, str], None]
    _out_of_space: Callable[[JobRow, str], None]

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
        batches = {j: b for j, b in decision.batches.items() if slots.get(j) == decision.slots.get(j)}
        return (RoundDecision(decision.plan, actions, slots, decision.solved,
                              decision.decision_s + time.perf_counter() - t0, batches=batches),
                {sw.job_id for sw in adm.swaps})

    def check_deadlines(self, now: float) -> None:
        """Record one ``deadline_missed`` event for each unfinished job whose deadline has passed."""
        rows = [r for r in self.db.jobs(("queued", "running")) if r.deadline_s is not None]
        for jid in newly_missed(((r.id, r.deadline_s, r.deadline_missed) for r in rows), now):
            r = next(r for r in rows if r.id == jid)
            self.db.update_job(jid, deadline_missed=True)
            self.db.event("deadline_missed", jid, now=now, deadline_s=r.deadline_s, late_s=now - r.deadline_s,
                          steps_done=r.steps_done, steps=r.steps, state=r.state)
            log.warning("job %d missed its deadline (%d/%d steps done)", jid, r.steps_done, r.steps)

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
                        self._out_of_space(row, one_line(exc))
                    else:
                        self._fail(jid, one_line(exc))
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
                    if self.free_bytes(row.run_dir) < SERVICE_FREE_BYTES:  # stuck for want of space: not its fault
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
            # (the estimates are of the job's own batch, from which the elastic_batch policy fits the others)
            own = row.batch is None or row.batch["now"] == row.batch["base"]
            if own and len(s) >= 3 and s[-1][1] - s[0][1] >= 2 and s[-1][0] > s[0][0]:
                rate = (s[-1][1] - s[0][1]) / (s[-1][0] - s[0][0])
                fields["estimates"] = update_estimates(row.estimates, run.acc_type, run.workers, rate)
                self.db.event("throughput", jid, acc_type=run.acc_type, workers=run.workers, steps_per_s=rate)
                run.samples = s[-1:]
            self.db.update_job(jid, **fields)
        self.scheduler.end_round()
        if self.round_id is not None:
            self.db.end_round(self.round_id, time.time())
