"""When a worker with no virtual node times a probe VN (see :mod:`virtualflow.runtime.engine`).

A worker the heterogeneous solver gave no VN still has its speed measured: now and then, before
joining the step's reduction, it times one VN's forward and backward without contributing it.
:func:`probe_due` is the pure rule of when; the engine keeps the counters it reads. Invariant:
the delay probes add, amortised over the steps between them, is at most ``PROBE_BUDGET`` of the
time the worker waits for the others anyway.
"""

from __future__ import annotations

import math

__all__ = ["PROBE_BUDGET", "PROBE_CHANGE", "PROBE_EVERY", "probe_due"]

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
