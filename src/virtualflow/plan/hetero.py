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
maximum is optimal. ``tests/e2e/test_hetero.py`` checks it against brute force
(``tests/hetero_reference.py``) on every small case, zero counts included. Ties go to the lower
rank, so the result is deterministic.

Assignments are contiguous VN blocks in rank order (``blocks``; a worker with no VN gets an
empty block), as for equal workers: the deterministic reduction tree depends on V only, so any
assignment trains bit-identical weights.

A pipelined job maps its VNs over pipeline replicas, not workers, and a replica's time is not
proportional to its share (the schedule's bubble): :mod:`virtualflow.plan.replica_shares`.
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


# -- a noise-robust speed model ----------------------------------------------------------------
# Measured seconds per VN are noisy: other load on the machine, a collective that overlapped a
# worker's compute, a page-cache miss. A smoothed mean (the first speed model here) followed the
# noise: under load two equally fast workers measured 26 % apart and were mapped 7-1-0. The model
# below is built so that noise alone cannot move VNs:
#
# * each worker's speed is the **median** of its last ``window`` measurements (a spike in fewer
#   than half of them does not move it);
# * the noise is one figure for the machine: the largest relative spread (from the median
#   absolute deviation) among the workers, shrunk towards a prior ``prior_noise`` while few
#   measurements exist (``prior_weight`` pseudo-measurements), so that three quiet samples do
#   not make the model over-confident;
# * workers whose speeds differ by less than ``z`` standard errors of that difference (at least
#   ``tie_tolerance``) are **pooled**: one common speed, so the solver gives them counts at most
#   one VN apart;
# * a worker gets **no VN** only when that beats giving it one by more than ``zero_gain``;
# * a **rebalance** needs the current map to be predicted slower than the best one by more than
#   the threshold plus ``margin_z`` standard errors of a speed (hysteresis), on pooled speeds.
#
# A real change of speed (a 3x slowdown) is far outside every margin and is still followed, once
# it holds for more than half of the window.


@dataclass(frozen=True, slots=True)
class SpeedEstimate:
    seconds_per_vn: float
    """Median of the worker's recent measurements."""
    spread: float
    """Relative spread of one measurement (1.4826 x MAD / median; 0 with fewer than 2)."""
    samples: int


class SpeedModel:
    """Per-worker seconds per VN from noisy measurements (see the comment above).

    Invariants: an estimate exists exactly for the workers measured at least once; it is the
    median of at most ``window`` recent finite positive measurements, so it depends on the
    measurements only, never on the order in which workers were observed.
    """

    def __init__(self, window: int = 15, *, tie_tolerance: float = 0.10, z: float = 4.0, margin_z: float = 3.0,
                 prior_noise: float = 0.2, prior_weight: float = 3.0) -> None:
        if window < 1:
            raise ValueError(f"window={window} must be at least 1 measurement")
        if tie_tolerance < 0 or prior_noise < 0 or prior_weight < 0:
            raise ValueError(f"tie_tolerance={tie_tolerance}, prior_noise={prior_noise} and "
                             f"prior_weight={prior_weight} must be >= 0")
        self.window = window
        self.tie_tolerance = tie_tolerance
        self.z = z
        self.margin_z = margin_z
        self.prior_noise = prior_noise
        self.prior_weight = prior_weight
        self._samples: dict[int, list[float]] = {}

    def observe(self, worker: int, seconds_per_vn: float) -> None:
        """One measurement; non-finite or non-positive values are ignored (no information)."""
        if not (math.isfinite(seconds_per_vn) and seconds_per_vn > 0):
            return
        s = self._samples.setdefault(worker, [])
        s.append(float(seconds_per_vn))
        del s[: max(0, len(s) - self.window)]

    def forget(self, worker: int) -> None:
        self._samples.pop(worker, None)

    def estimate(self, worker: int) -> SpeedEstimate | None:
        s = self._samples.get(worker)
        if not s:
            return None
        med = _median(s)
        spread = 1.4826 * _median([abs(x - med) for x in s]) / med if len(s) >= 2 else 0.0
        return SpeedEstimate(med, spread, len(s))

    def estimates(self) -> dict[int, float]:
        """Median seconds per VN of every measured worker."""
        return {w: _median(s) for w, s in self._samples.items() if s}

    def noise(self, members: Sequence[int]) -> float:
        """Relative noise of one measurement on this machine: the largest members' spread, each
        shrunk towards ``prior_noise`` by ``prior_weight`` pseudo-measurements."""
        k, p = self.prior_weight, self.prior_noise
        out = 0.0
        for e in (self.estimate(w) for w in members):
            if e is not None:
                out = max(out, math.sqrt((e.samples * e.spread**2 + k * p * p) / (e.samples + k)))
        return out

    def std_error(self, members: Sequence[int], worker: int) -> float:
        """Relative standard error of ``worker``'s median (its count, the machine's noise)."""
        e = self.estimate(worker)
        n = e.samples if e is not None else 1
        return 1.2533 * self.noise(members) / math.sqrt(n)

    def speeds(self, members: Sequence[int]) -> list[float] | None:
        """Pooled seconds per VN of ``members`` for the solver (None when none is measured);
        an unmeasured member is assumed typical (the median of the measured ones)."""
        est = {w: self.estimate(w) for w in members}
        known = [e for e in est.values() if e is not None]
        if not known:
            return None
        typical = sorted(known, key=lambda e: e.seconds_per_vn)[len(known) // 2]
        times = [(est[w] or typical).seconds_per_vn for w in members]
        errors = [self.std_error(members, w) for w in members]
        return pool_ties(times, errors, tie_tolerance=self.tie_tolerance, z=self.z)

    def plan(self, virtual_nodes: int, members: Sequence[int], *, reduction_s: float = 0.0,
             zero_gain: float = 0.10) -> HeteroPlan:
        """The best map on the pooled speeds (:func:`solve_robust`); a worker is dropped (no
        VN) only if that wins even when it is as fast as ``z`` standard errors allow."""
        speeds = self.speeds(members)
        if speeds is None:
            raise ValueError("no measured worker among the members: nothing to plan with")
        optimistic = [t * math.exp(-self.z * self.std_error(members, w)) for t, w in zip(speeds, members)]
        return solve_robust(virtual_nodes, speeds, reduction_s=reduction_s, zero_gain=zero_gain,
                            optimistic=optimistic)

    def margin(self, members: Sequence[int]) -> float:
        """The relative noise of a predicted step time: ``margin_z`` standard errors of the
        least measured member's speed (0 when nothing is measured)."""
        if not any(w in self._samples for w in members):
            return 0.0
        return self.margin_z * max(self.std_error(members, w) for w in members)


def _median(values: Sequence[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def pool_ties(times: Sequence[float], rel_errors: Sequence[float], *, tie_tolerance: float = 0.10,
              z: float = 3.0) -> list[float]:
    """Give workers whose speeds differ by less than the noise one common speed.

    Workers are taken fastest first; a worker joins the current group when its time is within
    ``max(tie_tolerance, z * sqrt(e_a^2 + e_b^2))`` (in log ratio; ``e`` the relative standard
    errors) of the group's *first* (fastest) member, so a group never spans more than that.
    Each group gets the median of its times. Deterministic: ties in time keep rank order.
    """
    order = sorted(range(len(times)), key=lambda i: (times[i], i))
    out = list(times)
    group: list[int] = []

    def close() -> None:
        if group:
            common = _median([times[i] for i in group])
            for i in group:
                out[i] = common

    for i in order:
        if group:
            first = group[0]
            tol = max(tie_tolerance, z * math.hypot(rel_errors[first], rel_errors[i]))
            if math.log(times[i] / times[first]) > tol:
                close()
                group = []
        group.append(i)
    close()
    return out


def solve_robust(virtual_nodes: int, time_per_vn: Sequence[float], *, reduction_s: float = 0.0,
                 zero_gain: float = 0.10, optimistic: Sequence[float] | None = None) -> HeteroPlan:
    """:func:`solve`, except that a worker gets no VN only when that is predicted faster than
    giving every worker at least one by more than ``zero_gain`` (relative), judged with the
    dropped workers' ``optimistic`` times (a lower confidence bound of each time; default the
    times themselves): a worker is not dropped on a margin that measurement noise could make up."""
    plan = solve(virtual_nodes, time_per_vn, reduction_s=reduction_s)
    n = len(time_per_vn)
    if 0 not in plan.counts or virtual_nodes < n:
        return plan
    low = list(time_per_vn)
    if optimistic is not None:
        for i, c in enumerate(plan.counts):
            if c == 0:
                low[i] = min(low[i], optimistic[i])
    everyone = solve(virtual_nodes, low, reduction_s=reduction_s, min_vns=1)
    if everyone.predicted_step_s > plan.predicted_step_s * (1 + zero_gain):
        return plan
    finish = [c * t for c, t in zip(everyone.counts, time_per_vn)]
    slowest = max(range(n), key=lambda i: (finish[i], -i))
    return HeteroPlan(everyone.counts, finish[slowest] + reduction_s, slowest)


@dataclass(frozen=True, slots=True)
class RebalanceCheck:
    """Whether the current map should be replaced (one measured step's verdict)."""

    worse: bool
    """The best map is better than the current one by more than the required gain."""
    best: HeteroPlan
    current_step_s: float
    required_gain: float
    """``threshold + noise margin``: the relative gain a rebalance needs."""


def check_rebalance(counts: Sequence[int], model: SpeedModel, members: Sequence[int], virtual_nodes: int, *,
                    reduction_s: float = 0.0, threshold: float = 0.10, zero_gain: float = 0.10) -> RebalanceCheck:
    """Compare the current map (``counts``) with the best one on the model's pooled speeds; the
    best one must win by more than ``threshold`` plus the model's noise margin (hysteresis), so
    that noise cannot move VNs back and forth. Pure: the caller decides what to do with it."""
    speeds = model.speeds(members)
    if speeds is None:
        raise ValueError("no measured worker among the members: nothing to compare")
    best = model.plan(virtual_nodes, members, reduction_s=reduction_s, zero_gain=zero_gain)
    current = predict_step_s(counts, speeds, reduction_s)
    required = threshold + model.margin(members)
    worse = list(best.counts) != list(counts) and current > best.predicted_step_s * (1 + required)
    return RebalanceCheck(worse, best, current, required)
