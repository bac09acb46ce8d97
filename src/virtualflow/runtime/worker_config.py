"""What every worker process of a run is told: :class:`WorkerConfig`.

Its own module so that the worker's control-plane side (:mod:`virtualflow.runtime.channel`) and
the worker's life (:mod:`virtualflow.runtime.worker`) both read it without importing each other.
It is pickled to a worker process (local backend: on stdin) and sent through a Ray actor call:
the class keeps its name and fields. Invariant: plain values only (no process groups, no
tensors); the options' defaults live in :class:`~virtualflow.options.LaunchOptions`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from virtualflow.config.job import JobSource
from virtualflow.runtime.faults import FaultPlan

__all__ = ["WorkerConfig"]


@dataclass(slots=True, kw_only=True)
class WorkerConfig:
    """What every worker process of a run is told, built once by the launching process from the
    job's :class:`~virtualflow.options.LaunchOptions` and what it resolved (store address,
    steps, threads, resume state). The options' defaults live there, not here."""

    store_host: str
    store_port: int
    job_source: JobSource
    total_steps: int
    state_dir: str
    overrides: dict[str, Any]
    """Job fields the options override (global_batch_size, virtual_nodes, seed)."""
    deterministic: bool
    threads: int
    device: str
    collective_timeout_s: float
    checkpoint_every: int | None
    resume_path: str | None
    initial_workers: int
    """Workers ``0 .. initial_workers-1`` start the job (load ``resume_path`` if given); later
    ids are newcomers that receive the state from a member."""
    fault_plan: FaultPlan | None
    slowdowns: dict[int, float]
    """Emulated slowness per worker id (see :class:`virtualflow.WorkerSpec`)."""
    control_plane: bool
    """False (benchmarks only): no heartbeat thread and no per-step control read, so stop,
    resize and hang detection do not work; it measures what the control plane costs."""
    reduction: str = "allreduce"
    shard_replicas: int = 0
    deterministic_exchange: str = "auto"
    """Deterministic mode's exchange (:class:`~virtualflow.options.LaunchOptions` ``deterministic_exchange``)."""
    """``reduction="sharded"``: 1 keeps each chunk of the optimizer state on the next worker too
    (:class:`~virtualflow.options.LaunchOptions` ``shard_replicas``)."""
    loader_workers: int = 0
    """Threads that load the next virtual nodes' batches while the current ones compute
    (:class:`~virtualflow.options.LaunchOptions` ``loader_workers``; 0: load when needed)."""
    breakdown: bool = True
    """Measure where each step's time goes (:mod:`virtualflow.runtime.breakdown`)."""
    profile_steps: tuple[int, int] | None = None
    """``[first, last)`` steps traced with ``torch.profiler`` into ``state_dir/profile/``."""
    """How gradients are combined (:class:`~virtualflow.options.LaunchOptions` ``reduction``)."""
    store_timeout_s: float = 600.0
    """Bound on waits for the coordinator (a generation to join; a rendezvous)."""
    heartbeat_interval_s: float = 0.05
    coordinator_timeout_s: float = 15.0
    """A worker whose heartbeat thread cannot reach the store for this long exits (code 3)
    (:class:`~virtualflow.options.LaunchOptions` ``coordinator_timeout_s``)."""
    keep_checkpoints: int = 2
    checkpoint_format: str = "pt"
    """``pt``: one state file per checkpoint (rank 0); ``dcp``: every worker writes its part
    (:mod:`virtualflow.runtime.dcp`)."""
    async_checkpoint: bool = False
    """``dcp`` checkpoints written on a thread while training goes on."""
    job_id: str = ""
    """This launch's id (:func:`virtualflow.comm.auth.new_job_id`), named by every signed message."""
    interface: str = "auto"
    """What the worker's collectives (gloo) bind to and tell their peers: ``auto`` (the address
    that reaches the store), interface names or addresses
    (:class:`~virtualflow.options.LaunchOptions` ``interface``). Each worker resolves it on its
    own machine when it starts (:func:`virtualflow.comm.net.resolve_interface`); from then on it
    holds the addresses."""
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
