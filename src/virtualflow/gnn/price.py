"""The price model: what a run costs and its value (pure).

* Graph servers (and the CPU-only baseline's servers) are billed per server-hour for the whole
  run: ``server_usd_per_hour`` (default 0.34, an on-demand 8-vCPU compute instance such as AWS
  c5.2xlarge in us-east-1).
* Tensor workers are billed like serverless functions, only while they run a task: per
  GB-second of the task's duration (cold start, emulated latency and transfer included) at
  ``worker_gb``, ``usd_per_gb_s`` (default 0.0000166667, AWS Lambda's x86 price), plus
  ``usd_per_request`` per invocation (default 0.0000002, i.e. $0.20 per million). Timed-out and
  killed attempts are billed too. ``worker_gb`` defaults to 0.192 (Dorylus's Lambda size).

Value is Dorylus's measure, performance per dollar: ``1 / (time_s * cost_usd)``; we also report
vertex-epochs per dollar (``num_nodes * epochs / cost``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class PriceModel:
    server_usd_per_hour: float = 0.34
    """$ per graph-server (or CPU-only server) hour, billed for the whole run."""
    usd_per_gb_s: float = 0.0000166667
    """$ per GB-second of tensor-worker task time."""
    worker_gb: float = 0.192
    """Memory of one tensor worker, GB."""
    usd_per_request: float = 0.0000002
    """$ per tensor-worker invocation."""

    def __post_init__(self) -> None:
        for name in ("server_usd_per_hour", "usd_per_gb_s", "worker_gb", "usd_per_request"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"{name}={v!r} must be a number >= 0; pass --{name.replace('_', '-')}")

    def cost(self, *, servers: int, wall_s: float, worker_busy_s: float = 0.0, requests: int = 0) -> dict[str, float]:
        server = servers * wall_s / 3600.0 * self.server_usd_per_hour
        worker = worker_busy_s * self.worker_gb * self.usd_per_gb_s + requests * self.usd_per_request
        return {"server_usd": server, "worker_usd": worker, "cost_usd": server + worker}


def value(time_s: float, cost_usd: float) -> float:
    """Dorylus's value: performance (1 / time) per dollar."""
    return 1.0 / (time_s * cost_usd) if time_s > 0 and cost_usd > 0 else float("inf")
