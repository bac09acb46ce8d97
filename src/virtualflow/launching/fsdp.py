"""``reduction="fsdp"``'s checks made at launch, on the model and optimizer built once in the
launching process, before any worker starts.

Purpose: every mistake a worker would otherwise meet while sharding its model is refused here in
one line that names the value, the rule and the knob: units that do not exist or are nested
(``shard_units``), a weight shared by two units, more workers (``workers``, and ``max_workers``
the autoscaler may grow to) than a unit has elements, an optimizer whose update is not
elementwise, and ``offload="cpu"`` when the workers started on this host would keep more in host
memory than it has available.

Invariants: nothing here starts anything or changes the model; the units are those the workers
resolve (:mod:`virtualflow.runtime.fsdp.units`, the same functions); the host-memory estimate is
:func:`virtualflow.plan.memory.worker_bytes`'s sharded state (parameters, gradients and optimizer
state, each worker ``1/W`` of every unit), compared by :func:`~virtualflow.plan.memory.check_host_memory`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from virtualflow.config.options import LaunchOptions
from virtualflow.plan.memory import check_host_memory, optimizer_slots, worker_bytes
from virtualflow.runtime.fsdp.units import ROOT, Unit, check_units, resolve_units, unit_params
from virtualflow.runtime.sharded import check_optimizer

__all__ = ["FsdpLaunch", "available_host_bytes", "check_fsdp_optimizer", "host_bytes_per_worker"]


def available_host_bytes(path: str = "/proc/meminfo") -> int | None:
    """The host's available memory (``MemAvailable`` of ``/proc/meminfo``), ``None`` where unknown."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_fsdp_optimizer(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> None:
    """The sharded reduction's rule (:func:`virtualflow.runtime.sharded.check_optimizer`: an
    elementwise update, one dtype and device), its message naming ``reduction='fsdp'``."""
    try:
        check_optimizer(optimizer, params)
    except ValueError as exc:
        raise ValueError(str(exc).replace("reduction='sharded'", "reduction='fsdp'")) from None


def host_bytes_per_worker(units: Sequence[Unit], optimizer: torch.optim.Optimizer, workers: int) -> float:
    """What one of ``workers`` keeps in host memory with ``offload="cpu"``: its shards of every
    unit's parameters, gradients and optimizer state (:func:`virtualflow.plan.memory.worker_bytes`)."""
    sizes = [u.numel for u in units if u.name != ROOT]
    root = sum(u.numel for u in units if u.name == ROOT)
    elem = max((p.element_size() for u in units for p in u.params), default=4)
    slots = optimizer_slots(type(optimizer).__name__, optimizer.param_groups)
    return worker_bytes("fsdp", sizes, slots, workers, root_numel=root, param_bytes=elem, offload=True).host


@dataclass(frozen=True)
class FsdpLaunch:
    """The facts of the launch ``reduction="fsdp"``'s model checks need (:meth:`of` reads them
    from the options), and the checks (:meth:`check`)."""

    shard_units: tuple[str, ...] | None
    workers: int
    """Workers started."""
    max_workers: int | None = None
    """The autoscaler's upper bound (``None``: no autoscaler)."""
    offload: str | None = None
    local: bool = False
    """The workers run on this host (the local backend), so their host memory is this host's."""
    available_bytes: int | None = None
    """This host's available memory (``None``: unknown, or not needed)."""

    @classmethod
    def of(cls, opts: LaunchOptions, max_workers: int | None = None) -> "FsdpLaunch | None":
        """``None`` unless ``opts.reduction == "fsdp"``; ``max_workers``: the autoscaler's bound."""
        if opts.reduction != "fsdp":
            return None
        local = opts.backend == "local"
        memory = available_host_bytes() if opts.offload == "cpu" and local else None
        return cls(shard_units=opts.shard_units, workers=opts.start_workers, max_workers=max_workers,
                   offload=opts.offload, local=local, available_bytes=memory)

    def check(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              params: Sequence[torch.Tensor]) -> list[Unit]:
        """Refuse what cannot be sharded (``ValueError``, one line); returns the units."""
        units = unit_params(model, resolve_units(model, self.shard_units))
        check_units(units, self.workers)
        if self.max_workers is not None and self.max_workers > self.workers:
            try:
                check_units(units, self.max_workers)
            except ValueError as exc:
                raise ValueError(f"the autoscaler may grow the job to max_workers={self.max_workers} "
                                 f"(--max-workers): {exc}; or lower --max-workers") from None
        check_fsdp_optimizer(optimizer, params)
        if self.offload == "cpu" and self.local:  # every worker on this host: W of them, 1/W each
            for w in sorted({self.workers, self.max_workers or self.workers}):
                check_host_memory(host_bytes_per_worker(units, optimizer, w), w, self.available_bytes)
        return units
