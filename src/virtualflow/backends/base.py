"""The backend protocol: :class:`Backend` (everything the API and the membership controller ask of
a backend) and :class:`Attachment` (what a backend gets from the running coordinator).

Its own module so that every backend (local, ray, external) can name the protocol without
importing the package that chooses among them (:func:`virtualflow.backends.make_backend`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

if TYPE_CHECKING:
    from virtualflow.runtime.worker import WorkerConfig


@dataclass(frozen=True, slots=True)
class Attachment:
    """What a backend gets from the running coordinator."""

    config: WorkerConfig
    """Every worker's configuration (store address, job, steps, ...)."""
    state_dir: str
    """The run directory (or a temporary one): logs, final state."""
    store: Any
    """The job's TCPStore (the coordinator is its server)."""
    token: str
    """The job's secret token: what joins and control requests are signed with."""
    grow: Callable[[], str | None]
    """Ask the controller for one more worker (a join with no open slot); returns why not, or None."""
    event: Callable[..., None]
    """Record a structured event in ``events.jsonl``."""


class Backend(Protocol):
    """Everything the API and the membership controller ask of a backend."""

    name: str
    """``"local"``, ``"ray"`` or ``"external"``: for records and messages only."""
    kind_of_worker: str
    """What the workers are, for the start-up line ("local processes", "Ray actors", ...)."""

    def store_address(self) -> tuple[str, int]:
        """Where the coordinator's store listens (host, port; port 0 picks a free one). Called
        once, before the coordinator exists (the Ray backend connects to its cluster here)."""
        ...

    def default_threads(self, workers: int) -> int:
        """Torch threads per worker when the user gave none (not in deterministic mode)."""
        ...

    def check_capacity(self, workers: int, *, knob: str = "--workers") -> None:
        """Raise ``ValueError`` (naming the short resource and ``knob``) when ``workers``
        workers could never be placed; no-op where capacity is not known."""
        ...

    def attach(self, attachment: Attachment) -> None:
        """Called once the coordinator's store runs, before the first worker starts."""
        ...

    def start_worker(self, worker_id: int) -> Any: ...

    def kill_worker(self, worker_id: int) -> str:
        """Stop one worker at once (fencing: works on a hung one); returns what was done, in
        words, for failure messages (``killed``; a backend that cannot stop its workers says
        how it fenced the worker out instead)."""
        ...

    def poll(self) -> dict[int, int | None]:
        """Exit code of every worker started so far, None while it runs."""
        ...

    def pid(self, worker_id: int) -> int | None: ...

    def log_tail(self, worker_id: int, lines: int = 15) -> str:
        """The last lines of a worker's output ("" when unknown), for failure messages."""
        ...

    def logs_where(self) -> str:
        """Where the workers' output is, as a failure message's tail (``logs in RUN_DIR/logs``)."""
        ...

    def serve(self, reports: Sequence[dict[str, Any]]) -> None:
        """Called by the job's monitor every tick with the workers' reports (joins, exits)."""
        ...

    def terminate_all(self, grace_s: float = 3.0) -> None:
        """End every worker still running (SIGTERM, then SIGKILL after ``grace_s``)."""
        ...

