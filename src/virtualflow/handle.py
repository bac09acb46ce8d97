"""A running job as the user holds it: :class:`JobHandle`.

``status()``, ``resize()``, ``change_batch()``, ``wait()``, ``stop()``, ``kill()`` and ``set_slowdown()`` (emulation).
The work is done by the job's :class:`~virtualflow.launching.supervisor.Supervisor` (the monitor loop in a
thread of this process); the handle is its public face.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from virtualflow.backends import Backend
from virtualflow.control.autoscale_executor import AutoscaleExecutor
from virtualflow.control.coordinator import Coordinator
from virtualflow.control.membership import MembershipController
from virtualflow.plan.vnmap import describe_assignment
from virtualflow.records.result import Result
from virtualflow.config.spec import WorkerSpec
from virtualflow.launching.supervisor import RunSetup, Supervisor

logger = logging.getLogger("virtualflow")


class JobHandle:
    """A running job: ``status()``, ``resize()``, ``wait()``, ``stop()``, ``kill()``."""

    def __init__(self, setup: RunSetup) -> None:
        self._sup = Supervisor(setup)
        self.job = setup.job
        self.run_dir = setup.run_dir
        self.total_steps = setup.total_steps
        self.options = setup.options
        """The run's launch options (validated)."""
        self.state_dir = setup.state_dir
        """Where the run's records, checkpoints and final state are (``run_dir``, or a temporary
        folder when none was given)."""

    # Read-only views of the parts (tests and benchmarks observe them; they change nothing).
    @property
    def coordinator(self) -> Coordinator:
        return self._sup.coordinator

    @property
    def controller(self) -> MembershipController:
        return self._sup.controller

    @property
    def backend(self) -> Backend:
        return self._sup.backend

    @property
    def autoscaler(self) -> AutoscaleExecutor | None:
        return self._sup.autoscaler

    def start(self) -> None:
        """Start the workers and the monitor (called once, by :func:`virtualflow.launch`)."""
        s = self._sup.setup
        job, V, n = self.job, self.job.virtual_nodes, s.options.start_workers
        msg = (
            f"{job.name}: global batch {job.global_batch_size} = {V} virtual nodes x "
            f"{job.global_batch_size // V}; {s.total_steps} steps ({s.steps_per_epoch} per epoch) "
            f"on {n} worker{'s' if n > 1 else ''} ({self.backend.kind_of_worker}, "
            f"{s.threads} thread{'s' if s.threads > 1 else ''} each"
            f"{', deterministic' if s.options.deterministic else ''}); {describe_assignment(s.assignment)}"
        )
        if s.resume_path:
            msg += f"; resuming from {s.resume_path} (step {s.resume_step})"
        logger.info(msg)
        if s.options.backend == "external":
            host, port = self.coordinator.host, self.coordinator.port
            logger.info("waiting for %d worker%s to join %s:%d; on each machine run: virtualflow worker --join "
                        "%s:%d --token-file FILE (the job's token is in %s; copy it there, mode 0600)",
                        n, "s" if n > 1 else "", host, port, host, port, s.token_path)
        else:
            logger.info("control requests (virtualflow resize) are signed with the token in %s", s.token_path)
        if self.autoscaler is not None:
            a = self.autoscaler
            logger.info("autoscale: policy %s between %d and %d workers (%s)", a.policy.name, a.limits.min_workers,
                        a.limits.max_workers, a.policy)
        self._sup.start()

    def status(self) -> dict[str, Any]:
        """State, step, generation, workers (id, pid, rank, VNs), recent step times, loss, ..."""
        return self._sup.status()

    def resize(self, workers: int, *, wait: bool = False, timeout_s: float = 120.0) -> None:
        """Change the number of workers; it takes effect at a step boundary, without a restart.

        Growing starts new workers, which build the job before they join (training goes on
        meanwhile) and receive the full state from a survivor; shrinking lets the highest ranks
        leave. ``B``, ``V`` and the trained model are unchanged. With ``wait=True``, block until
        a generation with ``workers`` members has formed.
        """
        sup = self._sup
        if sup.finished.is_set():
            raise RuntimeError(f"the job has {self.coordinator.progress.state}; it cannot be resized")
        sup.request_resize(workers)
        if not wait:
            return
        deadline = time.monotonic() + timeout_s
        while True:
            ctl = self.controller
            if not sup.requests and not ctl.busy and ctl.target == workers and len(ctl.members) == workers:
                return
            if sup.finished.is_set():
                if sup.error is not None:
                    raise sup.error
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"resize to {workers} workers not done after {timeout_s} s "
                                   f"(generation {ctl.generation}, {len(ctl.members)} members)")
            time.sleep(0.02)

    def change_batch(self, virtual_nodes: int, lr_rule: Any) -> None:
        """Change the global batch to ``virtual_nodes`` VNs of the same size, in place: every
        worker takes it at the same step boundary, from the first step not yet run, with the
        learning rate times ``lr_rule``'s multiplier (``"linear"``, ``"sqrt"`` or ``{batch:
        multiplier}``, relative to the job's own batch, as ``Job.lr_rule``). The step it applied at
        is written to ``events.jsonl`` as a ``batch`` record once a worker has run it. A smaller V
        than the workers waits for a resize asked before it; resize after a larger one."""
        sup = self._sup
        if sup.finished.is_set():
            raise RuntimeError(f"the job has {self.coordinator.progress.state}; its batch cannot change")
        sup.request_batch(virtual_nodes, lr_rule)

    def set_slowdown(self, worker: int, factor: float) -> None:
        """Emulation: make worker ``worker`` ``factor`` times slower from the next step boundary
        (a straggler appears; with balance on, the mapper notices and rebalances)."""
        WorkerSpec(slowdown=factor)  # validates
        self.coordinator.command("slowdown", worker=worker, factor=float(factor))

    def wait(self, timeout_s: float | None = None) -> Result:
        """Block until the job ends; returns its :class:`Result` or raises :class:`TrainingError`."""
        sup = self._sup
        if not sup.finished.wait(timeout_s):
            raise TimeoutError(f"the job is still running after {timeout_s} s (step {self.coordinator.progress.step})")
        if sup.error is not None:
            raise sup.error
        assert sup.result is not None
        return sup.result

    def stop(self, timeout_s: float = 60.0, *, reason: str = "stop() called") -> Result:
        """Stop at the next step boundary, keeping the state reached (``final.pt``); returns the
        Result. ``reason`` is recorded in ``status.json``, ``summary.json`` and the ``done`` event."""
        if not self._sup.finished.is_set() and self._sup.stop_reason is None:
            self._sup.stop_reason = reason
            self.coordinator.progress.state = "stopping"
            if self.coordinator.progress.stop_request is None:  # what the log says when it ends
                self.coordinator.progress.stop_request = reason
            self.coordinator.command("stop")
        try:
            return self.wait(timeout_s)
        except TimeoutError:
            self.kill()
            raise

    def kill(self) -> None:
        """Terminate the workers at once (no final state)."""
        self.backend.terminate_all(grace_s=1.0)
        self._sup.finished.wait(10.0)

    @property
    def done(self) -> bool:
        return self._sup.finished.is_set()
