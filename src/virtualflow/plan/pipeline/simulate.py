"""Event simulation of a pipeline schedule on a p-rank machine. Pure code, no processes.

Each rank runs its action list in order. A compute action takes its stage's time; a send takes
no time on its rank (it is asynchronous) and its message arrives ``comm_time`` later; a receive
ends when its message has arrived (at once if it already has). Time a rank spends blocked in a
receive is idle, as is time after its last action. So the result is a function of the schedule
and the times only: deterministic, and exact when the times are integers or ``Fraction``s.

Times: ``f_time`` is a stage's forward; ``b_time`` its *whole* backward; ``w_time`` the part of
``b_time`` that is the weight gradient. A full backward ``B`` takes ``b_time``; a split schedule's
``I`` takes ``b_time - w_time`` and its ``W`` takes ``w_time`` (``w_time=None`` means 0: ``I`` is
the whole backward). Each is a scalar or one value per stage. So 1F1B and zero-bubble compare on
the same work per micro-batch.

Verified formulas (tests/unit/test_pipeline_schedules.py), equal stage times, ``comm_time = 0``:

- 1F1B and GPipe, any ``m`` and ``p``: step time ``(m + p - 1)(f + b)``; every rank's bubble
  ``(p-1)/(m+p-1)``; peak stash ``min(m, p - r)`` for 1F1B, ``m`` for GPipe.
- interleaved 1F1B with ``p*v`` stages of equal times and ``m`` a multiple of ``p``: step time
  ``(v*m + p - 1)(f + b)``, bubble ``(p-1)/(v*m + p - 1)`` on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Real
from typing import Sequence, Union

from .check import check, message_key
from .schedules import Action, Schedule

Times = Union[Real, Sequence[Real]]


@dataclass(frozen=True, slots=True)
class Slot:
    """One action as it ran: ``start`` to ``end`` on its rank."""

    action: Action
    start: Real
    end: Real


@dataclass(frozen=True, slots=True)
class SimResult:
    """What a simulated step (or ``schedule.steps`` steps) looks like."""

    timeline: tuple[tuple[Slot, ...], ...]
    """Per rank, one slot per action, in the rank's order."""
    step_time: Real
    """Makespan: when the last rank finishes (all start at 0)."""
    busy: tuple[Real, ...]
    """Per rank: time spent computing (F, B, I, W)."""
    bubble: tuple[float, ...]
    """Per rank: idle time over the makespan, ``1 - busy / step_time``."""
    peak_stash: tuple[int, ...]
    """Per rank: the most activations held at once."""


def _per_stage(name: str, value: Times, stages: int) -> list[Real]:
    if isinstance(value, Real):
        out = [value] * stages
    else:
        out = list(value)
        if len(out) != stages:
            raise ValueError(
                f"simulate: {name} has {len(out)} values for {stages} stages; give one per stage or a scalar"
            )
    for x in out:
        if x < 0:
            raise ValueError(f"simulate: {name} has a negative time {x}; times must be >= 0")
    return out


def simulate(
    schedule: Schedule,
    f_time: Times,
    b_time: Times,
    w_time: Times | None = None,
    comm_time: Real = 0,
) -> SimResult:
    """Run ``schedule`` (checked first) with the given per-stage times; see the module docstring."""
    result = check(schedule)
    stages = schedule.stages
    f = _per_stage("f_time", f_time, stages)
    b = _per_stage("b_time", b_time, stages)
    w = _per_stage("w_time", 0 if w_time is None else w_time, stages)
    for s in range(stages):
        if w[s] > b[s]:
            raise ValueError(
                f"simulate: w_time={w[s]} on stage {s} exceeds b_time={b[s]}; w_time is the weight part of b_time"
            )
    if comm_time < 0:
        raise ValueError(f"simulate: comm_time={comm_time} must be >= 0")
    duration = {"F": f, "B": b, "I": [b[s] - w[s] for s in range(stages)], "W": w}

    p = schedule.p
    clock: list[Real] = [0] * p
    busy: list[Real] = [0] * p
    slots: list[list[Slot]] = [[] for _ in range(p)]
    arrival: dict[tuple[str, int, int, int], Real] = {}
    ptr = [0] * p
    while any(ptr[r] < len(schedule.actions[r]) for r in range(p)):
        for r, acts in enumerate(schedule.actions):
            while ptr[r] < len(acts):
                a = acts[ptr[r]]
                start = clock[r]
                if a.kind.startswith("RECV"):
                    key = message_key(a)
                    if key not in arrival:
                        break  # blocked until the peer sends; check() proved it will
                    end = max(start, arrival[key])
                elif a.kind.startswith("SEND"):
                    end = start
                    arrival[message_key(a)] = start + comm_time
                else:
                    end = start + duration[a.kind][a.stage]
                    busy[r] += end - start
                slots[r].append(Slot(a, start, end))
                clock[r] = end
                ptr[r] += 1
    makespan = max(clock) if p else 0
    bubble = tuple(float(1 - busy[r] / makespan) if makespan else 0.0 for r in range(p))
    return SimResult(
        timeline=tuple(tuple(s) for s in slots), step_time=makespan, busy=tuple(busy),
        bubble=bubble, peak_stash=result.peak_stash,
    )

