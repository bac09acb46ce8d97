"""Fault injection, the injecting half: fire a worker's planned faults at the named points.

The plans themselves (:class:`~virtualflow.config.faults.Fault`,
:class:`~virtualflow.config.faults.FaultPlan`, the phases and actions) are configuration and live
in :mod:`virtualflow.config.faults`; they are re-exported here for the code that imported them
from this module. A fault fires at most once per process.
"""

from __future__ import annotations

import os
import signal

from virtualflow.config.faults import ACTIONS, PHASES, Fault, FaultPlan


class InjectedFault(RuntimeError):
    """Raised by an ``error`` fault."""


class WorkerFaults:
    """One worker's share of a plan; :meth:`point` is called at each named point."""

    def __init__(self, worker: int, faults: list[Fault]) -> None:
        self.worker = worker
        self._pending = {(f.step, f.phase): f for f in faults}

    @classmethod
    def of(cls, plan: FaultPlan, worker: int) -> "WorkerFaults":
        """``worker``'s share of ``plan``."""
        return cls(worker, plan.faults_of(worker))

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


__all__ = ["ACTIONS", "PHASES", "Fault", "FaultPlan", "InjectedFault", "WorkerFaults"]
