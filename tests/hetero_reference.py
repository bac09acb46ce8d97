"""Brute-force optima of the heterogeneous VN mapping problems (reference for tests).

Each function enumerates every assignment of a tiny instance and returns the best objective,
from the problem statement alone (no virtualflow code): what :func:`virtualflow.plan.hetero.solve`
(water-filling) and :func:`virtualflow.plan.hetero.solve_uneven` (an integer program) must match.
Exponential in the number of workers: keep inputs small.
"""

from __future__ import annotations

import math
from typing import Iterator, Sequence


def brute_force(virtual_nodes: int, time_per_vn: Sequence[float], min_vns: int = 0) -> float:
    """The least ``max_i c_i t_i`` over every composition ``sum c_i = virtual_nodes`` with
    ``c_i >= min_vns`` (``inf`` when there is none)."""
    n = len(time_per_vn)
    best = math.inf

    def rec(i: int, left: int, worst: float) -> None:
        nonlocal best
        if worst >= best:  # this branch cannot beat the best found
            return
        if i == n - 1:
            best = min(best, max(worst, left * time_per_vn[i]))
            return
        for c in range(min_vns, left - (n - 1 - i) * min_vns + 1):
            rec(i + 1, left - c, max(worst, c * time_per_vn[i]))

    if virtual_nodes >= n * min_vns:
        rec(0, virtual_nodes, 0.0)
    return best


def _compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every way to write ``total`` as ``parts`` positive integers, in order."""
    if parts == 1:
        yield (total,)
        return
    for first in range(1, total - parts + 2):
        for rest in _compositions(total - first, parts - 1):
            yield (first,) + rest


def brute_force_uneven(V: int, B: int, per_vn_s: Sequence[float], per_sample_s: Sequence[float],
                       memory_limits: Sequence[int | None] | None = None) -> float:
    """The least slowest-worker time ``max_i per_vn_s[i] c_i + per_sample_s[i] n_i`` over every
    ``sum c_i = V``, ``sum n_i = B``, ``1 <= c_i <= n_i`` and ``n_i <= c_i * memory_limits[i]``
    (``inf`` when nothing fits)."""
    n = len(per_vn_s)
    limits = memory_limits or [None] * n
    best = math.inf
    for cs in _compositions(V, n):
        for ns in _compositions(B, n):
            if any(c > m for c, m in zip(cs, ns)):
                continue
            if any(lim is not None and m > lim * c for c, m, lim in zip(cs, ns, limits)):
                continue
            best = min(best, max(per_vn_s[i] * cs[i] + per_sample_s[i] * ns[i] for i in range(n)))
    return best
