"""Where the driver's tasks run: the :class:`Executor` protocol, the counters every executor keeps
(:class:`ExecutorStats`), and the in-process :class:`SimExecutor` (a virtual clock).

The executors that start processes (graph-server and tensor-worker processes, a Ray pool) live in
:mod:`virtualflow.backends.gnn`: only ``backends/`` starts processes. Every executor takes the same
requests and returns the same replies; the driver cannot tell them apart, so the fast in-process
tests exercise the scheduling, staleness and weight-stashing logic the process runs use. The
engine never chooses or starts its executor: its caller builds one and hands it over.
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import Any, Callable, Protocol

from virtualflow.gnn.servers import GraphServer, ServerPart
from virtualflow.gnn.workers import WorkerLimits, run_tensor_task, task_bytes


class Executor(Protocol):
    """Runs the driver's requests: ``submit_gs``/``submit_tw`` are answered through ``wait`` (their
    ``tag`` comes back with the reply), ``post_gs`` has no reply; ``stats`` counts tensor-worker use."""

    stats: ExecutorStats

    def warm_up(self) -> None: ...
    def submit_gs(self, server: int, req: tuple, tag: Any) -> None: ...
    def post_gs(self, server: int, req: tuple) -> None: ...
    def submit_tw(self, task: dict, tag: Any, home: int) -> None: ...
    def wait(self) -> tuple[Any, Any]: ...
    def now(self) -> float: ...
    def close(self) -> None: ...


class ExecutorStats:
    """What the tensor workers were used for: billed time, invocations, relaunches, bytes each way."""

    def __init__(self) -> None:
        self.tw_busy_s = 0.0  # billed tensor-worker time (failed attempts included)
        self.tw_tasks = 0  # invocations (attempts)
        self.relaunches = 0
        self.timeouts = 0
        self.bytes_to_tw = 0
        self.bytes_from_tw = 0


class SimExecutor:
    """Everything in this process; durations on a virtual clock.

    A request is computed when submitted (in submission order, so a graph server sees its
    scatters and requests in order) and completes at ``max(now, resource free) + duration``: each
    graph server is one resource, the tensor workers ``L`` more (with ``L = 0`` the tensor work
    runs on the interval's graph server). ``duration(kind, interval)`` (kind ``"gs"`` or
    ``"tw"``) defaults to 1 s; ``duration="measured"`` uses the time the computation itself just
    took in this process (real task times replayed on a virtual clock, without other processes'
    interference). Tensor tasks add the emulated limits.
    """

    def __init__(self, parts: list[ServerPart], tensor_workers: int, limits: WorkerLimits,
                 duration: Callable[[str, int], float] | str | None = None) -> None:
        self.measured = duration == "measured"
        if isinstance(duration, str) and not self.measured:
            raise ValueError(f"sim_duration={duration!r} must be a function, 'measured' or None")
        self.servers = [GraphServer(p) for p in parts]
        self.specs, self.activation = parts[0].specs, parts[0].activation
        self.limits = limits
        self.duration = duration if callable(duration) else (lambda kind, interval: 1.0)
        self.gs_free = [0.0] * len(parts)
        self.tw_free = [0.0] * tensor_workers
        self.tw_started = [False] * tensor_workers
        self.clock = 0.0
        self.events: list[tuple[float, int, Any, Any]] = []
        self.seq = itertools.count()
        self.stats = ExecutorStats()

    def now(self) -> float:
        return self.clock

    def warm_up(self) -> None:
        """Nothing to start: everything runs in this process."""

    def _finish(self, t: float, tag: Any, out: Any) -> None:
        heapq.heappush(self.events, (t, next(self.seq), tag, out))

    def submit_gs(self, server: int, req: tuple, tag: Any) -> None:
        t0 = time.perf_counter()
        out = self.servers[server].handle(req)
        took = time.perf_counter() - t0
        start = max(self.clock, self.gs_free[server])
        self.gs_free[server] = start + (took if self.measured else self.duration("gs", tag[0]))
        self._finish(self.gs_free[server], tag, out)

    def post_gs(self, server: int, req: tuple) -> None:
        self.servers[server].handle(req)

    def submit_tw(self, task: dict, tag: Any, home: int) -> None:
        t0 = time.perf_counter()
        out = run_tensor_task(self.specs, self.activation, task)
        d = time.perf_counter() - t0 if self.measured else self.duration("tw", tag[0])
        if not self.tw_free:  # CPU-only: the graph server does it
            start = max(self.clock, self.gs_free[home])
            self.gs_free[home] = start + d
            self._finish(start + d, tag, out)
            return
        w = min(range(len(self.tw_free)), key=lambda j: self.tw_free[j])
        nbytes_in, nbytes_out = task_bytes(task), task_bytes(out)
        d += self.limits.latency_s + self.limits.transfer_s(nbytes_in + nbytes_out)
        if not self.tw_started[w]:
            d += self.limits.cold_start_s
            self.tw_started[w] = True
        start = max(self.clock, self.tw_free[w])
        self.tw_free[w] = start + d
        self.stats.tw_busy_s += d
        self.stats.tw_tasks += 1
        self.stats.bytes_to_tw += nbytes_in
        self.stats.bytes_from_tw += nbytes_out
        self._finish(start + d, tag, out)

    def wait(self) -> tuple[Any, Any]:
        if not self.events:
            raise RuntimeError("the driver waits for a task but none is in flight (a scheduling bug)")
        t, _, tag, out = heapq.heappop(self.events)
        self.clock = max(self.clock, t)
        return tag, out

    def close(self) -> None:
        pass
