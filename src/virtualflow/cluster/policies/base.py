"""What every scheduling policy takes and returns, the allocation invariants, and the registry.

A policy is a pure function of a ``PolicyInput`` (active jobs, cluster, throughput table, time,
progress) returning an ``Allocation``: the fraction of time ``X[row, type]`` each row (one job, or
two jobs sharing accelerators) should spend on each accelerator type, and the GPU count of every
job. The round-based mechanism turns X into placements.

Invariants of every allocation (``check_allocation`` raises when one is broken):

1. ``0 <= X <= 1``;
2. per job, the sum of X over types and over every row containing it is <= 1;
3. per type ``k``, ``sum_rows X[row, k] * gpus(row) <= cluster.gpus[k]`` (a space-shared pair
   uses its GPUs once);
4. a rigid job's GPU count is its ``scale_factor``; an elastic job's is in
   ``[min_gpus, scale_factor]`` and known to the throughput table;
5. a job never gets time on a type where it cannot run (throughput 0, or more GPUs than the type has).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol, runtime_checkable

import numpy as np

from virtualflow.cluster.model import Cluster, JobSpec
from virtualflow.cluster.throughputs import ThroughputTable

TOL = 1e-6
"""Slack allowed by ``check_allocation`` (LP solutions are accurate to about 1e-9)."""


class AllocationError(ValueError):
    """An allocation breaks one of the invariants in this module's docstring."""


