"""What the membership controller needs and offers around it: the launcher it drives, the
errors it ends a job with, and the validation of a resize target (shared with
``virtualflow resize`` and the job handle).

Invariants: :class:`JobFailed` is raised only when the membership cannot go on; its message
names the cause and the knob or command that helps. :func:`check_resize` raises ``ValueError``
naming the value, the rule and the knob.
"""

from __future__ import annotations

from typing import Any, Protocol


class WorkerLauncher(Protocol):
    """What the controller uses of a backend (a subset of :class:`virtualflow.backends.Backend`;
    tests pass fakes)."""

    def start_worker(self, worker_id: int) -> Any: ...

    def kill_worker(self, worker_id: int) -> str | None:
        """What was done, in words (``killed``, or how the worker was fenced out); None reads
        as ``killed``."""
        ...

    def poll(self) -> dict[int, int | None]: ...

    def pid(self, worker_id: int) -> int | None: ...


class JobFailed(RuntimeError):
    """The membership cannot go on (every worker lost, min_workers not reached in time, ...)."""


class FallbackRestart(JobFailed):
    """Bamboo: a loss redundancy cannot cover; the run is to restart from its last checkpoint."""


def check_resize(workers: Any, virtual_nodes: int, min_workers: int, stages: int | None = None) -> None:
    """Validate a resize target: names the value, the rule and the knob. ``stages``: the job is
    pipelined with that many workers per replica (stages x tensor), and resizes in whole pipeline
    replicas."""
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"resize to workers={workers!r}: the job needs at least 1 worker")
    if stages is not None:
        if workers % stages:
            lo = max(stages, (workers // stages) * stages)
            raise ValueError(
                f"resize to workers={workers} is not a multiple of the pipeline's {stages} stages (workers per "
                f"replica: stages x tensor); a pipelined "
                f"job grows and shrinks in whole pipeline replicas: resize to {lo} or {lo + stages}"
            )
        if workers // stages > virtual_nodes:
            raise ValueError(
                f"resize to workers={workers} makes {workers // stages} pipeline replicas, more than "
                f"virtual_nodes={virtual_nodes}: every replica needs at least one virtual node"
            )
    elif workers > virtual_nodes:
        raise ValueError(
            f"resize to workers={workers} is more than virtual_nodes={virtual_nodes}: every worker needs "
            f"at least one virtual node; resize to at most {virtual_nodes} or start the job with more "
            f"virtual nodes"
        )
    if workers < min_workers:
        raise ValueError(
            f"resize to workers={workers} is below min_workers={min_workers}; resize to at least "
            f"{min_workers} or start the job with a lower min_workers"
        )


def describe_exit(code: int) -> str:
    """A worker's exit code in words (``was killed by SIGKILL``, ``exited with code 1``)."""
    import signal  # the names of signals only (no handler is installed here)

    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
