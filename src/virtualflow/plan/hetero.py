"""Heterogeneous VN mapping: how many virtual nodes each worker runs. Pure code, no processes.

Workers differ in speed (measured seconds per virtual node, ``t_i``) and may have a memory limit
(the largest VN batch they can hold). With every VN the same size (``B/V``: the semantics are
unchanged), a step takes ``max_i c_i t_i + reduction`` where ``c_i`` is worker ``i``'s VN count,
so the solver picks integers ``c_i >= min_vns`` with ``sum c_i = V`` that minimise
``max_i c_i t_i``.

``min_vns`` is 0 by default: a worker so slow that one VN of it takes longer than the others
need for all of theirs gets no VN at all. It stays a member (it takes part in the gradient
reduction with a zero contribution, and the engine keeps measuring its speed on a probe VN while
it waits, see :mod:`virtualflow.runtime.engine`), so it gets VNs again once it is fast enough.
Forcing ``min_vns=1`` makes such a worker the bottleneck: with slowdowns {1,1,1,8} (``t`` per
VN on a fast worker) and V=16 the best map with a VN each is 5-5-5-1, 8 t for the slow worker's
one VN, while 6-5-5-0 takes 6 t. (At V=24 the two tie in theory, 8-8-7-1 and 8-8-8-0 both 8 t,
and the measured slow VN decides.)

Method (exact): water-filling. Start from ``min_vns`` VNs each and give the remaining VNs one at
a time to the worker whose finish time *after* taking it, ``(c_i + 1) t_i``, is smallest. The
finish times a worker can reach form the multiset ``{j t_i : j > min_vns}`` (plus the fixed
``min_vns t_i``); any assignment of k more VNs has a maximum at least the k-th smallest value of
that multiset (an exchange argument), and the greedy takes exactly the k smallest, so the final
maximum is optimal. ``tests/test_hetero.py`` checks it against brute force
(``tests/hetero_reference.py``) on every small case, zero counts included. Ties go to the lower
rank, so the result is deterministic.

Assignments are contiguous VN blocks in rank order (``blocks``; a worker with no VN gets an
empty block), as for equal workers: the deterministic reduction tree depends on V only, so any
assignment trains bit-identical weights.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence


class InfeasibleAssignment(ValueError):
    """No assignment satisfies the workers' limits."""


@dataclass(frozen=True, slots=True)
class HeteroPlan:
    counts: list[int]
    """VNs per worker, in rank order."""
    predicted_step_s: float
    """``max_i counts[i] * time_per_vn[i] + reduction_s``."""
    bottleneck: int
    """Rank of the slowest worker under this plan."""

    def blocks(self) -> list[list[int]]:
        return blocks(self.counts)


def blocks(counts: Sequence[int]) -> list[list[int]]:
    """Contiguous VN ids for the given counts: ``[2, 1, 3] -> [[0, 1], [2], [3, 4, 5]]``."""
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out


def check_memory(vn_batch: int, memory_limits: Sequence[int | None]) -> None:
    """Every worker must hold one VN batch (``B/V`` samples): VN size does not change with the
    VN count, since a worker runs its VNs one after another."""
    too_small = [(i, m) for i, m in enumerate(memory_limits) if m is not None and m < vn_batch]
    if too_small:
        i, m = too_small[0]
        raise InfeasibleAssignment(
            f"worker {i} can hold VN batches of at most {m} samples (its memory limit) but every virtual "
            f"node has B/V = {vn_batch} samples; raise virtual_nodes so that B/V <= {m}, or give that "
            f"worker a larger memory limit"
        )


def solve(
    virtual_nodes: int,
    time_per_vn: Sequence[float],
    *,
    reduction_s: float = 0.0,
    vn_batch: int | None = None,
    memory_limits: Sequence[int | None] | None = None,
    min_vns: int = 0,
) -> HeteroPlan:
    """VN counts minimising the step time; see the module docstring.

    ``min_vns`` (default 0) is the fewest VNs any worker gets. Memory limits are checked for
    every worker, also one that may get no VN: a worker that cannot hold one VN batch can never
    do anything in this job, which is a configuration error, not a map to solve.
    """
    n = len(time_per_vn)
    if n < 1:
        raise ValueError("no workers to assign virtual nodes to")
    if virtual_nodes < 1:
        raise ValueError(f"virtual_nodes={virtual_nodes} must be at least 1")
    if min_vns < 0:
        raise ValueError(f"min_vns={min_vns} must be >= 0")
    if virtual_nodes < n * min_vns:
        raise InfeasibleAssignment(
            f"virtual_nodes={virtual_nodes} is smaller than the {n} workers x min_vns={min_vns}; every worker "
            f"needs at least {min_vns} virtual node{'s' if min_vns != 1 else ''}: use at most "
            f"{virtual_nodes // min_vns} workers, raise virtual_nodes or lower min_vns"
        )
    for i, t in enumerate(time_per_vn):
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
            raise ValueError(f"time_per_vn[{i}]={t!r} must be a positive number of seconds")
    if memory_limits is not None and vn_batch is not None:
        if len(memory_limits) != n:
            raise ValueError(f"{len(memory_limits)} memory limits for {n} workers")
        check_memory(vn_batch, memory_limits)
    counts = [min_vns] * n
    heap = [((min_vns + 1) * t, i) for i, t in enumerate(time_per_vn)]
    heapq.heapify(heap)
    for _ in range(virtual_nodes - n * min_vns):
        _, i = heapq.heappop(heap)
        counts[i] += 1
        heapq.heappush(heap, ((counts[i] + 1) * time_per_vn[i], i))
    finish = [c * t for c, t in zip(counts, time_per_vn)]
    slowest = max(range(n), key=lambda i: (finish[i], -i))
    return HeteroPlan(counts, finish[slowest] + reduction_s, slowest)


