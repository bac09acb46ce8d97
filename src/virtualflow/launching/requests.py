"""Resize requests reaching a running job: :class:`ResizeRequests`.

Purpose: the supervisor's monitor loop hands the membership controller the resizes asked from
three places: this process (:meth:`virtualflow.JobHandle.resize`: checked at once, then queued),
outside (``virtualflow resize`` pushes a signed request to the store's request queue) and an
external worker asking to join when no slot is open (a grow by one, through the same path).

A **batch change** (:meth:`ResizeRequests.ask_batch`, the cluster service's elastic-batch
decisions through :meth:`virtualflow.JobHandle.change_batch`) rides the same queue, in order with
the resizes: it becomes a ``batch`` control command (V and the learning-rate rule) that every
member reads at the same step boundary and applies from the next step not yet run
(:func:`virtualflow.runtime.step_boundary.apply_commands`). The step is the workers' to know: the
first step record whose ``samples`` are the new batch names it, and only then is the change
written to ``events.jsonl`` as a ``batch`` record (:meth:`ResizeRequests.observe`), the form
``Job.batch_schedule`` changes are written in at launch, so
:func:`~virtualflow.plan.batch_schedule.schedule_from_events` replays the run.

Invariants: a request from outside counts only when signed with the job's token for this job
id, fresh and not seen before, and of the request schema
(:func:`virtualflow.comm.protocol.parse_request`; the store has no authentication); others are
dropped and logged (``request_rejected``, bounded), never raised. The nonces of the last 20
requests taken are kept in :attr:`ResizeRequests.taken`, for ``status.json``. One batch change
is in flight at a time, and it is issued only when every member (and every resize asked before
it) has a virtual node at the new V: a smaller batch waits for the shrink asked before it.
"""

from __future__ import annotations

import json
from collections import deque
from typing import Any, Callable

from virtualflow.comm import auth, protocol
from virtualflow.config.job import Job
from virtualflow.control.membership import MembershipController, check_resize
from virtualflow.plan.batch_schedule import BatchSchedule, fewest_virtual_nodes

__all__ = ["ResizeRequests"]


