"""When a run is hung in its own code, and which workers are wedged (pure: times are passed in).

A worker can block in the job's own code (a callback that waits for ever, a streaming shard
that never arrives, a deadlock) while its heartbeat thread goes on beating: heartbeats show the
process is alive, not that it works. The membership controller therefore also watches **step
progress** (:class:`StepWatchdog`), against the run's own measured pace:

* after a step, the next one is due within ``max(floor_s, multiple x the median of the recent
  gaps between steps)`` (automatic; ``step_timeout_s=None``), or within ``step_timeout_s`` when
  it is given;
* the first step of a generation (building a group, moving state, warm-up, compilation) is due
  within ``first_step_s`` (automatic), or ``step_timeout_s`` when given;
* ``step_timeout_s=0`` turns the watchdog off.

A stall is acted on in two moves by the controller: it aborts the generation (a member waiting
on a peer in a collective sees the flag and reports a ``fault`` at once), then, after
``grace_s``, judges every member it has heard nothing from since the abort **wedged**
(:func:`decide_wedged`): such a worker is treated as a dead one (killed by the backend where it
owns the process, fenced, removed; the job fails when none is left).

The same watch bounds the formation of a generation (:func:`decide_unformed`): a published
generation whose members have all joined but that has not formed within the first-step
allowance is a failure, with its silent members judged wedged, instead of an endless
``recovering``.

Invariants: the limit never falls below ``floor_s`` (automatic) and is exactly
``step_timeout_s`` when given; the same observations give the same verdict; nothing here reads
a clock, a store or a process.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Collection, Mapping, Sequence

from virtualflow.control.membership.decisions import GiveUp, NoChange

__all__ = ["AUTO_FIRST_STEP_S", "AUTO_FLOOR_S", "AUTO_MULTIPLE", "Stalled", "StepWatchdog", "Wedged",
           "decide_unformed", "decide_wedged"]

AUTO_FLOOR_S = 120.0
"""Automatic limit: never fewer seconds than this between two steps (evaluations, checkpoint
writes and a planned change's pause come between steps)."""
AUTO_MULTIPLE = 10.0
"""Automatic limit: this many times the median recent gap between steps."""
AUTO_FIRST_STEP_S = 300.0
"""Automatic limit of a generation's first step and of its formation."""


@dataclass(frozen=True, slots=True)
class Stalled:
    """No step for ``waited_s`` seconds where ``limit_s`` was allowed; ``first``: the step was a
    generation's first. ``why`` says it in words, naming the knob."""

    waited_s: float
    limit_s: float
    first: bool
    why: str


@dataclass(frozen=True, slots=True)
class Wedged:
    """These members are wedged: each is handled as a failed worker, with ``causes[w]``."""

    workers: tuple[int, ...]
    causes: dict[int, str]


def _knob(timeout_s: float | None) -> str:
    if timeout_s is None:
        return ("step_timeout_s=auto: set step_timeout_s= (--step-timeout SECONDS) above the job's longest step, "
                "evaluation or checkpoint, or 0 (off)")
    return f"step_timeout_s={timeout_s:g} (--step-timeout)"


class StepWatchdog:
    """Step progress of the current generation (see the module docstring).

    ``timeout_s``: None (automatic), 0 (off) or the fixed limit in seconds. The controller calls
    :meth:`restart` when a generation formed (the next step is a first step), :meth:`step` for
    every step report, and :meth:`check` each tick while the job trains."""

    def __init__(self, timeout_s: float | None, *, floor_s: float = AUTO_FLOOR_S, multiple: float = AUTO_MULTIPLE,
                 first_step_s: float = AUTO_FIRST_STEP_S, window: int = 50) -> None:
        if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s >= 0):
            raise ValueError(f"step_timeout_s={timeout_s!r} must be None (automatic), 0 (off) or a finite number "
                             f"of seconds > 0 (--step-timeout)")
        self.timeout_s = timeout_s
        self.floor_s, self.multiple, self.first_step_s = floor_s, multiple, first_step_s
        self.gaps: deque[float] = deque(maxlen=window)
        """Recent gaps between consecutive step reports (a generation's first step left out)."""
        self.since: float | None = None  # the last progress: a step, or the generation's formation
        self.first = True  # no step since the last restart

    @property
    def enabled(self) -> bool:
        return self.timeout_s != 0

    def restart(self, now: float) -> None:
        """A generation formed (or training resumes): the next step is a first step."""
        self.since, self.first = now, True

    def idle(self) -> None:
        """Nothing trains until the next generation forms (a loss, a hold, the start): not timed
        here (the formation has its own bound, :func:`decide_unformed`)."""
        self.since, self.first = None, True

    def step(self, now: float) -> None:
        """A step was reported at ``now``."""
        if self.since is None:
            return  # a step of an aborted generation, reported late: not progress
        if not self.first:
            self.gaps.append(max(0.0, now - self.since))
        self.since, self.first = now, False

    def first_limit_s(self) -> float:
        """Seconds a generation's first step (or its formation) may take."""
        return self.first_step_s if self.timeout_s is None else self.timeout_s

    def limit_s(self) -> float:
        """Seconds the next step may take from the last progress."""
        if self.first:
            return self.first_limit_s()
        if self.timeout_s is not None:
            return self.timeout_s
        if not self.gaps:
            return self.floor_s
        return max(self.floor_s, self.multiple * statistics.median(self.gaps))

    def check(self, now: float) -> Stalled | None:
        """A :class:`Stalled` once the next step is overdue, else None (also when off or not started)."""
        if not self.enabled or self.since is None:
            return None
        waited, limit = now - self.since, self.limit_s()
        if waited <= limit:
            return None
        what = "the generation's first step" if self.first else "a step"
        median = ""
        if self.gaps and self.timeout_s is None:  # reports come in batches: a gap can read 0
            m = statistics.median(self.gaps)
            median = f"; median gap between steps {m:.3g} s" if m >= 0.001 else "; median gap between steps < 1 ms"
        return Stalled(waited, limit, self.first,
                       f"no step for {waited:.1f} s, where {what} may take {limit:.3g} s{median} "
                       f"({_knob(self.timeout_s)})")


