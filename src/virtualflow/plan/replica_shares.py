"""Micro-batch shares of pipeline replicas of unequal speed. Pure code, no processes.

A pipelined job's ``V`` virtual nodes are its micro-batches, split over its ``D`` pipeline
replicas in contiguous blocks (replica ``j`` runs its block as its ``m_j`` micro-batches). The
synchronous step waits for the slowest replica, so when replicas differ in speed (a replica on a
slower machine, or one that failed over under Bamboo's redundancy and runs two stages on one
worker) equal shares hold every replica to the slowest. This module gives each replica the share
that minimises the step.

The time model (:func:`replica_time`): replica ``j``'s workers take ``s_1 .. s_q`` seconds per
micro-batch (forward + backward of all the job stages each runs; a worker running two stages
takes their sum). With a flush schedule the first micro-batch crosses every worker and then the
slowest worker paces the rest:

    T_j(m) = fixed_j + m * per_mb_j,   per_mb_j = max_k s_k,   fixed_j = (sum_k s_k - max_k s_k) / v

with ``v`` the chunks per worker (``interleaved_1f1b`` shrinks the bubble ``v`` times; every other
flush schedule has ``v = 1``). For equal stages this is the simulator's ``(m + p - 1)(f + b)``
(``virtualflow.plan.pipeline.simulate``) for GPipe and 1F1B, and ``(m + (p - 1)/v)`` chunk-sized
units for interleaved 1F1B; for ZB-H1 it is 1F1B's, an upper bound (its weight-gradient passes
fill part of the bubble). So a replica's time is *not* proportional to its share: a share solver
that divided ``V`` in proportion to speed would ignore the bubble, which every replica pays
whatever its share.

Tensor-parallel stages (``Pipeline(tensor=T)``, a ``D x P x T`` grid): a replica is ``P T``
workers, the ``T`` members of a stage's tensor-parallel group consecutive in rank order
(:mod:`virtualflow.runtime.pipeline.tensor_grid`). The group runs the stage in lock step (every
block's collectives wait for all ``T``), so the *stage's* seconds per micro-batch are its slowest
member's plus the collectives' cost, ``s_stage = max_{k in group} s_k + collective_s``, and the
model above runs on the ``P`` stage times. ``collective_s`` is what the members' ``s_k`` leave
out: a planner that costs compute alone (the grid planner's ring formulas) passes the collectives
here; a measurement that already waited in them (tensor rank 0's forwards and backwards, the step
breakdown's row of the stage) passes 0.

The solver (:func:`solve_shares`, exact): integers ``m_j >= minimum_j``, each a multiple of
``multiple`` (the schedule's rule, :func:`microbatch_rule`), ``sum m_j = V``, minimising
``max_j T_j(m_j)``. Water-filling in units of ``multiple``: start every replica at its minimum
and give the remaining units one at a time to the replica whose time *after* taking it is
smallest. Each ``T_j`` is non-decreasing, so the times a replica can reach form a sorted list
and any assignment of ``k`` more units has a maximum at least the ``k``-th smallest value of the
merged lists, which the greedy reaches (the argument of :mod:`virtualflow.plan.hetero`).
``tests/unit/test_pipeline_weighted.py`` checks it against brute force. Ties go to the lower
replica, so the result is deterministic; replicas of equal speed get shares at most one unit
apart.

Semantics do not change with the shares: every VN is still one micro-batch of ``B/V`` samples of
the same data, and deterministic mode sums per-VN gradients along the fixed VN-id tree
(:class:`virtualflow.plan.vnmap.TreePlan`), which depends on ``V`` only: any contiguous blocks
train bit-identical weights.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence

from virtualflow.plan.vnmap import contiguous_assignment

__all__ = ["ReplicaTime", "SharePlan", "microbatch_rule", "per_worker", "predict_step_s", "replica_blocks",
           "replica_time", "solve_shares", "stage_seconds"]


@dataclass(frozen=True, slots=True)
class ReplicaTime:
    """A replica's predicted step time for ``m`` micro-batches: ``fixed_s + m * per_mb_s``."""

    fixed_s: float
    """The schedule's fill and drain (the bubble): paid whatever the share."""
    per_mb_s: float
    """The slowest worker's seconds per micro-batch: the pace of the steady state."""

    def time(self, m: int) -> float:
        return self.fixed_s + m * self.per_mb_s


def replica_time(worker_s: Sequence[float], chunks: int = 1, *, tensor: int = 1,
                 collective_s: float = 0.0) -> ReplicaTime:
    """The flush-schedule time model of a replica whose workers take ``worker_s`` seconds per
    micro-batch each, in rank order (see the module docstring); ``chunks``: interleaved 1F1B's
    ``v``; ``tensor``: workers per stage (each run of ``tensor`` consecutive entries is one stage's
    tensor-parallel group, paced by its slowest member), ``collective_s``: the group's collectives
    per micro-batch, added to each stage (:func:`stage_seconds`)."""
    if not worker_s:
        raise ValueError("a pipeline replica needs at least one worker")
    for k, s in enumerate(worker_s):
        if not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0):
            raise ValueError(f"worker_s[{k}]={s!r} must be a positive number of seconds per micro-batch")
    if chunks < 1:
        raise ValueError(f"chunks={chunks} must be at least 1")
    stage_s = stage_seconds(worker_s, tensor, collective_s)
    slowest = max(stage_s)
    return ReplicaTime((sum(stage_s) - slowest) / chunks, slowest)


