"""Resize requests reaching a running job: :class:`ResizeRequests`.

Purpose: the supervisor's monitor loop hands the membership controller the resizes asked from
three places: this process (:meth:`virtualflow.JobHandle.resize`: checked at once, then queued),
outside (``virtualflow resize`` pushes a signed request to the store's request queue) and an
external worker asking to join when no slot is open (a grow by one, through the same path).

Invariants: a request from outside counts only when signed with the job's token for this job
id, fresh and not seen before, and of the request schema
(:func:`virtualflow.comm.protocol.parse_request`; the store has no authentication); others are
dropped and logged (``request_rejected``, bounded), never raised. The nonces of the last 20
requests taken are kept in :attr:`ResizeRequests.taken`, for ``status.json``.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

from virtualflow.comm import auth, protocol
from virtualflow.config.job import Job
from virtualflow.control.membership import MembershipController, check_resize
from virtualflow.plan.batch_schedule import fewest_virtual_nodes

__all__ = ["ResizeRequests"]


class ResizeRequests:
    """The resize requests of one run, taken by the monitor loop (:meth:`take`)."""

    def __init__(self, job: Job, min_workers: int, token: str, job_id: str, coordinator: Any, backend: Any,
                 controller: MembershipController, on_taken: Callable[[], None]) -> None:
        """``on_taken``: called after each request from outside is taken (the supervisor writes
        ``status.json`` then)."""
        self.job, self.min_workers, self.token, self.job_id = job, min_workers, token, job_id
        self.coordinator, self.backend, self.controller, self.on_taken = coordinator, backend, controller, on_taken
        self.queued: deque[int] = deque()
        """Resizes asked in this process, checked, not yet handed to the controller."""
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
        check_resize(workers, fewest_virtual_nodes(job)[0], self.min_workers,
                     job.pipeline.replica_workers if job.pipeline is not None else None)
        self.backend.check_capacity(workers)
        self.queued.append(workers)

    def take(self) -> None:
        """Hand the requests from this process and from outside to the controller."""
        while self.queued:
            self.controller.request_resize(self.queued.popleft(), source="api")
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
                check_resize(workers, fewest_virtual_nodes(self.job)[0], self.min_workers,  # a schedule's smallest V
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
        ctl, V = self.controller, fewest_virtual_nodes(self.job)[0]  # (a batch schedule's smallest V)
        want = max(ctl.target, len(ctl.members)) + 1
        if want > V:
            return f"the job already has {want - 1} workers for virtual_nodes={V}; every worker needs at least one virtual node"
        try:
            ctl.request_resize(max(want, self.min_workers), source="join")
        except ValueError as exc:
            return str(exc)
        return None