def decide_wedged(*, members: Sequence[int], heard: Mapping[int, float], faulted: Collection[int], since: float,
                  now: float, grace_s: float, stalled: Stalled) -> Wedged | NoChange | None:
    """After a stall the generation was aborted at ``since``; ``heard`` is when each worker last
    sent a report, ``faulted`` the members that reported the stalled generation broken (at any
    time: a peer's collective may have timed out just before the abort). Those and the members
    that reported since the abort are alive and reacted (they were waiting on a peer); after
    ``grace_s`` the others are wedged. Returns None while the grace runs, :class:`NoChange` when
    every member reacted (the generation is simply retried)."""
    if now - since < grace_s:
        return None
    silent = tuple(w for w in members if heard.get(w, -math.inf) < since and w not in faulted)
    if not silent:
        return NoChange("every member answered the abort")
    cause = (f"made no progress ({stalled.why}) and did not answer the generation's abort within "
             f"{grace_s:g} s: wedged in the job's own code (a callback, the data, a deadlock); killed")
    return Wedged(silent, {w: cause for w in silent})


def decide_unformed(*, generation: int, kind: str, members: Sequence[int], joined: Sequence[int],
                    heard: Mapping[int, float], since: float, now: float, limit_s: float,
                    timeout_s: float | None) -> Wedged | GiveUp | NoChange:
    """Generation ``generation`` (a ``kind`` change) was published at ``since`` (or its last
    member joined then, or a step came then) and has not formed. Within ``limit_s`` nothing is
    decided, nor while a member has not joined (its start-up is judged elsewhere). After it, its
    members silent since ``since`` are wedged; when every member spoke, the job fails: the
    generation cannot form."""
    if timeout_s == 0 or now - since <= limit_s:
        return NoChange("within the formation's allowance")
    if any(w not in joined for w in members):
        return NoChange("a member is still starting")
    waited = now - since
    silent = tuple(w for w in members if heard.get(w, -math.inf) < since)
    if silent:
        cause = (f"did not take part in forming generation {generation} ({kind}) for {waited:.1f} s "
                 f"(allowed {limit_s:.3g} s; {_knob(timeout_s)}): wedged; killed")
        return Wedged(silent, {w: cause for w in silent})
    return GiveUp(f"generation {generation} ({kind}, members {list(members)}) did not form within {waited:.1f} s "
                  f"(allowed {limit_s:.3g} s; {_knob(timeout_s)}) although every member is alive; see the fault "
                  f"events in events.jsonl and the worker logs")