def stage_seconds(worker_s: Sequence[float], tensor: int = 1, collective_s: float = 0.0) -> list[float]:
    """Each stage's seconds per micro-batch from its workers' (``worker_s`` in rank order, the
    ``tensor`` members of a stage consecutive): the slowest member's plus ``collective_s`` (the
    tensor-parallel collectives, which every member waits in; 0 for ``tensor=1``)."""
    if not isinstance(tensor, int) or isinstance(tensor, bool) or tensor < 1 or len(worker_s) % tensor:
        raise ValueError(f"tensor={tensor!r} must be a positive integer dividing the replica's {len(worker_s)} "
                         f"workers (Pipeline.tensor: workers per stage)")
    if not (math.isfinite(collective_s) and collective_s >= 0):
        raise ValueError(f"collective_s={collective_s!r} must be a finite number of seconds >= 0")
    extra = collective_s if tensor > 1 else 0.0
    return [max(worker_s[i:i + tensor]) + extra for i in range(0, len(worker_s), tensor)]


def microbatch_rule(schedule: str, stages: int, chunks: int = 1) -> tuple[int, int]:
    """``(minimum, multiple)``: the micro-batch counts ``m`` a replica of ``stages`` workers may
    run with ``schedule`` are ``m >= minimum`` with ``m % multiple == 0`` (the constraints of
    :func:`virtualflow.plan.pipeline.schedules.build_schedule`: interleaved 1F1B with ``v > 1``
    needs whole groups of ``p``; 2BW needs ``m >= p - 1``; the rest take any ``m >= 1``)."""
    if schedule == "interleaved_1f1b" and chunks > 1:
        return stages, stages
    if schedule == "2bw":
        return max(1, stages - 1), 1
    return 1, 1


@dataclass(frozen=True, slots=True)
class SharePlan:
    counts: list[int]
    """Micro-batches (VNs) per replica, in replica order."""
    predicted_step_s: float
    """``max_j T_j(counts[j]) + reduction_s``."""
    bottleneck: int
    """The replica that sets the step time."""

    def blocks(self) -> list[list[int]]:
        """Contiguous VN ids per replica, in replica order."""
        out, start = [], 0
        for c in self.counts:
            out.append(list(range(start, start + c)))
            start += c
        return out


def predict_step_s(counts: Sequence[int], times: Sequence[ReplicaTime], reduction_s: float = 0.0) -> float:
    return max(t.time(c) for c, t in zip(counts, times)) + reduction_s


def solve_shares(virtual_nodes: int, times: Sequence[ReplicaTime], *, minimum: int | Sequence[int] = 1,
                 multiple: int = 1, reduction_s: float = 0.0) -> SharePlan:
    """Micro-batches per replica minimising the predicted step (see the module docstring).

    ``minimum`` (one value, or one per replica: a failed-over replica is shallower) and
    ``multiple`` are the schedule's rule (:func:`microbatch_rule`); every replica gets at least
    ``max(1, minimum)``: a pipeline replica with no micro-batch cannot run its schedule."""
    d = len(times)
    if d < 1:
        raise ValueError("no pipeline replica to give micro-batches to")
    if multiple < 1:
        raise ValueError(f"multiple={multiple} must be at least 1")
    mins = [minimum] * d if isinstance(minimum, int) else list(minimum)
    if len(mins) != d:
        raise ValueError(f"{len(mins)} minimums for {d} replicas")
    # The smallest count >= the minimum (and >= 1) that is a multiple of ``multiple``.
    mins = [-(-max(1, lo) // multiple) * multiple for lo in mins]
    if virtual_nodes < sum(mins) or virtual_nodes % multiple:
        raise ValueError(
            f"virtual_nodes={virtual_nodes} cannot be split over {d} pipeline replicas with at least {mins} "
            f"micro-batches each in multiples of {multiple} (the schedule's rule); raise virtual_nodes to a multiple "
            f"of {multiple} that is at least {sum(mins)}, or run fewer replicas")
    counts = list(mins)
    heap = [(t.time(c + multiple), j) for j, (t, c) in enumerate(zip(times, counts))]
    heapq.heapify(heap)
    for _ in range((virtual_nodes - sum(mins)) // multiple):
        _, j = heapq.heappop(heap)
        counts[j] += multiple
        heapq.heappush(heap, (times[j].time(counts[j] + multiple), j))
    finish = [t.time(c) for t, c in zip(times, counts)]
    slowest = max(range(d), key=lambda j: (finish[j], -j))
    return SharePlan(counts, finish[slowest] + reduction_s, slowest)


def per_worker(blocks: Sequence[Sequence[int]], sizes: Sequence[int]) -> list[list[int]]:
    """The per-worker VN map of replicas of ``sizes`` workers (in rank order, replica after
    replica): every worker of replica ``j`` runs ``blocks[j]`` as its micro-batches."""
    if len(blocks) != len(sizes):
        raise ValueError(f"{len(blocks)} VN blocks for {len(sizes)} replicas")
    return [list(blocks[j]) for j, n in enumerate(sizes) for _ in range(n)]


def replica_blocks(assignment: Sequence[Sequence[int]] | None, sizes: Sequence[int],
                   virtual_nodes: int) -> list[list[int]]:
    """Each replica's VNs from a generation's per-worker map (:func:`per_worker`'s form: every
    worker of a replica holds its replica's block). A map that is not of that form (absent, the
    wrong length, replicas' blocks not contiguous in replica order and covering ``range(V)``)
    gives the equal contiguous blocks instead."""
    d = len(sizes)
    if assignment is not None and len(assignment) == sum(sizes):
        firsts = [sum(sizes[:j]) for j in range(d)]
        out = [list(assignment[r]) for r in firsts]
        same = all(list(assignment[r]) == out[j] for j, r0 in enumerate(firsts) for r in range(r0, r0 + sizes[j]))
        if same and [v for b in out for v in b] == list(range(virtual_nodes)) and all(out):
            return out
    return contiguous_assignment(virtual_nodes, d)
