"""When a worker with no virtual node times a probe VN (see :mod:`virtualflow.runtime.engine`).

A worker the heterogeneous solver gave no VN still has its speed measured: now and then, before
joining the step's reduction, it times one VN's forward and backward without contributing it.
:func:`probe_due` is the pure rule of when; :class:`ProbeCounters` keeps what it reads;
:class:`IdleProbe` is the engine's side (when to run the probe the engine times, what to learn
from it and from the waits between probes). Invariant:
the delay probes add, amortised over the steps between them, is at most ``PROBE_BUDGET`` of the
time the worker waits for the others anyway.
"""

from __future__ import annotations

import math
import time
from typing import Callable

__all__ = ["PROBE_BUDGET", "PROBE_CHANGE", "PROBE_EVERY", "IdleProbe", "ProbeCounters", "probe_due"]

PROBE_EVERY = 4
"""Steps between probes of a worker with no VN while a probe fits in the time it waits anyway."""
PROBE_BUDGET = 0.02
"""A probe expected to outlast that wait is spaced so that its delay, amortised over the steps
between probes, is at most this share of the step time."""
PROBE_CHANGE = 0.2
"""A probe that differs from the previous estimate by more than this (relative) is followed by
probes on the next ``PROBE_EVERY`` steps (when free), so a speed change is seen quickly."""


def probe_due(steps_since_probe: int, estimate_s: float, idle_s: float, *, burst: int = 0,
              ran_forward: bool = True) -> bool:
    """Whether a worker with no VN runs a probe VN in this step (see the module docstring).

    ``steps_since_probe`` counts the steps since its last probe, this one included;
    ``estimate_s`` is the expected probe time (the last probe's, else the measured VN time times
    the slowdown; 0 when unknown); ``idle_s`` the smoothed time it waits for the others in a
    step without a probe (0 until measured); ``burst`` the free probes still owed after a speed
    change (``PROBE_CHANGE``); ``ran_forward`` whether it has ever run a forward.

    A worker that never ran a forward, or has no estimate, probes now. Until its wait is
    measured it does not. A probe that fits in the wait is taken during a burst, else every
    ``PROBE_EVERY`` steps; a longer one is spaced so that its excess over the wait, amortised
    over the steps between probes, is at most ``PROBE_BUDGET`` of the wait.
    """
    if not ran_forward:
        return True  # measure (deterministic mode also needs the loss dtype)
    if estimate_s <= 0:
        return True
    if idle_s <= 0:
        return False  # learn first how long this worker waits for the others
    if burst > 0 and estimate_s <= idle_s:
        return True
    excess = max(0.0, estimate_s - idle_s)
    return steps_since_probe >= max(PROBE_EVERY, math.ceil(excess / (PROBE_BUDGET * idle_s)))


class ProbeCounters:
    """The counters :func:`probe_due` reads, kept by the engine of a worker with no VN."""

    def __init__(self) -> None:
        self.probe_s = 0.0
        """The last probe's time (emulated slowness included)."""
        self.idle_s = 0.0
        """Smoothed time the worker waits for the others in a step without a probe."""
        self.since_probe = 0
        self.burst = 0

    def new_generation(self) -> None:
        """A new generation: its waits are learnt again (the last probe's time is kept)."""
        self.idle_s = 0.0
        self.since_probe = 0
        self.burst = 0

    def estimate(self, vn_s: float) -> float:
        """The expected probe time: the last probe's, else ``vn_s`` (a VN's measured time)."""
        return self.probe_s if self.probe_s > 0 else vn_s

    def due(self, vn_s: float, *, ran_forward: bool) -> bool:
        """Count this step and tell whether it runs a probe (:func:`probe_due`)."""
        self.since_probe += 1
        return probe_due(self.since_probe, self.estimate(vn_s), self.idle_s, burst=self.burst,
                         ran_forward=ran_forward)

    def took(self, seconds: float, expected_s: float) -> None:
        """A probe took ``seconds`` (``expected_s`` before it): a change of more than
        ``PROBE_CHANGE`` starts a burst of probes on the next ``PROBE_EVERY`` steps."""
        if expected_s > 0 and abs(seconds - expected_s) > PROBE_CHANGE * expected_s:
            self.burst = PROBE_EVERY
        elif self.burst > 0:
            self.burst -= 1
        self.probe_s = seconds
        self.since_probe = 0

    def waited(self, seconds: float) -> None:
        """The worker waited ``seconds`` for the others in a step without a probe (smoothed)."""
        self.idle_s = seconds if self.idle_s == 0.0 else 0.7 * self.idle_s + 0.3 * seconds


class IdleProbe:
    """A worker with no VN, step by step: whether it probes before joining the reduction, what the
    probe teaches the counters, and how long it then waited for the others (the time a probe may
    take for free). The generation's first step (warm-up) teaches no wait."""

    def __init__(self) -> None:
        self.counters = ProbeCounters()
        self.steps_in_generation = 0

    def new_generation(self) -> None:
        self.counters.new_generation()
        self.steps_in_generation = 0

    def new_step(self) -> None:
        self.steps_in_generation += 1

    def compute(self, vn_s: float, ran_forward: bool, probe: Callable[[], float]) -> tuple[float, bool]:
        """Before the reduction: (the compute seconds to report, probed). ``vn_s``: a VN's
        expected time here; ``probe()`` times one VN's forward and backward (run when due)."""
        if not self.counters.due(vn_s, ran_forward=ran_forward):
            return 0.0, False
        old = self.counters.estimate(vn_s)
        took = probe()
        self.counters.took(took, old)
        return took, True

    def note_idle(self, t_step: float, probed: bool) -> None:
        """After the reduction of a step that began at ``t_step``: the wait, unless it probed."""
        if probed or self.steps_in_generation <= 1:
            return
        self.counters.waited(time.perf_counter() - t_step)
