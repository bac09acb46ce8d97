"""Stand-ins for the membership controller's launcher and clock, shared by the control-plane tests."""

from __future__ import annotations


class FakeLauncher:
    """A launcher whose workers are entries in a table: started (running, code None) or killed (-9)."""

    def __init__(self) -> None:
        self.codes: dict[int, int | None] = {}

    def start_worker(self, worker_id: int) -> None:
        self.codes[worker_id] = None

    def kill_worker(self, worker_id: int) -> str:
        self.codes[worker_id] = -9
        return "killed"

    def poll(self) -> dict[int, int | None]:
        return dict(self.codes)

    def pid(self, worker_id: int) -> int:
        return 1000 + worker_id

    def log_tail(self, worker_id: int, lines: int = 15) -> str:
        return f"last line of worker {worker_id}"

    def logs_where(self) -> str:
        return "logs in RUN/logs"


class Clock:
    """A fake clock: ``t`` is the time; tests move it."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t