class ResizeRequests:
    """The resize requests of one run, taken by the monitor loop (:meth:`take`)."""

    def __init__(self, job: Job, min_workers: int, token: str, job_id: str, coordinator: Any, backend: Any,
                 controller: MembershipController, on_taken: Callable[[], None]) -> None:
        """``on_taken``: called after each request from outside is taken (the supervisor writes
        ``status.json`` then)."""
        self.job, self.min_workers, self.token, self.job_id = job, min_workers, token, job_id
        self.coordinator, self.backend, self.controller, self.on_taken = coordinator, backend, controller, on_taken
        self.queued: deque[tuple[str, int, Any]] = deque()
        """Resizes ``("resize", workers, None)`` and batch changes ``("batch", V, lr_rule)`` asked
        in this process, checked, not yet handed on."""
        self.changes: list[tuple[int, int]] = list(job.batch_schedule)
        """The run's batch changes: the job's own, then each asked one once its step is known."""
        self.lr_rule: Any = job.lr_rule
        self.vns = fewest_virtual_nodes(job)[0]
        """The most workers the job may have (a batch change sets it to its V)."""
        self.in_flight: int | None = None
        """The V of the batch command issued whose first step is not known yet."""
        self.issued_at = 0
        """The steps recorded when it was issued (its first step is not before)."""
        self.taken: list[str] = []
        """The nonces of the last 20 requests from outside taken (``virtualflow resize --wait``)."""
        self.replay = auth.ReplayGuard()

    def __len__(self) -> int:
        """The resizes asked in this process not yet handed to the controller (what
        :meth:`JobHandle.resize` with ``wait=True`` waits out, with ``not supervisor.requests``)."""
        return len(self.queued)

    def ask(self, workers: int) -> None:
        """A resize asked in this process (:meth:`JobHandle.resize`); checked, then queued."""
        job = self.job
        pending = [n for kind, n, _ in self.queued if kind == "batch"]
        check_resize(workers, pending[-1] if pending else self.vns, self.min_workers,
                     job.pipeline.replica_workers if job.pipeline is not None else None)
        self.backend.check_capacity(workers)
        self.queued.append(("resize", workers, None))

    def ask_batch(self, virtual_nodes: int, lr_rule: Any) -> None:
        """A batch change asked in this process: ``virtual_nodes`` (same per-VN size) from the
        first step not yet run when the workers read it, the rate by ``lr_rule``; checked (the
        rule as ``Job.lr_rule`` is), then queued behind the resizes asked before it."""
        job, step = self.job, self.coordinator.progress.step
        if self.lr_rule is not None and lr_rule != self.lr_rule:
            raise ValueError(f"batch change with lr_rule={lr_rule!r} refused: the run's rule is {self.lr_rule!r} "
                             f"(Job.lr_rule); one rule per run")
        if any(s >= step for s, _ in self.changes):
            raise ValueError(f"batch change to virtual_nodes={virtual_nodes} refused: Job.batch_schedule changes the "
                             f"batch at a step not run yet ({self.changes})")
        asked = [v for kind, v, _ in self.queued if kind == "batch"]
        now = asked[-1] if asked else self.in_flight or (self.changes[-1][1] if self.changes else job.virtual_nodes)
        if virtual_nodes == now:
            return  # the batch it runs (or will): nothing to change
        # the rule and V checked as a schedule would be (one line naming value, rule and knob)
        BatchSchedule(job.global_batch_size, job.virtual_nodes, (*self.changes, (step + 1, virtual_nodes)), lr_rule)
        self.queued.append(("batch", virtual_nodes, lr_rule))

    def take(self) -> None:
        """Hand the requests from this process and from outside to the controller (a batch change
        waits, with what was asked after it, until it can be issued)."""
        while self.queued:
            kind, n, rule = self.queued[0]
            if kind == "resize":
                self.controller.request_resize(n, source="api")
            elif not self._issue_batch(n, rule):
                break
            self.queued.popleft()
        rejects = self.coordinator.rejects
        for raw in protocol.pop_raw(self.coordinator.store, protocol.REQUESTS_QUEUE, limit=100):
            try:
                req = protocol.parse_request(self.token, self.job_id, raw, self.replay)
            except ValueError as exc:
                rejects("request_rejected", exc, raw, auth=False)
                continue
            try:
                workers = req["workers"]
                self.backend.check_capacity(workers)
                check_resize(workers, self.vns, self.min_workers,  # a schedule's smallest V, or a change's
                             self.job.pipeline.replica_workers if self.job.pipeline is not None else None)
                self.controller.request_resize(workers, source=req["source"][:40])
                # ``virtualflow resize --wait`` looks for its nonce here: only a status written
                # after its request was taken tells whether the request has been carried out.
                self.taken = (self.taken + [req["nonce"]])[-20:]
                self.on_taken()
            except ValueError as exc:  # signed, but not possible (beyond virtual_nodes, ...)
                rejects("request_rejected", exc, raw, auth=True)

    def grow_for_join(self) -> str | None:
        """An external worker asked to join and no slot is open: grow the job by one through
        the ordinary resize path. Returns why not, or None."""
        ctl, V = self.controller, self.vns  # (a batch schedule's smallest V, or a batch change's)
        want = max(ctl.target, len(ctl.members)) + 1
        if want > V:
            return f"the job already has {want - 1} workers for virtual_nodes={V}; every worker needs at least one virtual node"
        try:
            ctl.request_resize(max(want, self.min_workers), source="join")
        except ValueError as exc:
            return str(exc)
        return None

    def _issue_batch(self, virtual_nodes: int, lr_rule: Any) -> bool:
        """Issue a queued batch change once no other is in flight and every member and target has
        a virtual node at its V; returns whether it was issued."""
        ctl = self.controller
        if self.in_flight is not None or ctl.busy or max(ctl.target, len(ctl.members)) > virtual_nodes:
            return False
        rule = lr_rule if isinstance(lr_rule, str) else {str(b): m for b, m in lr_rule.items()}
        self.coordinator.command("batch", virtual_nodes=virtual_nodes, lr_rule=json.dumps(rule))
        self.in_flight, self.lr_rule, self.vns = virtual_nodes, lr_rule, virtual_nodes
        self.issued_at = self.coordinator.progress.step
        # later resizes are bounded by the new V, and their maps are of it
        ctl.V = ctl.speed_policy.V = virtual_nodes
        ctl.speed_policy.B = virtual_nodes * (self.job.global_batch_size // self.job.virtual_nodes)
        return True

    def observe(self, reports: list[dict[str, Any]]) -> None:
        """The first step record at the batch in flight names its first step: the change is
        written to ``events.jsonl`` then (a ``batch`` record, as :meth:`BatchSchedule.events`)."""
        if self.in_flight is None:
            return
        job = self.job
        n = job.global_batch_size // job.virtual_nodes
        for r in reports:
            if r.get("type") == "step" and r["step"] >= self.issued_at and r["samples"] == self.in_flight * n:
                self.changes.append((r["step"], self.in_flight))
                schedule = BatchSchedule(job.global_batch_size, job.virtual_nodes, tuple(self.changes), self.lr_rule)
                self.coordinator.event("batch", **schedule.events()[-1])
                self.in_flight = None
                return
