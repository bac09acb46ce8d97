"""Fault injection plans: crash or hang a chosen worker at a chosen step and phase (a test tool).

This is the data half, what a user writes (:class:`Fault`, :class:`FaultPlan`); the injecting
half, which fires a worker's faults, is :mod:`virtualflow.runtime.faults`.

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
after_update        ``reduction="sharded"``: the worker's chunk is updated, before the
                    parameters' all-gather (with ``shard_replicas=1``, after the step's commit)
state_transfer      a state broadcast to newcomers has begun (fires on source and receivers)
during_checkpoint   a sharded (``dcp``) checkpoint: this worker's tensors are written, its part
                    not yet marked complete
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

from dataclasses import dataclass, field

PHASES = ("before_forward", "mid_backward", "send_recv", "during_reduction", "after_reduction", "after_update",
          "state_transfer", "during_checkpoint")
"""``during_checkpoint``: a sharded (``dcp``) checkpoint's write, after this worker's tensors are
written and before its part is marked complete (on the saver's thread when asynchronous)."""
ACTIONS = ("crash", "hang", "error", "lose")


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

    def faults_of(self, worker: int) -> list[Fault]:
        """The faults planned for ``worker``."""
        return [f for f in self.faults if f.worker == worker]


__all__ = ["ACTIONS", "PHASES", "Fault", "FaultPlan"]
