"""How a worker is described to the mapper: its device, memory limit and (for emulation) speed."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerSpec:
    """One worker of a heterogeneous job.

    ``slowdown`` emulates a slower device on one machine: after each virtual node's compute the
    worker sleeps ``slowdown - 1`` times that compute's measured duration, so a worker with
    ``slowdown=3`` takes three times as long per VN (sleeping frees the CPU, so unequal devices
    can be emulated on 2 cores). It changes speed only, never what is computed.
    """

    device: str = "cpu"
    memory_limit: int | None = None
    """The largest VN batch (samples) this worker can hold; None: no limit."""
    slowdown: float = 1.0
    resources: dict[str, float] = field(default_factory=dict)
    """Ray backend only: custom resources this worker's actor asks for on top of the job's own
    (e.g. ``{"accel_v100": 1}`` to place it on a node of that accelerator type). Unequal
    devices then get VNs by their measured speed, like any unequal workers."""

    def __post_init__(self) -> None:
        if not isinstance(self.resources, dict) or not all(
                isinstance(k, str) and k and isinstance(v, (int, float)) and not isinstance(v, bool)
                and math.isfinite(v) and v > 0 for k, v in self.resources.items()):
            raise ValueError(f"WorkerSpec resources={self.resources!r} must map resource names to numbers > 0, "
                             f"e.g. {{'accel_v100': 1}}")
        if not (isinstance(self.slowdown, (int, float)) and math.isfinite(self.slowdown) and self.slowdown >= 1.0):
            raise ValueError(f"WorkerSpec slowdown={self.slowdown!r} must be a number >= 1 (1 = full speed)")
        if self.memory_limit is not None and (not isinstance(self.memory_limit, int) or self.memory_limit < 1):
            raise ValueError(f"WorkerSpec memory_limit={self.memory_limit!r} must be a positive number of samples")
