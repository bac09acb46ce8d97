"""Efficiency policies over effective throughput: makespan, total throughput, total JCT.

Notation as in ``fairness``: ``thr_i(X) = sum_k T[i, k] X[i, k]`` steps/s, ``R_i`` steps left.

- ``makespan``: maximise ``min_i thr_i(X) / R_i`` (the slowest job's rate of finishing), i.e.
  minimise ``max_i R_i / thr_i(X)``, the time the last job would finish if X were kept. One LP with
  a variable ``t``; objective reported: that makespan in seconds, ``1 / t``. With ``spread=s > 0``
  (default 0.05) the allocation returned is a central point
  (``lp.central_point``) of the allocations that finish every job within ``(1 + s)`` times that
  makespan, which is what Gavel's policy returns (bisection on the makespan to within 5 %, then an
  interior-point solve of the feasibility problem). Planned that way, every job has time on
  several types and no type is planned full, so the round mechanism has work for every free GPU
  while jobs finish and the allocation is re-solved: on the static traces of Gavel's scripts (100
  jobs at t = 0 on 8:8:8, restarts free) ``spread=0.05`` finished 2.5 % sooner over seeds 0-9 and
  5.3 % over seeds 10-19 than the filled vertex (``bench/gavel_trace.py``, docs/cluster.md), so
  it is the default. ``spread=0``: the optimal vertex HiGHS returns, filled (``lp.max_min``).
- ``max_throughput``: maximise ``sum_i thr_i(X) / best_i``, total throughput with each job's
  steps/s normalised by its best type's (raw steps/s of different models are not comparable).
- ``min_jct``: a linear surrogate of minimum total JCT: maximise ``sum_i w_i thr_i(X) / R_i``, the
  sum of the inverse remaining times. On one type it is the fractional knapsack that runs jobs in
  order of least remaining GPU-time (SRPT, optimal for total completion time on one machine); with
  several types it also puts each job where its speed-up is largest. The exact ``min sum R_i /
  thr_i(X)`` is convex but not linear, and it ignores that finishing jobs free GPUs for others.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from virtualflow.cluster.policies import lp
from virtualflow.cluster.policies.base import Allocation, PolicyInput
from virtualflow.cluster.policies.fairness import single_rows


@dataclass(kw_only=True, slots=True)
class Makespan:
    """Minimise the time the last job finishes (objective: that time in seconds)."""

    name: str = "makespan"
    fill: bool = True
    """Give capacity the bottleneck jobs cannot use to the others (``lp.max_min``); spread = 0 only."""
    spread: float = 0.05
    """> 0: return a central point of the allocations within ``(1 + spread)`` x the optimal makespan
    (Gavel's choice; 0.05 is Gavel's bisection tolerance); 0: the filled optimal vertex."""

    def __post_init__(self) -> None:
        if not (0.0 <= self.spread < 1.0):
            raise ValueError(f"spread={self.spread} must be in [0, 1) (e.g. 0.05: within 5 % of the optimal "
                             "makespan); 0 keeps the filled optimal vertex")

    def allocate(self, inp: PolicyInput) -> Allocation:
        C = np.where(inp.runnable, inp.T, 0.0) / inp.remaining_steps[:, None]
        X, t = lp.max_min(C, inp.scales, inp.capacities, inp.runnable, fill=self.fill and self.spread == 0,
                          what=self.name)
        if self.spread > 0 and 0 < t < float("inf"):
            floor = np.where((C > 0).any(axis=1), t / (1.0 + self.spread), 0.0)
            central = lp.central_point(C, inp.scales, inp.capacities, inp.runnable, floor)
            if central is not None:
                X = central
        return single_rows(inp, X, 1.0 / t if t > 0 else float("inf"))


@dataclass(kw_only=True, slots=True)
class MaxThroughput:
    """Maximise total normalised throughput (objective: ``sum_i thr_i / best_i``)."""

    name: str = "max_throughput"

    def allocate(self, inp: PolicyInput) -> Allocation:
        T = np.where(inp.runnable, inp.T, 0.0)
        best = T.max(axis=1, keepdims=True) if inp.n else np.ones((0, 1))
        C = T / np.where(best > 0, best, 1.0)
        X, v = lp.max_sum(C, inp.scales, inp.capacities, inp.runnable, what=self.name)
        return single_rows(inp, X, v)


@dataclass(kw_only=True, slots=True)
class MinJct:
    """Linear surrogate of minimum total JCT (objective: ``sum_i w_i thr_i / R_i``, 1/s)."""

    name: str = "min_jct"

    def allocate(self, inp: PolicyInput) -> Allocation:
        C = np.where(inp.runnable, inp.T, 0.0) * (inp.weights / inp.remaining_steps)[:, None]
        X, v = lp.max_sum(C, inp.scales, inp.capacities, inp.runnable, what=self.name)
        return single_rows(inp, X, v)