@dataclass(eq=False)
class PolicyInput:
    """The view a policy plans from. Arrays are per job, in the order of ``jobs``."""

    jobs: list[JobSpec]
    """Active jobs (row order of the single-job rows)."""
    cluster: Cluster
    table: ThroughputTable
    time_s: float = 0.0
    """Current (simulated) time."""
    steps_done: np.ndarray | None = None
    """Steps each job has completed (default zeros)."""
    elapsed_s: np.ndarray | None = None
    """Seconds since each job arrived (default ``time_s - arrival_s``, floored at 0)."""
    time_received_s: np.ndarray | None = None
    """(n_jobs, n_types) seconds each job has run on each type so far, where a policy needs it."""

    def __post_init__(self) -> None:
        n = len(self.jobs)
        ids = [j.job_id for j in self.jobs]
        if len(set(ids)) != n:
            dup = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"PolicyInput.jobs has duplicate job ids {dup}; ids must be unique")
        if self.steps_done is None:
            self.steps_done = np.zeros(n)
        if self.elapsed_s is None:
            self.elapsed_s = np.maximum(self.time_s - np.array([j.arrival_s for j in self.jobs], dtype=float), 0.0)
        self.steps_done = np.asarray(self.steps_done, dtype=float)
        self.elapsed_s = np.asarray(self.elapsed_s, dtype=float)
        for name in ("steps_done", "elapsed_s"):
            a = getattr(self, name)
            if a.shape != (n,):
                raise ValueError(f"PolicyInput.{name} has shape {a.shape}; expected ({n},), one value per job")
            if not np.all(np.isfinite(a)) or np.any(a < 0):
                raise ValueError(f"PolicyInput.{name} must be finite and >= 0")
        if self.time_received_s is not None:
            self.time_received_s = np.asarray(self.time_received_s, dtype=float)
            k = len(self.cluster.types)
            if self.time_received_s.shape != (n, k):
                raise ValueError(f"PolicyInput.time_received_s has shape {self.time_received_s.shape}; "
                                 f"expected ({n}, {k}) (jobs x accelerator types)")
        missing = [t for t in self.cluster.types if t not in self.table.acc_types]
        if missing:
            raise ValueError(f"cluster types {missing} are not in the throughput table (it has "
                             f"{list(self.table.acc_types)}); rename them in --cluster or load those types")
        if n:
            biggest = max(self.cluster.gpus.values())
            for j in self.jobs:
                need = j.min_gpus if j.elastic else j.scale_factor
                if need > biggest:
                    raise ValueError(
                        f"job {j.job_id} ({j.job_type!r}) needs {need} GPUs but the largest accelerator type has "
                        f"{biggest} ({self.cluster.gpus}); a job runs on one type at a time: add GPUs or "
                        f"lower its {'min_gpus' if j.elastic else 'scale_factor'}")
            elastic = np.array([j.elastic for j in self.jobs])
            cannot = np.flatnonzero(~self.runnable.any(axis=1) & ~elastic)  # elastic: may run smaller
            if cannot.size:
                j = self.jobs[int(cannot[0])]
                raise ValueError(f"job {j.job_id} ({j.job_type!r} at {j.scale_factor} GPUs) cannot run on any type "
                                 f"of this cluster: its throughput is 0 on {list(self.cluster.types)}")

    # ---------------------------------------------------------------- derived arrays (cached)

    @property
    def n(self) -> int:
        return len(self.jobs)

    @property
    def types(self) -> tuple[str, ...]:
        return self.cluster.types

    @cached_property
    def job_ids(self) -> np.ndarray:
        return np.array([j.job_id for j in self.jobs], dtype=np.int64)

    @cached_property
    def scales(self) -> np.ndarray:
        """GPU count of each job for T (its ``scale_factor``; an elastic job's maximum)."""
        return np.array([j.scale_factor for j in self.jobs], dtype=float)

    @cached_property
    def capacities(self) -> np.ndarray:
        return np.array([self.cluster.gpus[t] for t in self.types], dtype=float)

    @cached_property
    def weights(self) -> np.ndarray:
        return np.array([j.weight for j in self.jobs], dtype=float)

    @cached_property
    def total_steps(self) -> np.ndarray:
        return np.array([j.total_steps for j in self.jobs], dtype=float)

    @cached_property
    def remaining_steps(self) -> np.ndarray:
        """Steps left (floored at a tiny positive number so ratios stay finite)."""
        return np.maximum(self.total_steps - self.steps_done, 1e-9)

    @cached_property
    def T(self) -> np.ndarray:
        """(n_jobs, n_types) steps/s of each job alone at its scale factor on each type."""
        if not self.jobs:
            return np.zeros((0, len(self.types)))
        return self.table.matrix([j.job_type for j in self.jobs], self.scales.astype(int), self.types)

    @cached_property
    def runnable(self) -> np.ndarray:
        """(n_jobs, n_types) bool: the job can run on the type (throughput > 0 and it fits)."""
        return (self.T > 0) & (self.scales[:, None] <= self.capacities[None, :])

    def with_scales(self, gpus: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(T, runnable) of every job at GPU counts ``gpus`` instead of its scale factor."""
        T = self.table.matrix([j.job_type for j in self.jobs], gpus.astype(int), self.types)
        return T, (T > 0) & (gpus[:, None] <= self.capacities[None, :])


@dataclass(eq=False)
class Allocation:
    """A policy's decision: time fractions per row and type, and each job's GPU count."""

    rows: list[tuple[int, ...]]
    """Job ids of each row: ``(id,)`` one job, ``(id_a, id_b)`` two jobs sharing the same GPUs."""
    X: np.ndarray
    """(n_rows, n_types) fraction of time on each type, in [0, 1]."""
    gpus: dict[int, int]
    """job id -> GPU count (== scale_factor for rigid jobs; chosen by the policy for elastic jobs)."""
    relaxed_slos: list[int] = field(default_factory=list)
    """Job ids whose SLO could not be met and was relaxed (SLO policies; see their docstrings)."""
    objective: float | None = None
    """The policy's objective value at X (policy-specific, for tests and logs)."""
    info: dict[str, Any] = field(default_factory=dict)

    @cached_property
    def _rows_of(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for r, ids in enumerate(self.rows):
            for i in ids:
                out.setdefault(i, []).append(r)
        return out

    def job_share(self, job_id: int) -> np.ndarray:
        """Per-type fraction of time of ``job_id``, summed over the rows containing it."""
        rows = self._rows_of.get(job_id)
        if rows is None:
            return np.zeros(self.X.shape[1])
        return self.X[rows].sum(axis=0)

    def job_shares(self, job_ids: np.ndarray | list[int]) -> np.ndarray:
        """(len(job_ids), n_types) ``job_share`` of many jobs at once."""
        return np.stack([self.job_share(int(i)) for i in job_ids]) if len(job_ids) else np.zeros((0, self.X.shape[1]))


@runtime_checkable
class Policy(Protocol):
    name: str

    def allocate(self, inp: PolicyInput) -> Allocation: ...


def check_allocation(alloc: Allocation, inp: PolicyInput, tol: float = TOL) -> None:
    """Raise ``AllocationError`` naming the job/type and amount when ``alloc`` breaks an invariant."""
    k = len(inp.types)
    X = np.asarray(alloc.X, dtype=float)
    if X.shape != (len(alloc.rows), k):
        raise AllocationError(f"X has shape {X.shape}; expected ({len(alloc.rows)} rows, {k} types)")
    if not np.all(np.isfinite(X)):
        raise AllocationError("X has non-finite entries")
    if X.size and (X.min() < -tol or X.max() > 1 + tol):
        r, c = np.unravel_index(np.argmax(np.maximum(-X, X - 1)), X.shape)
        raise AllocationError(f"X[{alloc.rows[r]}, {inp.types[c]}] = {X[r, c]:.6g} is outside [0, 1]")
    by_id = {j.job_id: j for j in inp.jobs}
    for row in alloc.rows:
        if not 1 <= len(row) <= 2 or len(set(row)) != len(row):
            raise AllocationError(f"row {row} must name one job or two different jobs")
        for i in row:
            if i not in by_id:
                raise AllocationError(f"row {row} names job {i}, which is not an active job")
            if i not in alloc.gpus:
                raise AllocationError(f"job {i} has a row but no GPU count in Allocation.gpus")
        if len(row) == 2 and alloc.gpus[row[0]] != alloc.gpus[row[1]]:
            raise AllocationError(f"pair {row} shares GPUs but has counts {alloc.gpus[row[0]]} and {alloc.gpus[row[1]]}")
    for i, g in alloc.gpus.items():
        j = by_id.get(i)
        if j is None:
            raise AllocationError(f"Allocation.gpus names job {i}, which is not an active job")
        lo = j.min_gpus if j.elastic else j.scale_factor
        if not lo <= g <= j.scale_factor:
            raise AllocationError(f"job {i} gets {g} GPUs; it must get "
                                  + (f"between min_gpus={lo} and scale_factor={j.scale_factor}" if j.elastic
                                     else f"exactly scale_factor={j.scale_factor} (rigid job)"))
    if not alloc.rows:
        return
    g_row = np.array([alloc.gpus[row[0]] for row in alloc.rows], dtype=float)
    used = (X * g_row[:, None]).sum(axis=0)
    over = used - inp.capacities
    if np.any(over > tol * np.maximum(1.0, inp.capacities)):
        c = int(np.argmax(over))
        raise AllocationError(f"type {inp.types[c]}: allocation uses {used[c]:.6g} GPUs on average, more than "
                              f"the {int(inp.capacities[c])} it has")
    per_job: dict[int, float] = {}
    rs = X.sum(axis=1)
    for r, row in enumerate(alloc.rows):
        for i in row:
            per_job[i] = per_job.get(i, 0.0) + rs[r]
    for i, s in per_job.items():
        if s > 1 + tol:
            raise AllocationError(f"job {i} is allocated {s:.6g} of the time (> 1) summed over types and rows")
    # Never time on a type where the job cannot run.
    idx = {j.job_id: n for n, j in enumerate(inp.jobs)}
    for r, row in enumerate(alloc.rows):
        g = int(g_row[r])
        for c, t in enumerate(inp.types):
            if X[r, c] <= tol:
                continue
            if g > inp.capacities[c]:
                raise AllocationError(f"row {row} gets time on {t} at {g} GPUs but {t} has only "
                                      f"{int(inp.capacities[c])}")
            for i in row:
                j = inp.jobs[idx[i]]
                if len(row) == 1 and inp.table.throughput(j.job_type, t, g) <= 0:
                    raise AllocationError(f"job {i} ({j.job_type!r}) gets time on {t} where its throughput at "
                                          f"{g} GPUs is 0")


# ------------------------------------------------------------------------------------------------
# Registry: CLI name -> "module:class" (imported lazily; kept immutable, no module-level state).

POLICY_NAMES: tuple[tuple[str, str], ...] = (
    ("fifo", "virtualflow.cluster.policies.greedy:Fifo"),
    ("qssf", "virtualflow.cluster.policies.greedy:Qssf"),
    ("las_agnostic", "virtualflow.cluster.policies.fairness:LasAgnostic"),
    ("las", "virtualflow.cluster.policies.fairness:Las"),
    ("finish_time_fairness", "virtualflow.cluster.policies.fairness:FinishTimeFairness"),
    ("elastic_fair", "virtualflow.cluster.policies.elastic:ElasticFair"),
    ("elastic_batch", "virtualflow.cluster.policies.elastic_batch:ElasticBatch"),
    ("makespan", "virtualflow.cluster.policies.efficiency:Makespan"),
    ("max_throughput", "virtualflow.cluster.policies.efficiency:MaxThroughput"),
    ("min_jct", "virtualflow.cluster.policies.efficiency:MinJct"),
    ("min_cost", "virtualflow.cluster.policies.cost:MinCost"),
    ("min_cost_slo", "virtualflow.cluster.policies.cost:MinCostSlo"),
    ("las_space_sharing", "virtualflow.cluster.policies.space_sharing:LasSpaceSharing"),
)


def policy_names() -> list[str]:
    return [n for n, _ in POLICY_NAMES]


def get_policy(name: str, **kwargs: Any) -> Policy:
    """Build the policy registered as ``name`` (``kwargs`` go to its constructor)."""
    target = dict(POLICY_NAMES).get(name)
    if target is None:
        raise ValueError(f"unknown policy {name!r}; choose one of {policy_names()}")
    mod, cls = target.split(":")
    return getattr(importlib.import_module(mod), cls)(**kwargs)
