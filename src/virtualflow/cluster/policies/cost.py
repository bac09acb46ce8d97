"""Cost policies: most normalised throughput per dollar, with and without SLOs (Gavel).

Notation as in ``fairness``; ``p_k`` $ per GPU-hour, ``s_i`` GPUs of job ``i``.

- ``min_cost``: maximise ``sum_i thr_i(X) / best_i`` divided by the cost rate
  ``sum_ik X[i, k] s_i p_k`` ($/hour). A linear-fractional program, made an LP by the
  Charnes-Cooper change of variables ``Y = z X``, ``z = 1 / cost``. The ratio does not change when
  X is scaled, so the optimal X is then scaled up as far as the constraints allow (same $/step,
  more progress).
- ``min_cost_slo``: the same, subject to ``thr_i(X) >= d_i = R_i / (deadline_i - e_i)`` for every
  job with an SLO (``R_i`` steps left, ``e_i`` seconds since arrival).

Infeasible SLO sets are relaxed, as follows, reported in ``Allocation.relaxed_slos`` and logged as
a warning: a job already past its deadline has its SLO dropped; for the others an LP finds the
largest ``lam`` such that every SLO job can get ``lam * d_i`` at once; if ``lam < 1`` every SLO job's
requirement becomes ``lam * d_i`` (all listed as relaxed) and ``info["slo_factor"] = lam``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from virtualflow.cluster.policies import lp
from virtualflow.cluster.policies.base import Allocation, PolicyInput
from virtualflow.cluster.policies.fairness import single_rows

log = logging.getLogger(__name__)


def prices_per_type(inp: PolicyInput, policy: str) -> np.ndarray:
    if inp.cluster.prices is None:
        raise ValueError(f"policy {policy!r} needs prices: give Cluster(prices={{type: $ per GPU-hour}}) "
                         f"for {list(inp.types)}")
    p = np.array([inp.cluster.prices[t] for t in inp.types], dtype=float)
    if np.any(p <= 0):
        zero = [t for t, v in zip(inp.types, p) if v <= 0]
        raise ValueError(f"policy {policy!r}: prices of {zero} are 0; throughput per dollar is unbounded on a "
                         "free type, give every type a price > 0")
    return p


def slo_requirements(inp: PolicyInput) -> tuple[np.ndarray, list[int]]:
    """(d, dropped): required steps/s per job (0 = no SLO) and ids of jobs already past their deadline."""
    d = np.zeros(inp.n)
    dropped: list[int] = []
    for i, j in enumerate(inp.jobs):
        if j.slo_s is None:
            continue
        left = j.slo_s - inp.elapsed_s[i]
        if left <= 0:
            dropped.append(j.job_id)
        else:
            d[i] = inp.remaining_steps[i] / left
    return d, dropped


def slo_factor(inp: PolicyInput, d: np.ndarray) -> float:
    """Largest ``lam`` (capped at 1) such that every job can get ``lam * d_i`` steps/s at once."""
    has = d > 0
    if not has.any():
        return 1.0
    T = np.where(inp.runnable, inp.T, 0.0)[has]
    _, lam = lp.max_min(T / d[has][:, None], inp.scales[has], inp.capacities, inp.runnable[has], fill=False,
                        what="SLO feasibility")
    return min(1.0, lam)


def max_throughput_per_dollar(inp: PolicyInput, prices: np.ndarray, d: np.ndarray | None,
                              what: str) -> tuple[np.ndarray, float]:
    """Charnes-Cooper LP; returns (X scaled up to the constraints, normalised throughput per $/hour)."""
    n, k = inp.n, len(inp.types)
    nk = n * k
    T = np.where(inp.runnable, inp.T, 0.0)
    best = T.max(axis=1, keepdims=True)
    C = T / np.where(best > 0, best, 1.0)
    z_col = lambda vals: sp.csr_matrix((vals, (np.arange(len(vals)), np.full(len(vals), nk))),  # noqa: E731
                                       shape=(len(vals), nk + 1))
    blocks = [lp.job_rows(n, k, 1) - z_col(np.ones(n)), lp.cap_rows(inp.scales, k, 1) - z_col(inp.capacities)]
    if d is not None and np.any(d > 0):
        has = np.flatnonzero(d > 0)
        A_slo = -lp.coef_rows(T, extra=1)[has] + z_col(d[has])
        blocks.append(A_slo)
    A = sp.vstack(blocks, format="csr")
    b = np.zeros(A.shape[0])
    cost = (inp.scales[:, None] * prices[None, :]).ravel()
    A_eq = sp.csr_matrix(np.concatenate([cost, [0.0]])[None, :])
    bounds = lp.x_bounds(inp.runnable, [(0.0, None)])
    bounds[:nk, 1] = np.where(inp.runnable.ravel(), np.inf, 0.0)
    c = np.concatenate([-C.ravel(), [0.0]])
    y, fun = lp.solve(c, A, b, bounds, A_eq=A_eq, b_eq=np.ones(1), what=what)
    z = y[-1]
    X = np.clip(y[:nk].reshape(n, k) / z, 0.0, 1.0)
    # Scale up: the ratio is unchanged, progress grows.
    per_job = X.sum(axis=1).max()
    used = (inp.scales[:, None] * X).sum(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        lam = min(1.0 / per_job if per_job > 0 else np.inf,
                  np.min(np.where(used > 0, inp.capacities / used, np.inf)))
    if np.isfinite(lam) and lam > 1:
        X = np.clip(X * lam * (1 - 1e-12), 0.0, 1.0)
    return X, -fun


@dataclass(kw_only=True, slots=True)
class MinCost:
    """Maximise normalised throughput per dollar (objective: that ratio, per $/hour)."""

    name: str = "min_cost"

    def allocate(self, inp: PolicyInput) -> Allocation:
        prices = prices_per_type(inp, self.name)
        if inp.n == 0:
            return single_rows(inp, np.zeros((0, len(inp.types))), 0.0)
        X, v = max_throughput_per_dollar(inp, prices, None, self.name)
        return single_rows(inp, X, v)


@dataclass(kw_only=True, slots=True)
class MinCostSlo:
    """``min_cost`` subject to every job meeting its SLO (relaxed when infeasible: module docstring)."""

    name: str = "min_cost_slo"

    def allocate(self, inp: PolicyInput) -> Allocation:
        prices = prices_per_type(inp, self.name)
        if inp.n == 0:
            return single_rows(inp, np.zeros((0, len(inp.types))), 0.0)
        d, dropped = slo_requirements(inp)
        lam = slo_factor(inp, d)
        relaxed = list(dropped)
        if lam < 1.0:
            relaxed += [j.job_id for j, di in zip(inp.jobs, d) if di > 0]
            d = d * lam * (1 - lp.EPS_FIX)
        if relaxed:
            log.warning("min_cost_slo: the SLOs of %d jobs (ids %s%s) cannot all be met; relaxed: %d past their "
                        "deadline dropped%s", len(relaxed), sorted(relaxed)[:10], "..." if len(relaxed) > 10 else "",
                        len(dropped), f", every other SLO job gets {lam:.4g} of its required throughput"
                        if lam < 1 else "")
        X, v = max_throughput_per_dollar(inp, prices, d, self.name)
        alloc = single_rows(inp, X, v, slo_factor=lam, slo_throughput=d)
        alloc.relaxed_slos = sorted(relaxed)
        return alloc
