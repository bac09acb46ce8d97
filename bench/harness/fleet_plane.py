"""The coordinator's side of the simulated fleet (:mod:`bench.harness.fleet`): the real
coordinator and membership controller, run as the launcher runs them.

:class:`ControlPlane` is the launcher's own loop in miniature: a real
:class:`~virtualflow.control.coordinator.Coordinator` (its ``TCPStore`` on 127.0.0.1, port 0)
and :class:`~virtualflow.control.membership.MembershipController`, polled and ticked by one
monitor thread exactly as ``launching/supervisor.py`` does (poll, tick, ``status.json`` at the
pace of :class:`~virtualflow.control.status_pace.StatusPace`, a 10 ms pause while a generation
forms, else 50 ms). Its launcher is a :class:`SimLauncher`: starting a worker asks the fleet for
one, killing it silences it, exits come back as exit codes. Every store call the coordinator makes
is counted (:class:`~bench.harness.fleet.Counting`).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import virtualflow as vf
from bench.harness.fleet import Counting
from virtualflow.control.coordinator import Coordinator
from virtualflow.control.membership import MembershipController
from virtualflow.control.status_pace import StatusPace, monitor_tick_s
from virtualflow.records.rundir import write_json


class SimLauncher:
    """The controller's :class:`~virtualflow.control.membership.WorkerLauncher` over a fleet."""

    def __init__(self, inbox: Any, outbox: Any) -> None:
        self.inbox, self.outbox = inbox, outbox
        self.codes: dict[int, int | None] = {}
        self.stats: dict[str, dict[str, Any]] = {}
        """The latest counts of the fleet's client and of each beater (after a ``("stats",)``)."""

    def start_worker(self, worker_id: int) -> None:
        self.codes[worker_id] = None
        self.inbox.put(("start", worker_id))

    def kill_worker(self, worker_id: int) -> str:
        self.codes[worker_id] = -9
        self.inbox.put(("kill", worker_id))
        return "killed"

    def poll(self) -> dict[int, int | None]:
        while True:
            try:
                msg = self.outbox.get_nowait()
            except queue.Empty:
                return dict(self.codes)
            if msg[0] == "exit" and self.codes.get(msg[1]) is None:
                self.codes[msg[1]] = msg[2]
            elif msg[0] == "stats":
                self.stats[msg[1]] = msg[2]
            elif msg[0] == "error":
                raise RuntimeError(f"the fleet's {msg[1]} stopped: {msg[2]}")

    def pid(self, worker_id: int) -> int:
        return 100000 + worker_id


@dataclass
class ControlPlane:
    """The coordinator's side: a real coordinator and membership controller over a fleet, run by
    one monitor thread as the launcher runs them (see the module docstring). ``workers`` start
    the job; ``virtual_nodes`` default to ``4 x workers`` (room to grow)."""

    workers: int
    inbox: Any
    outbox: Any
    run_dir: str | None = None
    total_steps: int = 10**6
    virtual_nodes: int | None = None
    heartbeat_timeout_s: float = 3.0
    counts: dict[str, float] = field(default_factory=dict)
    latencies: dict[int, float] = field(default_factory=dict)
    """Step -> seconds from its report's making (its ``time``) to the coordinator reading it (the
    first time: a report re-sent after a regroup is not counted again)."""
    tick_s: list[float] = field(default_factory=list)
    """CPU seconds of each monitor loop (the monitor thread's own time)."""

    def __post_init__(self) -> None:
        self.coord = Coordinator(total_steps=self.total_steps, run_dir=self.run_dir)
        self.coord.store = Counting(self.coord.store, self.counts)
        self.launcher = SimLauncher(self.inbox, self.outbox)
        options = vf.LaunchOptions(workers=self.workers, steps=self.total_steps,
                                   heartbeat_timeout_s=self.heartbeat_timeout_s, step_timeout_s=600.0)
        self.ctl = MembershipController(self.coord, self.launcher, options,
                                        virtual_nodes=self.virtual_nodes or 4 * self.workers)
        self.spec_fields = {"host": "127.0.0.1", "port": self.coord.port, "key": self.coord.run.key,
                            "job": self.coord.job_id, "total_steps": self.total_steps,
                            "timeout_s": min(options.heartbeat_timeout_s, options.coordinator_timeout_s),
                            "initial_workers": self.workers}
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.status_bytes = 0
        self.status_pace = StatusPace()

    def start(self) -> None:
        self.ctl.start()
        self.thread = threading.Thread(target=self._monitor, name="control-plane", daemon=True)
        self.thread.start()

    def _monitor(self) -> None:
        try:
            while not self._stop.is_set():
                t_cpu = time.thread_time()
                with self._lock:
                    reports = self.coord.poll()
                    now = time.time()
                    for r in reports:
                        if r["type"] == "step":
                            self.latencies.setdefault(r["step"], now - r["time"])
                    self.ctl.tick(reports)
                    self.status_pace.write(self.write_status)
                self.tick_s.append(time.thread_time() - t_cpu)
                time.sleep(monitor_tick_s(len(self.ctl.members), self.ctl.busy))
        except BaseException as exc:  # noqa: BLE001 - read by the caller
            self.error = exc

    def write_status(self) -> None:
        """``status.json``'s per-worker part, as the launcher writes it (its worker table and the
        recent step times); its size is what grows with the fleet."""
        data = {"step": self.coord.progress.step, "generation": self.ctl.generation, "phase": self.ctl.phase.value,
                "workers": self.ctl.worker_table(),
                "recent_step_times_s": [h["step_time_s"] for h in self.coord.history[-10:]]}
        if self.run_dir is not None:
            path = os.path.join(self.run_dir, "status.json")
            write_json(path, data)
            self.status_bytes = os.path.getsize(path)

    def call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` between two monitor loops (the controller has one actor at a time)."""
        with self._lock:
            return fn(*args)

    def stop(self) -> None:
        self._stop.set()
        if hasattr(self, "thread"):
            self.thread.join(timeout=10)
        self.coord.close()
