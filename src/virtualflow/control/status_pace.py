"""When the launcher rewrites ``status.json`` and how often its monitor ticks: often enough to watch,
never a cost that grows with W.

``status.json`` holds a row per worker (about 200 bytes each), and each rewrite serialises the
whole file: about 11 ms of CPU at W = 1,024 (``json`` with indentation, the non-finite check,
the atomic write), so two writes a second cost 2 % of a core there and 20 % at W = 10,000.
:class:`StatusPace` spaces the writes by their own measured cost: at least ``floor_s`` apart
(0.5 s, what a small job always had), and far enough apart that writing takes at most
``budget`` of one core (0.5 %): a write that took ``c`` seconds of CPU makes the next one due
``max(floor_s, c / budget)`` later. At W = 1,024 that is about every 2.2 s; below W ~ 250
nothing changes. A forced write (a state change the file must show at once: a request taken, the job's
end) is written whatever the pace, and counts towards it.

:func:`monitor_tick_s` paces the launcher's monitor loop the same way: every 50 ms (10 ms while
a change is forming), and past 500 workers every ``W / 10,000`` seconds, because part of each
tick is O(W) (the launcher's exit codes of every worker, the liveness judge over them): spaced
by W, that part stays the same share of a core at any W (about 1 % at W = 1,024 in
``bench.control_plane``) instead of growing with it. The price is latency off the step's path: the
coordinator reads a report or an exit up to ``W / 10,000`` s after it came (0.1 s at W = 1,024,
1 s at 10,000); silent workers are judged by the heartbeat sweep's own clock, changes at 10 ms.

Invariants: the pace never holds a write back more than ``max(floor_s, c / budget)`` after the
last one (``c`` its cost), and it reads no clock but the two it is given (tests pass fakes).
"""

from __future__ import annotations

import time
from typing import Callable

TICK_S = 0.05
"""The monitor's interval at steady state up to :data:`TICK_WORKERS` workers."""
BUSY_TICK_S = 0.01
"""The monitor's interval while a published generation forms (it looks closer during changes)."""
TICK_WORKERS = 500
"""Past this many workers the steady interval grows as ``W x TICK_S / TICK_WORKERS``."""


def monitor_tick_s(workers: int, busy: bool) -> float:
    """Seconds the launcher's monitor sleeps between two ticks (see the module docstring)."""
    if busy:
        return BUSY_TICK_S
    return max(TICK_S, workers * TICK_S / TICK_WORKERS)


STATUS_FLOOR_S = 0.5
"""The shortest interval between two paced ``status.json`` writes."""
STATUS_BUDGET = 0.005
"""The share of one core the paced writes may take (their CPU time over the interval): a tenth
of the coordinator's 5 % at W = 1,024."""


class StatusPace:
    """Decides when a status write is due and times each write (see the module docstring)."""

    def __init__(self, floor_s: float = STATUS_FLOOR_S, budget: float = STATUS_BUDGET,
                 clock: Callable[[], float] = time.monotonic, cpu: Callable[[], float] = time.thread_time) -> None:
        self.floor_s, self.budget, self.clock, self.cpu = floor_s, budget, clock, cpu
        self.next_at = float("-inf")
        """When the next paced write is due (``clock`` time)."""
        self.last_cost_s = 0.0
        """The CPU seconds the last write took."""

    def write(self, fn: Callable[[], None], force: bool = False) -> bool:
        """Run ``fn`` (one status write) if it is due or ``force``; returns whether it ran. The
        next write is due ``max(floor_s, cost / budget)`` after this one starts."""
        start = self.clock()
        if not force and start < self.next_at:
            return False
        t_cpu = self.cpu()
        try:
            fn()
        finally:
            self.last_cost_s = max(0.0, self.cpu() - t_cpu)
            self.next_at = start + max(self.floor_s, self.last_cost_s / self.budget)
        return True