def predict_step_s(counts: Sequence[int], time_per_vn: Sequence[float], reduction_s: float = 0.0) -> float:
    return max(c * t for c, t in zip(counts, time_per_vn)) + reduction_s


# -- uneven VN sizes --------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class UnevenPlan:
    counts: list[int]
    """VNs per worker, in rank order."""
    samples: list[int]
    """Samples per worker per step (``sum == B``)."""
    vn_sizes: list[int]
    """Samples of each VN, VN ids in order (a worker's VNs split its samples as evenly as possible)."""
    predicted_step_s: float

    def blocks(self) -> list[list[int]]:
        return blocks(self.counts)


def vn_sizes_for(counts: Sequence[int], samples: Sequence[int]) -> list[int]:
    out: list[int] = []
    for c, n in zip(counts, samples):
        base, extra = divmod(n, c)
        out.extend(base + (1 if k < extra else 0) for k in range(c))
    return out


def solve_uneven(
    virtual_nodes: int,
    global_batch_size: int,
    per_vn_s: Sequence[float],
    per_sample_s: Sequence[float],
    *,
    memory_limits: Sequence[int | None] | None = None,
    reduction_s: float = 0.0,
) -> UnevenPlan:
    """VN counts *and* samples per worker when VN sizes may differ between workers.

    Worker ``i`` runs ``c_i`` VNs holding ``n_i`` samples in all and takes
    ``per_vn_s[i] * c_i + per_sample_s[i] * n_i`` (a fixed cost per VN plus a cost per sample,
    as the profiler fits it). Minimise the slowest worker subject to ``sum c_i = V``,
    ``sum n_i = B``, ``1 <= c_i <= n_i`` and ``n_i <= c_i * memory_limit_i`` (each VN fits):
    a small integer program solved exactly with HiGHS (``scipy.optimize.milp``).
    """
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp

    n = len(per_vn_s)
    V, B = virtual_nodes, global_batch_size
    if V < n:
        raise InfeasibleAssignment(
            f"virtual_nodes={V} is smaller than the {n} workers; every worker needs at least one virtual node"
        )
    limits = list(memory_limits) if memory_limits is not None else [None] * n
    # x = [c_0..c_{n-1}, n_0..n_{n-1}, T]
    nv = 2 * n + 1
    cost = np.zeros(nv)
    cost[-1] = 1.0
    rows, lo, hi = [], [], []
    for i in range(n):
        r = np.zeros(nv)
        r[i], r[n + i], r[-1] = per_vn_s[i], per_sample_s[i], -1.0
        rows.append(r), lo.append(-np.inf), hi.append(0.0)
        r = np.zeros(nv)
        r[i], r[n + i] = 1.0, -1.0  # c_i <= n_i
        rows.append(r), lo.append(-np.inf), hi.append(0.0)
        if limits[i] is not None:
            r = np.zeros(nv)
            r[n + i], r[i] = 1.0, -float(limits[i])  # n_i <= mem_i c_i
            rows.append(r), lo.append(-np.inf), hi.append(0.0)
    r = np.zeros(nv)
    r[:n] = 1.0
    rows.append(r), lo.append(V), hi.append(V)
    r = np.zeros(nv)
    r[n : 2 * n] = 1.0
    rows.append(r), lo.append(B), hi.append(B)
    integrality = np.array([1] * (2 * n) + [0])
    bounds = Bounds([1] * (2 * n) + [0.0], [V] * n + [B] * n + [np.inf])
    res = milp(cost, constraints=LinearConstraint(np.array(rows), lo, hi), integrality=integrality, bounds=bounds)
    if res.status != 0 or res.x is None:
        raise InfeasibleAssignment(
            f"no map of V={V} virtual nodes and B={B} samples fits the workers' memory limits {limits}; "
            f"raise virtual_nodes or the limits"
        )
    counts = [int(round(v)) for v in res.x[:n]]
    samples = [int(round(v)) for v in res.x[n : 2 * n]]
    finish = max(per_vn_s[i] * counts[i] + per_sample_s[i] * samples[i] for i in range(n))
    return UnevenPlan(counts, samples, vn_sizes_for(counts, samples), finish + reduction_s)
