"""Heterogeneous VN mapping: how many virtual nodes each worker runs. Pure code, no processes.

Workers differ in speed (measured seconds per virtual node, ``t_i``) and may have a memory limit
(the largest VN batch they can hold). With every VN the same size (``B/V``: the semantics are
unchanged), a step takes ``max_i c_i t_i + reduction`` where ``c_i`` is worker ``i``'s VN count,
so the solver picks integers ``c_i >= 1`` with ``sum c_i = V`` that minimise ``max_i c_i t_i``.

Method (exact): water-filling. Start from one VN each and give the remaining ``V - n`` VNs one
at a time to the worker whose finish time *after* taking it, ``(c_i + 1) t_i``, is smallest.
Each choice keeps the running maximum as small as any assignment of that many VNs can make it
(an exchange argument: the k-th smallest value of the multiset ``{j t_i}`` is a lower bound
on the maximum after k additions, and the greedy attains it), so the final maximum is optimal.
``tests/test_hetero.py`` checks it against brute force on every small case. Ties go to the
lower rank, so the result is deterministic.

Assignments are contiguous VN blocks in rank order (``blocks``), as for equal workers: the
deterministic reduction tree depends on V only, so any assignment trains bit-identical weights.
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
) -> HeteroPlan:
    """VN counts minimising the step time; see the module docstring."""
    n = len(time_per_vn)
    if n < 1:
        raise ValueError("no workers to assign virtual nodes to")
    if virtual_nodes < n:
        raise InfeasibleAssignment(
            f"virtual_nodes={virtual_nodes} is smaller than the {n} workers; every worker needs at least "
            f"one virtual node: use at most {virtual_nodes} workers or raise virtual_nodes"
        )
    for i, t in enumerate(time_per_vn):
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
            raise ValueError(f"time_per_vn[{i}]={t!r} must be a positive number of seconds")
    if memory_limits is not None and vn_batch is not None:
        if len(memory_limits) != n:
            raise ValueError(f"{len(memory_limits)} memory limits for {n} workers")
        check_memory(vn_batch, memory_limits)
    counts = [1] * n
    heap = [(2 * t, i) for i, t in enumerate(time_per_vn)]
    heapq.heapify(heap)
    for _ in range(virtual_nodes - n):
        _, i = heapq.heappop(heap)
        counts[i] += 1
        heapq.heappush(heap, ((counts[i] + 1) * time_per_vn[i], i))
    finish = [c * t for c, t in zip(counts, time_per_vn)]
    slowest = max(range(n), key=lambda i: (finish[i], -i))
    return HeteroPlan(counts, finish[slowest] + reduction_s, slowest)


def predict_step_s(counts: Sequence[int], time_per_vn: Sequence[float], reduction_s: float = 0.0) -> float:
    return max(c * t for c, t in zip(counts, time_per_vn)) + reduction_s


def brute_force(virtual_nodes: int, time_per_vn: Sequence[float]) -> float:
    """The optimal ``max_i c_i t_i`` by enumerating every composition (tests only: tiny inputs)."""
    n = len(time_per_vn)
    best = math.inf

    def rec(i: int, left: int, worst: float) -> None:
        nonlocal best
        if worst >= best:
            return
        if i == n - 1:
            best = min(best, max(worst, left * time_per_vn[i]))
            return
        for c in range(1, left - (n - 1 - i) + 1):
            rec(i + 1, left - c, max(worst, c * time_per_vn[i]))

    rec(0, virtual_nodes, 0.0)
    return best
