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
2. **Time shares.** Heterogeneity-aware weighted max-min fairness (``las``) at those counts, filled.

Resizing in place is what makes this pay: when a job arrives or leaves, elastic jobs shrink or grow
instead of waiting in a queue (the round mechanism charges a short resize pause, not a restart).
Objective reported: the LAS max-min value at the chosen counts.
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


def choose_gpu_counts(inp: PolicyInput) -> np.ndarray:
    """Step 1 of the module docstring: each job's GPU count."""
    total = inp.capacities.sum()
    share = water_fill(inp.scales, inp.weights, total)
    allowed = allowed_counts(inp)
    g = np.array([a[max(0, np.searchsorted(a, s + 1e-9) - 1)] for a, s in zip(allowed, share)], dtype=float)
    spare = total - g.sum()
    elastic = [i for i, j in enumerate(inp.jobs) if j.elastic]
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

    def allocate(self, inp: PolicyInput) -> Allocation:
        if inp.n == 0:
            return single_rows(inp, np.zeros((0, len(inp.types))), 0.0, gpus={})
        g = choose_gpu_counts(inp)
        T, runnable = inp.with_scales(g)
        C = las_coefficients(T, g, inp.capacities, runnable, inp.weights)
        X, t = lp.max_min(C, g, inp.capacities, runnable, fill=self.fill, what=self.name)
        gpus = {j.job_id: int(x) for j, x in zip(inp.jobs, g)}
        return single_rows(inp, X, t, gpus=gpus, gpu_share=water_fill(inp.scales, inp.weights,
                                                                      inp.capacities.sum()))
