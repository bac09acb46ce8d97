"""Fairness policies over effective throughput: LAS (max-min), its heterogeneity-agnostic
baseline, and finish-time fairness.

Notation: ``T[i, k]`` steps/s of job ``i`` alone on type ``k``; ``thr_i(X) = sum_k T[i, k] X[i, k]``;
``eq_i`` = steps/s under an equal 1/n share of every type's GPUs (``lp.equal_share_throughput``;
a job of ``s`` GPUs gets ``1/s`` as much time, so fairness is in GPU-time); ``w_i`` its weight.

- ``las``:          maximise ``min_i thr_i(X) / (w_i eq_i)``  (one LP with a variable ``t``).
- ``las_agnostic``: the same with every runnable ``T[i, k] = 1``: it shares GPU-time fairly but
  does not know that a job is faster on one type than another.
- ``finish_time_fairness`` (Themis): ``rho_i(X) = (e_i + R_i / thr_i(X)) / (e_i + R_i / eq_i)``
  with ``e_i`` seconds since arrival and ``R_i`` steps left (so ``rho = 1`` under the equal share);
  minimise ``max_i rho_i``. A generalised linear-fractional program, solved exactly by the
  Dinkelbach-type method of Crouzeix, Ferland and Schaible: each iteration is one LP, convergence
  is superlinear (3-6 LPs in practice).

Both LAS variants then fill (``fill=True``): a second LP keeps every job at the max-min optimum
and maximises the sum, so capacity the bottleneck jobs cannot use is not left idle.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from virtualflow.cluster.policies import lp
from virtualflow.cluster.policies.base import Allocation, PolicyInput

log = logging.getLogger(__name__)


def single_rows(inp: PolicyInput, X: np.ndarray, objective: float, gpus: dict[int, int] | None = None,
                **info) -> Allocation:
    return Allocation(rows=[(j.job_id,) for j in inp.jobs], X=np.clip(X, 0.0, 1.0),
                      gpus=gpus if gpus is not None else {j.job_id: j.scale_factor for j in inp.jobs},
                      objective=objective, info=info)


def las_coefficients(T: np.ndarray, scales: np.ndarray, caps: np.ndarray, runnable: np.ndarray,
                     weights: np.ndarray) -> np.ndarray:
    """``C[i, k] = T[i, k] / (w_i eq_i)``: weighted normalised effective throughput per unit of X."""
    eq = lp.equal_share_throughput(T, scales, caps, runnable)
    safe = np.where(eq > 0, weights * eq, 1.0)  # eq = 0: runs nowhere, its row stays 0
    return np.where(runnable, T, 0.0) / safe[:, None]


@dataclass(kw_only=True, slots=True)
class Las:
    """Heterogeneity-aware weighted max-min fairness (Gavel's LAS). Objective: the max-min value."""

    name: str = "las"
    fill: bool = True
    """Give capacity the bottleneck jobs cannot use to the others (a second LP); ``central`` off only."""
    central: bool = False
    """Return an interior point of the optimal face (``lp.central_point`` with every job at the
    max-min value) instead of the filled vertex, as Gavel's interior-point solver does: the same
    max-min value, every job with time on several types, no type planned full. On the traces of
    Gavel's scripts (restarts free) it lowered the static LAS's average JCT by 1.4-2.2 % and its
    makespan by 3 %, the continuous one's average JCT by 0.6 % (docs/cluster.md)."""

    def allocate(self, inp: PolicyInput) -> Allocation:
        C = las_coefficients(inp.T, inp.scales, inp.capacities, inp.runnable, inp.weights)
        X, t = lp.max_min(C, inp.scales, inp.capacities, inp.runnable, fill=self.fill and not self.central,
                          what=self.name)
        if self.central and 0 < t < float("inf"):
            floor = np.where((C > 0).any(axis=1), t * (1 - lp.EPS_FIX), 0.0)
            inner = lp.central_point(C, inp.scales, inp.capacities, inp.runnable, floor)
            if inner is not None:
                X = inner
        return single_rows(inp, X, t)


@dataclass(kw_only=True, slots=True)
class LasAgnostic:
    """Weighted max-min fairness that treats every accelerator type alike (throughput 1 where the
    job can run). Objective: the max-min value of normalised GPU-time."""

    name: str = "las_agnostic"
    fill: bool = True

    def allocate(self, inp: PolicyInput) -> Allocation:
        ones = inp.runnable.astype(float)
        C = las_coefficients(ones, inp.scales, inp.capacities, inp.runnable, inp.weights)
        X, t = lp.max_min(C, inp.scales, inp.capacities, inp.runnable, fill=self.fill, what=self.name)
        return single_rows(inp, X, t)


def finish_time_ratios(X: np.ndarray, T: np.ndarray, e: np.ndarray, R: np.ndarray, tiso: np.ndarray) -> np.ndarray:
    thr = (T * X).sum(axis=1)
    with np.errstate(divide="ignore"):
        return (e + R / thr) / tiso


@dataclass(kw_only=True, slots=True)
class FinishTimeFairness:
    """Minimise the largest finish-time-fairness ratio ``rho`` (see the module docstring).

    Objective: ``max_i rho_i`` at the returned X (1 = everyone finishes as early as with an equal
    share). ``info["lower_bound"]``: the certified lower bound on the optimum (from the last LP or its dual).
    """

    name: str = "finish_time_fairness"
    tol: float = 1e-9
    """Stop when the value is certified optimal within this relative gap (LP or dual bound)."""
    max_iter: int = 50
    ipm_from_vars: int = 4000
    """From this many LP variables on, the first LP is solved by HiGHS's interior-point method
    (with crossover): on these LPs it is faster and much steadier than dual simplex."""
    warm_start: bool = True
    """Start each LP after the first from the previous optimal basis (needs ``highspy``; without
    it every LP is solved from scratch through scipy)."""

    def allocate(self, inp: PolicyInput) -> Allocation:
        k = len(inp.types)
        active = inp.runnable.any(axis=1)  # an elastic job too big for every type runs nowhere: no rho
        X_all = np.zeros((inp.n, k))
        if not active.any():
            return single_rows(inp, X_all, 0.0)
        X, rho, iters, lower = self._solve(inp.T[active], inp.runnable[active], inp.scales[active],
                                           inp.capacities, inp.elapsed_s[active], inp.remaining_steps[active])
        X_all[active] = X
        return single_rows(inp, X_all, rho, lps=iters, lower_bound=lower)

    def _solve(self, T: np.ndarray, runnable: np.ndarray, scales: np.ndarray, caps: np.ndarray, e: np.ndarray,
               R: np.ndarray) -> tuple[np.ndarray, float, int, float]:
        n, k = T.shape
        T = np.where(runnable, T, 0.0)
        tiso = e + R / lp.equal_share_throughput(T, scales, caps, runnable)
        X = lp.equal_share_X(scales, caps, runnable)
        r = float(finish_time_ratios(X, T, e, R, tiso).max())  # == 1 up to rounding
        nk = n * k
        base = sp.vstack([lp.job_rows(n, k, 1), lp.cap_rows(scales, k, 1)], format="csr")
        base_b = np.concatenate([np.ones(n), caps])
        bounds = lp.x_bounds(runnable, [(None, None)])
        c = np.zeros(nk + 1)
        c[-1] = 1.0
        tau_col = sp.csr_matrix((-np.ones(n), (np.arange(n), np.full(n, nk))), shape=(n, nk + 1))
        method = "highs-ipm" if nk >= self.ipm_from_vars else "highs-ds"
        warm = lp.WarmStartLP(first_ipm=nk >= self.ipm_from_vars) if self.warm_start and lp.WarmStartLP.available() \
            else None
        iters, lower = 0, -np.inf
        for iters in range(1, self.max_iter + 1):
            # min tau  s.t.  (N_i(X) - r D_i(X)) / D_i(X_prev) <= tau,  N = e thr + R,  D = tiso thr.
            d = tiso * (T * X).sum(axis=1)
            A_fr = lp.coef_rows(T * ((e - r * tiso) / d)[:, None], extra=1) + tau_col
            A = sp.vstack([A_fr, base], format="csr")
            b = np.concatenate([-R / d, base_b])
            if warm is not None:
                x, tau, duals = warm.solve(c, A, b, bounds, what=self.name)
            else:
                res = lp.solve_full(c, A, b, bounds, what=self.name, method=method)
                x, tau, duals = res.x, float(res.fun), res.ineqlin.marginals
            if tau >= -self.tol:
                lower = r
                break  # no X beats r: r is optimal (to tol)
            # Lower bound from the LP dual (lam >= 0, sum 1): for the optimum X*, D_i(X*) >= Dmin_i
            # (rho_i(X*) <= r* <= r), so r* >= r + tau / sum_i lam_i Dmin_i / d_i.
            lam = np.maximum(-duals[:n], 0.0)
            if lam.sum() > 0:
                dmin = tiso * R / (r * tiso - e)
                lower = max(lower, r + tau / float((lam / lam.sum() * dmin / d).sum()))
            X_new = np.clip(x[:nk].reshape(n, k), 0.0, 1.0)
            r_new = float(finish_time_ratios(X_new, T, e, R, tiso).max())
            if r_new >= r:
                break  # stalled at the solver's precision: keep the better X
            X, r = X_new, r_new
            if r - lower <= self.tol * r:
                break  # certified by the dual bound: no further LP needed
        else:
            log.warning("finish_time_fairness: no convergence in %d LPs (rho=%.6g)", self.max_iter, r)
        X = np.clip(X, 0.0, 1.0)
        return X, float(finish_time_ratios(X, T, e, R, tiso).max()), iters, float(lower)
