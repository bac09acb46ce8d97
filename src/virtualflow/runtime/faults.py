"""Fault injection: crash or hang a chosen worker at a chosen step and phase (a test tool).

A :class:`FaultPlan` travels to the workers with their configuration; each worker fires the
faults planned for itself when it reaches the named point. The points cover every moment a
failure can strike a step or a membership change:

==================  =========================================================================
phase               where the worker is when the fault fires
==================  =========================================================================
before_forward      at the start of the step, before any VN's forward
mid_backward        inside the backward of the step's last VN (gradient buckets in flight;
                    pipelines: the step's first backward action)
send_recv           pipelines: the step's first point-to-point message (an activation) is sent
during_reduction    the gradient all-reduce is launched and peers are inside it (pipelines: the
                    step's commit all-reduce)
after_reduction     the reduced gradient is held, before the optimizer step is applied
state_transfer      a state broadcast to newcomers has begun (fires on source and receivers)
==================  =========================================================================

Actions: ``crash`` (SIGKILL itself: no report, sockets closed by the kernel), ``hang``
(SIGSTOP itself: silent, only heartbeats reveal it), ``error`` (raise an exception, as a
bug in user code would) and ``lose`` (this worker's collective fails as if a peer had gone
while the others' completes: with ``after_reduction``, a commit all-reduce that finished on
the other members but not here). A fault fires at most once per process.

Usage::

    plan = FaultPlan([Fault(worker=1, step=3, phase="during_reduction")])
    vf.train(job, workers=3, steps=8, fault_plan=plan)
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field

PHASES = ("before_forward", "mid_backward", "send_recv", "during_reduction", "after_reduction", "state_transfer")
ACTIONS = ("crash", "hang", "error", "lose")


class InjectedFault(RuntimeError):
    """Raised by an ``error`` fault."""


@dataclass(frozen=True, slots=True)
class Fault:
    worker: int
    """Worker id (ids are never reused: a replacement gets a new id)."""
    step: int | None
    """Step at which to fire (for ``state_transfer``: the step the transfer happens before);
    None: the first time the worker reaches ``phase``."""
    phase: str = "before_forward"
    action: str = "crash"

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"Fault phase={self.phase!r} is not one of {', '.join(PHASES)}")
        if self.action not in ACTIONS:
            raise ValueError(f"Fault action={self.action!r} is not one of {', '.join(ACTIONS)}")
        if self.worker < 0 or (self.step is not None and self.step < 0):
            raise ValueError(f"Fault worker={self.worker} and step={self.step} must be >= 0")


@dataclass(slots=True)
class FaultPlan:
    faults: list[Fault] = field(default_factory=list)

    def for_worker(self, worker: int) -> "WorkerFaults":
        return WorkerFaults(worker, [f for f in self.faults if f.worker == worker])


class WorkerFaults:
    """One worker's share of a plan; :meth:`point` is called at each named point."""

    def __init__(self, worker: int, faults: list[Fault]) -> None:
        self.worker = worker
        self._pending = {(f.step, f.phase): f for f in faults}

    def __bool__(self) -> bool:
        return bool(self._pending)

    def point(self, step: int, phase: str) -> None:
        fault = self._pending.pop((step, phase), None) or self._pending.pop((None, phase), None)
        if fault is None:
            return
        if fault.action == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.action == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault.action == "lose":
            from virtualflow.comm.groups import PeerFailure

            raise PeerFailure(-1, f"injected: worker {self.worker} lost the collective at step {step}, phase {phase}")
        else:
            raise InjectedFault(f"injected error in worker {self.worker} at step {step}, phase {phase}")
