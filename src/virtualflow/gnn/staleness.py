"""Bounded asynchrony: the epoch counters and the blocking rule (pure).

Counters: ``completed[i]`` is the number of epochs interval ``i`` has finished (its last
backward task's gradients handed to the parameter server); while it works, interval ``i`` is in
epoch ``completed[i]``. ``written[l][k]`` is the latest epoch whose layer-``l`` rows of interval
``k`` (forward: its apply-vertex output; backward: its gather's gradient contributions) have been
scattered to the graph servers; ``-1`` before any.

Blocking rule, for a staleness bound ``S >= 0``:

1. **Start**: interval ``i`` may start epoch ``e`` only when ``e - min_k completed[k] <= S``: no
   interval is ever more than ``S`` epochs ahead of the slowest.
2. **Read**: a gather of interval ``i`` in epoch ``e`` reads each neighbour interval ``k``'s latest
   rows and waits while ``written[l][k] < max(0, e - S)``: a value read is at most ``S`` epochs
   old (and exists).

With ``S = 0`` the two rules make every epoch synchronous: all intervals start together, every
gather reads the same epoch's values, and the parameter server applies one update per epoch from
all intervals' gradients: full-graph training. With ``S >= 1`` no rule can wait on a value that
is still to come from an interval that is itself waiting (the values it needs are from epochs
``<= e - S - 1``, finished by everyone), so there is no deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


def check_staleness(staleness: int) -> None:
    if not isinstance(staleness, int) or isinstance(staleness, bool) or staleness < 0:
        raise ValueError(f"staleness={staleness!r} must be an int >= 0 (0 = synchronous); pass --staleness S")


def may_start(epoch: int, completed: Sequence[int], staleness: int) -> bool:
    """Rule 1: may an interval start ``epoch``?"""
    return epoch - min(completed) <= staleness


def fresh_enough(written: int, epoch: int, staleness: int) -> bool:
    """Rule 2: may a gather in ``epoch`` read a neighbour whose latest rows are from ``written``?"""
    return written >= max(0, epoch - staleness)


@dataclass(slots=True)
class StalenessLog:
    """What the rules allowed: the largest lead and the oldest value read (for tests and reports)."""

    max_lead: int = 0  # max over epoch starts of epoch - min(completed)
    max_read_age: int = 0  # max over reads of epoch - written (negative = read a newer epoch)
    reads: int = 0
    stale_reads: int = 0
    leads: list[int] = field(default_factory=list)

    def started(self, epoch: int, completed: Sequence[int]) -> None:
        lead = epoch - min(completed)
        self.max_lead = max(self.max_lead, lead)
        self.leads.append(lead)

    def read(self, epoch: int, written: int) -> None:
        self.reads += 1
        age = epoch - written
        self.max_read_age = max(self.max_read_age, age)
        if age > 0:
            self.stale_reads += 1
