"""When the cluster service calls a job hung, and how long it lets a stop take (pure: no
processes, no clock; times are passed in).

A worker can hang in the job's own code (a deadlock, a sleep, a blocking read) while its
heartbeat thread is still alive: the job then looks healthy to anything that watches heartbeats
only. The service watches **step progress** instead, against the job's **own measured step
time**: a job that has made steps in this run is hung when no step has come for
``max(floor_s, factor x its median recent step time)``; one that has made none since it was
launched is hung after ``first_step_s`` (building, starting workers and the first step).
The same limit bounds how long a stop (preemption, move, cancel) may take before the job is
killed: a stop completes at the next step boundary, so a job that does not reach one within the
limit is hung as well.

Invariants: :meth:`StepClock.observe` only ever records progress when the step changes; the
limit never falls below ``floor_s``; the same observations give the same verdict.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

__all__ = ["HangRule", "StepClock"]


@dataclass(frozen=True, slots=True, kw_only=True)
class HangRule:
    """The service's hang limits (cluster configuration keys ``hang_factor``, ``hang_floor_s``,
    ``hang_first_step_s``)."""

    factor: float = 10.0
    """A job is hung after this many of its own (median, recent) step times without a step."""
    floor_s: float = 120.0
    """... but never before this many seconds: evaluations, checkpoint writes and resizes pause steps."""
    first_step_s: float = 600.0
    """A job that has made no step since its launch is hung after this long."""

    def __post_init__(self) -> None:
        for name in ("factor", "floor_s", "first_step_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and value < 1e9):
                raise ValueError(f"hang_{name}={value!r} must be a positive number (cluster configuration "
                                 f"key hang_{name})")

    def limit_s(self, step_times: list[float]) -> float:
        """Seconds without a step after which a job that has stepped is hung."""
        if not step_times:
            return self.first_step_s
        return max(self.floor_s, self.factor * statistics.median(step_times))

    def verdict(self, clock: StepClock, now_s: float) -> str | None:
        """Why the job watched by ``clock`` is hung at ``now_s``, or None."""
        idle = now_s - clock.since_s
        if not clock.stepped:
            if idle > self.first_step_s:
                return (f"no step within {idle:.0f} s of its launch (limit hang_first_step_s={self.first_step_s:g} "
                        f"s): hung while building the job, starting its workers or in its first step")
            return None
        limit = self.limit_s(clock.step_times)
        if idle > limit and not clock.step_times:
            return (f"no step for {idle:.0f} s after its first one (limit hang_first_step_s={self.first_step_s:g} s "
                    f"until a step time is measured): hung in the job's code or its workers")
        if idle > limit:
            return (f"no step for {idle:.0f} s while its steps took {statistics.median(clock.step_times):.3g} s "
                    f"(limit max(hang_floor_s={self.floor_s:g} s, hang_factor={self.factor:g} x step time) = "
                    f"{limit:.0f} s): hung in the job's code or its workers")
        return None


@dataclass(slots=True)
class StepClock:
    """A job's step progress as the service polls it: when the step last changed and the recent
    time per step (a poll that sees ``k`` steps after ``dt`` seconds records ``dt / k``). The
    first step after a launch is not timed: it includes starting the workers."""

    since_s: float
    """When progress was last seen (or the clock was started / reset)."""
    step: int | None = None
    """The last step seen (None before the job reported one)."""
    stepped: bool = False
    """Whether the job has made a step since the clock started."""
    step_times: list[float] = field(default_factory=list)
    keep: int = 20

    def observe(self, now_s: float, step: int | None, reported: list[float] | None = None) -> bool:
        """Record the step seen at ``now_s``, with the job's own recent step times if it reports
        them (its coordinator measures them: they replace the poll-based ones); returns whether
        the step advanced."""
        if reported:
            self.step_times = list(reported[-self.keep:])
        if step is None:
            return False
        if self.step is None:
            self.step = step
            return False
        if step <= self.step:
            return False
        if self.stepped and not reported:
            times = deque(self.step_times, maxlen=self.keep)
            times.append((now_s - self.since_s) / (step - self.step))
            self.step_times = list(times)
        self.stepped = True
        self.step, self.since_s = step, now_s
        return True

    def restart(self, now_s: float) -> None:
        """The job's shape changed (resize): its next step may take longer; the clock starts again
        but keeps the step times measured so far."""
        self.since_s = now_s
