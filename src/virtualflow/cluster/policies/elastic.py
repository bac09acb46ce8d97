"""Elastic-aware weighted fair share (VirtualFlow's scheduler): choose each elastic job's GPU
count, then share the accelerator types fairly and heterogeneity-aware at those counts.

1. **GPU counts.** The cluster's GPUs are water-filled by weight: job ``i`` is entitled to
   ``share_i = min(demand_i, w_i L)`` GPUs, ``demand_i`` = its ``scale_factor``, with the level
   ``L`` set so the shares add up to all GPUs (everyone gets its demand when they fit). An elastic
   job runs at the largest count it allows (in ``[min_gpus, scale_factor]``, known to the table,
   with throughput > 0 on some type that has that many GPUs) not above its share, or at its
   smallest allowed count if its share is below that. GPUs left over by rounding down go, by
   descending weight (then arrival, id), to elastic jobs that can step up to their next allowed
   count within what is left. Rigid jobs keep their ``scale_factor``.
   If the counts still add up to more GPUs than the cluster has (a small share rounded *up* to a
   job's minimum), elastic jobs are **shrunk toward their minimum**, one allowed count at a time,
   the job furthest above its share first (ties: lower weight, later arrival, higher id), until
   they fit: every job then runs all the time and nobody is preempted to make room.
2. **Admission when even the minimums do not fit.** Jobs are admitted in an order, each at its
   minimum count (its ``scale_factor`` if rigid), skipping one that does not fit (a smaller one
   behind it may); step 1 then shares the cluster among the admitted jobs only, and the others
   wait (``X = 0``) at their minimum count. The order (``overload``): ``"least_attained"`` (the
   default) by least GPU-time received so far per unit of weight (``time_received_s`` summed over
   types, divided by the weight; ties: weight, arrival, id), so with job sizes unknown and heavy-
   tailed a short job is not stuck behind long ones (Tiresias' discretised LAS); the admitted set
   changes only when the policy is re-solved (arrivals, completions), so a job is preempted at
   most once per such event, not every round. ``"queue"``: by descending weight, then jobs that
   have already started (``steps_done > 0``), then arrival and id: a job is preempted only for a
   heavier one. ``"time_share"`` keeps every job and lets the max-min LP time-share the cluster
   (Gavel's way: the mechanism then rotates jobs round by round, each rotation a preemption).
3. **Time shares.** Heterogeneity-aware weighted max-min fairness (``las``) at those counts, filled.

Resizing in place is what makes this pay: when a job arrives or leaves, elastic jobs shrink or grow
instead of being preempted or waiting in a queue (the round mechanism charges a short resize pause,
not a restart). Objective reported: the LAS max-min value at the chosen counts over the admitted jobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from virtualflow.cluster.policies import lp
from virtualflow.cluster.policies.base import Allocation, PolicyInput
from virtualflow.cluster.policies.fairness import las_coefficients, single_rows


def water_fill(demand: np.ndarray, weights: np.ndarray, total: float) -> np.ndarray:
    """``min(demand_i, w_i L)`` with ``L`` such that the sum is ``total`` (or every demand if they fit)."""
    if demand.sum() <= total:
        return demand.astype(float)
    ratio = demand / weights
    order = np.argsort(ratio)
    d, w, r = demand[order], weights[order], ratio[order]
    # Jobs 0..m-1 (smallest demand/weight) are capped at their demand, the rest get w L.
    capped = np.concatenate([[0.0], np.cumsum(d)])[:-1]  # sum of demands before m
    w_rest = np.cumsum(w[::-1])[::-1]                     # sum of weights from m on
    L = (total - capped) / w_rest
    m = int(np.argmax(L <= r))  # first m whose level does not exceed its own ratio
    share = np.minimum(demand, weights * L[m])
    return share


def runs_somewhere(inp: PolicyInput, job_type: str, gpus: int) -> bool:
    return any(inp.table.throughput(job_type, t, gpus) > 0 and gpus <= inp.cluster.gpus[t] for t in inp.types)


def allowed_counts(inp: PolicyInput) -> list[np.ndarray]:
    """Per job, the GPU counts it may run at (ascending)."""
    biggest = inp.capacities.max()
    out = []
    for j in inp.jobs:
        if not j.elastic:
            out.append(np.array([j.scale_factor]))
            continue
        counts = np.array([g for g in inp.table.scales_of(j.job_type)
                           if j.min_gpus <= g <= min(j.scale_factor, biggest) and runs_somewhere(inp, j.job_type, g)])
        if counts.size == 0:
            raise ValueError(f"elastic job {j.job_id} ({j.job_type!r}): the throughput table has no GPU count in "
                             f"[min_gpus={j.min_gpus}, scale_factor={j.scale_factor}] at which it runs on a type "
                             f"that has that many GPUs (largest: {int(biggest)}); the table has "
                             f"{list(inp.table.scales_of(j.job_type))}")
        out.append(counts)
    return out


def admit(inp: PolicyInput, allowed: list[np.ndarray], by: str = "weight") -> np.ndarray:
    """Step 2 of the module docstring: which jobs run (bool per job)."""
    total = inp.capacities.sum()
    lo = np.array([a[0] for a in allowed], dtype=float)
    if lo.sum() <= total:
        return np.ones(inp.n, dtype=bool)
    started = inp.steps_done > 0
    arrival = np.array([j.arrival_s for j in inp.jobs])
    if by == "attained" and inp.time_received_s is not None:
        # Least attained service per unit of weight first (Tiresias-style, weighted): short jobs
        # are not stuck behind long ones, whose sizes nobody knows in advance.
        attained = inp.time_received_s.sum(axis=1) / inp.weights
        order = np.lexsort((inp.job_ids, arrival, -inp.weights, attained))
    else:
        order = np.lexsort((inp.job_ids, arrival, ~started, -inp.weights))
    ok = np.zeros(inp.n, dtype=bool)
    free = total
    for i in order:
        if lo[i] <= free:
            ok[i] = True
            free -= lo[i]
    return ok


def choose_gpu_counts(inp: PolicyInput, admitted: np.ndarray | None = None) -> np.ndarray:
    """Step 1 of the module docstring: each job's GPU count, sharing the cluster among the
    ``admitted`` jobs (default: all); the others get their smallest allowed count."""
    total = inp.capacities.sum()
    allowed = allowed_counts(inp)
    adm = np.ones(inp.n, dtype=bool) if admitted is None else np.asarray(admitted, dtype=bool)
    share = np.zeros(inp.n)
    if adm.any():
        share[adm] = water_fill(inp.scales[adm], inp.weights[adm], total)
    g = np.array([a[max(0, np.searchsorted(a, s + 1e-9) - 1)] for a, s in zip(allowed, share)], dtype=float)
    g_adm = np.where(adm, g, 0.0)
    # Shrink toward the minimum until the admitted jobs fit (a share rounded up to a minimum).
    arrival = np.array([j.arrival_s for j in inp.jobs])
    while g_adm.sum() > total + 1e-9:
        can = [i for i in range(inp.n) if adm[i] and g[i] > allowed[i][0]]
        if not can:
            break  # every admitted job at its minimum: the LP time-shares what is left
        i = max(can, key=lambda i: (g[i] / max(share[i], 1e-12), -inp.weights[i], arrival[i], inp.job_ids[i]))
        g[i] = allowed[i][allowed[i] < g[i]][-1]
        g_adm[i] = g[i]
    spare = total - g_adm.sum()
    elastic = [i for i, j in enumerate(inp.jobs) if j.elastic and adm[i]]
    if spare > 0 and elastic:
        arrival = np.array([inp.jobs[i].arrival_s for i in elastic])
        ids = inp.job_ids[elastic]
        order = [elastic[o] for o in np.lexsort((ids, arrival, -inp.weights[elastic]))]
        changed = True
        while changed and spare > 0:
            changed = False
            for i in order:
                up = allowed[i][allowed[i] > g[i]]
                if up.size and up[0] - g[i] <= spare:
                    spare -= up[0] - g[i]
                    g[i] = up[0]
                    changed = True
    return g


@dataclass(kw_only=True, slots=True)
class ElasticFair:
    """Weighted fair share that resizes elastic jobs (objective: LAS max-min value at the counts)."""

    name: str = "elastic_fair"
    fill: bool = True
    overload: str = "least_attained"
    """When the jobs do not fit even at their minimum counts: ``"least_attained"`` (admit by least
    GPU-time received per unit of weight, ``PolicyInput.time_received_s``; by weight when it is not
    given), ``"queue"`` (admit by weight, started jobs first: no rotation at all) or
    ``"time_share"`` (every job time-shares, Gavel's way: the mechanism rotates jobs every round)."""

    def __post_init__(self) -> None:
        if self.overload not in ("queue", "least_attained", "time_share"):
            raise ValueError(f"overload={self.overload!r} must be 'queue', 'least_attained' or 'time_share'")

    def allocate(self, inp: PolicyInput) -> Allocation:
        if inp.n == 0:
            return single_rows(inp, np.zeros((0, len(inp.types))), 0.0, gpus={})
        if self.overload == "time_share":
            adm = np.ones(inp.n, dtype=bool)
        else:
            adm = admit(inp, allowed_counts(inp), by="attained" if self.overload == "least_attained" else "weight")
        g = choose_gpu_counts(inp, adm)
        T, runnable = inp.with_scales(g)
        runnable = runnable & adm[:, None]
        C = las_coefficients(T[adm], g[adm], inp.capacities, runnable[adm], inp.weights[adm])
        X = np.zeros((inp.n, len(inp.types)))
        X[adm], t = lp.max_min(C, g[adm], inp.capacities, runnable[adm], fill=self.fill, what=self.name)
        gpus = {j.job_id: int(x) for j, x in zip(inp.jobs, g)}
        return single_rows(inp, X, t, gpus=gpus, admitted=[int(i) for i in inp.job_ids[adm]])
