"""What every worker process of a run is told: :class:`WorkerConfig`.

Its own module so that the worker's control-plane side (:mod:`virtualflow.runtime.channel`) and
the worker's life (:mod:`virtualflow.runtime.worker`) both read it without importing each other.
It is pickled to a worker process (local backend: on stdin) and sent through a Ray actor call:
the class keeps its name and fields. Invariant: plain values only (no process groups, no
tensors).

Two kinds of fields: the worker knobs of the job's
:class:`~virtualflow.config.options.LaunchOptions`, passed whole and as given in :attr:`options`
(a :class:`~virtualflow.config.worker_options.WorkerOptions`; their defaults live in
``LaunchOptions``), and what the launching process resolved for this run (the store's address,
the steps, the threads, the resume state, the run's id and key) or a worker resolves on its own
machine (:attr:`interface`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from virtualflow.config.job import JobSource
from virtualflow.config.worker_options import WorkerOptions

__all__ = ["WorkerConfig"]


@dataclass(slots=True, kw_only=True)
class WorkerConfig:
    """What every worker process of a run is told, built once by the launching process
    (:func:`virtualflow.launching.supervisor.worker_config`) from the job's
    :class:`~virtualflow.config.options.LaunchOptions` and what it resolved."""

    options: WorkerOptions
    """The job's worker knobs, as given (``cfg.options.reduction``, ``cfg.options.deterministic``, ...)."""
    store_host: str
    store_port: int
    job_source: JobSource
    total_steps: int
    state_dir: str
    overrides: dict[str, Any]
    """Job fields the options override (global_batch_size, virtual_nodes, seed)."""
    threads: int
    """Torch threads per worker: ``threads_per_worker``, else 1 in deterministic mode, else the backend's
    share of the cores."""
    resume_path: str | None
    initial_workers: int
    """Workers ``0 .. initial_workers-1`` start the job (load ``resume_path`` if given); later
    ids are newcomers that receive the state from a member."""
    slowdowns: dict[int, float]
    """Emulated slowness per worker id (see :class:`virtualflow.WorkerSpec`)."""
    store_timeout_s: float = 600.0
    """Bound on waits for the coordinator (a generation to join; a rendezvous)."""
    heartbeat_interval_s: float = 0.05
    """Seconds between two heartbeats of a worker's heartbeat thread."""
    keep_checkpoints: int = 2
    """Checkpoints written during training that are kept (the newest)."""
    job_id: str = ""
    """This launch's id (:func:`virtualflow.comm.auth.new_job_id`), named by every signed message."""
    interface: str = "auto"
    """What the worker's collectives (gloo) bind to and tell their peers: ``auto`` (the address
    that reaches the store), interface names or addresses
    (:class:`~virtualflow.config.options.LaunchOptions` ``interface``). Each worker resolves it on its
    own machine when it starts (:func:`virtualflow.comm.net.resolve_interface`); from then on it
    holds the addresses (so it is a field here, not one of the :attr:`options` given as they are)."""
    interface_knob: str = "--interface"
    """Where ``interface`` came from, for messages (a worker's entry point sets
    ``GLOO_SOCKET_IFNAME`` when its environment chose it)."""
    run_key: str = ""
    """The run key (:func:`virtualflow.comm.auth.run_key`): signs this worker's reports and checks
    what it reads from the store. Never sent through the store: the external backend blanks it in
    the configuration a joining worker receives, and the worker derives it from its token file."""

    def gloo_bind(self) -> list[str] | None:
        """The addresses gloo binds to, once :attr:`interface` is resolved (None while it is
        ``auto``: gloo's own choice)."""
        return None if self.interface == "auto" else self.interface.split(",")
