"""Queue policies: FIFO and QSSF (quasi-shortest-service-first, from the Helios study).

Both order the jobs, then fill the cluster greedily: each job in order gets all of its time
(``X = 1``) on the fastest type that still has ``scale_factor`` free GPUs (heterogeneity-aware;
``aware=False`` takes the type with the most free GPUs instead); a job that does not fit waits and
later, smaller jobs may pass it (backfilling). No job is time-shared, elastic jobs run at their
``scale_factor`` (these policies never resize).

Invariant: a job gets either 0 or 1 of its time, on one type; capacity is never exceeded.
The fill walks the queue once (O(n_jobs x n_types)): it is sequential by nature.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from virtualflow.cluster.policies.base import Allocation, PolicyInput


def greedy_fill(inp: PolicyInput, order: np.ndarray, aware: bool = True) -> np.ndarray:
    """X (n_jobs, n_types) of the greedy fill in ``order`` (see the module docstring)."""
    n, k = inp.n, len(inp.types)
    X = np.zeros((n, k))
    free = inp.capacities.copy()
    s = inp.scales
    score = np.where(inp.runnable, inp.T if aware else 0.0, -np.inf)
    smallest = s.min() if n else 0.0
    for i in order:
        fits = free >= s[i]
        if not fits.any():
            if free.max() < smallest:
                break
            continue
        cand = np.where(fits, score[i] if aware else np.where(inp.runnable[i], free, -np.inf), -np.inf)
        c = int(np.argmax(cand))
        if not np.isfinite(cand[c]):
            continue
        X[i, c] = 1.0
        free[c] -= s[i]
    return X


def _single_rows(inp: PolicyInput, X: np.ndarray, **info) -> Allocation:
    return Allocation(rows=[(j.job_id,) for j in inp.jobs], X=X,
                      gpus={j.job_id: j.scale_factor for j in inp.jobs},
                      objective=float((X.sum(axis=1) > 0).sum()), info=info)


@dataclass(kw_only=True, slots=True)
class Fifo:
    """First in, first out (by arrival, then job id); ``by_weight=True`` orders by weight first
    (a priority queue)."""

    name: str = "fifo"
    aware: bool = True
    """Place each job on its fastest free type (False: on the type with the most free GPUs)."""
    by_weight: bool = False
    """Order by descending weight, then arrival (a priority queue without resizing)."""

    def allocate(self, inp: PolicyInput) -> Allocation:
        arrival = np.array([j.arrival_s for j in inp.jobs], dtype=float)
        keys = (inp.job_ids, arrival, -inp.weights) if self.by_weight else (inp.job_ids, arrival)
        order = np.lexsort(keys)
        return _single_rows(inp, greedy_fill(inp, order, self.aware), order=order)


@dataclass(kw_only=True, slots=True)
class Qssf:
    """Shortest predicted GPU service time first: ``scale_factor x total_steps / fastest steps/s``
    (``remaining=True``: remaining steps instead of total steps, i.e. shortest remaining first)."""

    name: str = "qssf"
    aware: bool = True
    remaining: bool = False

    def allocate(self, inp: PolicyInput) -> Allocation:
        steps = inp.remaining_steps if self.remaining else inp.total_steps
        best = np.where(inp.runnable, inp.T, 0.0).max(axis=1) if inp.n else np.zeros(0)
        with np.errstate(divide="ignore"):
            service = inp.scales * steps / best  # inf: runs nowhere at this size (last)
        arrival = np.array([j.arrival_s for j in inp.jobs], dtype=float)
        order = np.lexsort((inp.job_ids, arrival, service))
        return _single_rows(inp, greedy_fill(inp, order, self.aware), order=order,
                            predicted_gpu_s=service)
