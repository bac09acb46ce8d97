"""Sparse LP building blocks shared by the optimisation policies, solved with HiGHS (scipy).

Variables of a single-job problem are ``x = X.ravel()`` (row-major: job ``i``, type ``k`` at
``i * n_types + k``), optionally followed by extra scalars (``t``, ``z``...). The blocks:

- ``job_rows``: ``sum_k X[i, k] <= 1`` (n_jobs rows);
- ``cap_rows``: ``sum_i scale_i X[i, k] <= capacity_k`` (n_types rows);
- ``coef_rows(C)``: ``sum_k C[i, k] X[i, k]`` per job (n_jobs rows), e.g. effective throughput.

Everything is built from index arrays (no Python loop over jobs), so building costs O(n_jobs x n_types).
"""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linprog


class SolveError(RuntimeError):
    """HiGHS found no optimum (infeasible, unbounded, or a model it cannot handle, e.g. weights
    spanning too many orders of magnitude). A caller that must not stop (the cluster service)
    catches it and falls back to a policy that needs no solver."""


EPS_FIX = 1e-7
"""Relative slack when a first-stage optimum is fixed as a constraint of a second stage."""


def job_rows(n: int, k: int, extra: int = 0) -> sp.csr_matrix:
    rows = np.repeat(np.arange(n), k)
    return sp.csr_matrix((np.ones(n * k), (rows, np.arange(n * k))), shape=(n, n * k + extra))


def cap_rows(scales: np.ndarray, k: int, extra: int = 0) -> sp.csr_matrix:
    n = len(scales)
    cols = np.arange(n * k)
    return sp.csr_matrix((np.repeat(scales, k), (np.tile(np.arange(k), n), cols)), shape=(k, n * k + extra))


def coef_rows(C: np.ndarray, extra: int = 0) -> sp.csr_matrix:
    n, k = C.shape
    rows = np.repeat(np.arange(n), k)
    return sp.csr_matrix((C.ravel(), (rows, np.arange(n * k))), shape=(n, n * k + extra))


def solve(c: np.ndarray, A_ub: sp.spmatrix | None, b_ub: np.ndarray | None, bounds: np.ndarray,
          A_eq: sp.spmatrix | None = None, b_eq: np.ndarray | None = None, what: str = "LP") -> tuple[np.ndarray, float]:
    """Minimise ``c @ x`` with HiGHS; ``bounds`` is (n_vars, 2). Raises :class:`SolveError` unless optimal."""
    res = solve_full(c, A_ub, b_ub, bounds, A_eq, b_eq, what)
    return res.x, float(res.fun)


def solve_full(c: np.ndarray, A_ub: sp.spmatrix | None, b_ub: np.ndarray | None, bounds: np.ndarray,
               A_eq: sp.spmatrix | None = None, b_eq: np.ndarray | None = None, what: str = "LP",
               method: str = "highs"):
    """``solve`` returning scipy's result (with the duals: ``res.ineqlin.marginals``)."""
    res = linprog(c, A_ub=A_ub, b_ub=b_ub, A_eq=A_eq, b_eq=b_eq, bounds=bounds, method=method)
    if res.status != 0:
        raise SolveError(f"{what}: HiGHS did not find an optimum (status {res.status}: {res.message})")
    return res


def x_bounds(runnable: np.ndarray, extra: list[tuple[float, float]] = ()) -> np.ndarray:
    """0 <= X <= 1 where the job can run, X = 0 where it cannot; then bounds of the extra scalars."""
    b = np.zeros((runnable.size + len(extra), 2))
    b[: runnable.size, 1] = runnable.ravel().astype(float)
    for j, (lo, hi) in enumerate(extra):
        b[runnable.size + j] = (-np.inf if lo is None else lo, np.inf if hi is None else hi)
    return b


_banner_lock = threading.Lock()
_banner_shown = False


def _new_highs(highspy):
    """A ``highspy.Highs()`` whose banner does not reach stdout.

    HiGHS prints its banner ("Running HiGHS ...") from C++ to file descriptor 1 when the first
    ``Highs`` object of a process is built, before any option can turn output off, and the
    command lines' stdout is theirs (one line of metrics, or JSON). So the first construction
    runs with descriptor 1 pointed at descriptor 2 (stderr): the banner goes there, nothing is
    lost. Later constructions print nothing and are left alone."""
    global _banner_shown
    with _banner_lock:
        if _banner_shown:
            return highspy.Highs()
        sys.stdout.flush()
        saved = os.dup(1)
        try:
            os.dup2(2, 1)
            h = highspy.Highs()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
            _banner_shown = True
        return h


class WarmStartLP:
    """A sequence of LPs of one shape (``min c x, A x <= b, bounds``) solved by HiGHS through
    ``highspy``, each started from the previous optimal basis (dual simplex); the first one by
    interior point + crossover when ``first_ipm``. ``highspy`` ships with cvxpy, not with scipy:
    ``WarmStartLP.available()`` says whether it can be used (callers fall back to ``solve_full``)."""

    def __init__(self, first_ipm: bool = True) -> None:
        import highspy

        self._hs = highspy
        self._h = _new_highs(highspy)
        self._h.setOptionValue("output_flag", False)
        self._first_ipm = first_ipm
        self._basis = None

    @staticmethod
    def available() -> bool:
        try:
            import highspy  # noqa: F401
        except ImportError:
            return False
        return True

    def solve(self, c: np.ndarray, A_ub: sp.spmatrix, b_ub: np.ndarray, bounds: np.ndarray,
              what: str = "LP") -> tuple[np.ndarray, float, np.ndarray]:
        """(x, objective, row duals y <= 0 of the ``A x <= b`` rows, scipy's sign convention)."""
        hs, h = self._hs, self._h
        A = sp.csc_matrix(A_ub)
        A.sort_indices()
        lp_ = hs.HighsLp()
        lp_.num_col_, lp_.num_row_ = A.shape[1], A.shape[0]
        lp_.col_cost_ = np.asarray(c, dtype=float)
        lp_.col_lower_ = bounds[:, 0].astype(float)
        lp_.col_upper_ = bounds[:, 1].astype(float)
        lp_.row_lower_ = np.full(A.shape[0], -np.inf)
        lp_.row_upper_ = np.asarray(b_ub, dtype=float)
        lp_.a_matrix_.format_ = hs.MatrixFormat.kColwise
        lp_.a_matrix_.start_ = A.indptr.astype(np.int32)
        lp_.a_matrix_.index_ = A.indices.astype(np.int32)
        lp_.a_matrix_.value_ = A.data.astype(float)
        lp_.a_matrix_.num_col_, lp_.a_matrix_.num_row_ = A.shape[1], A.shape[0]
        h.passModel(lp_)
        if self._basis is not None:
            h.setOptionValue("solver", "simplex")
            h.setBasis(self._basis)
        else:
            h.setOptionValue("solver", "ipm" if self._first_ipm else "simplex")
        h.run()
        if h.getModelStatus() != hs.HighsModelStatus.kOptimal:
            raise SolveError(f"{what}: HiGHS did not find an optimum ({h.modelStatusToString(h.getModelStatus())})")
        sol = h.getSolution()
        self._basis = h.getBasis()
        return np.asarray(sol.col_value), float(h.getInfo().objective_function_value), np.asarray(sol.row_dual)


def central_point(C: np.ndarray, scales: np.ndarray, caps: np.ndarray, runnable: np.ndarray,
                  floor: np.ndarray) -> np.ndarray | None:
    """An interior point of ``{X: sum_k C[i, k] X[i, k] >= floor_i, job rows, capacity rows}``:
    HiGHS's interior-point method on the feasibility problem (zero objective), without presolve
    and without crossover, so it stops inside the polytope instead of at a vertex. Every
    constraint then keeps some slack: jobs get time on several types and no type is planned to
    the last GPU. ``None`` when HiGHS does not report the point optimal (callers keep their
    vertex). The point is pulled back inside [0, 1] and within capacity (IPM tolerances ~1e-7)."""
    import warnings

    from scipy.optimize import OptimizeWarning

    n_all, k = C.shape
    if n_all == 0:
        return np.zeros((0, k))
    floor_all = np.asarray(floor, dtype=float)
    scales_all = np.asarray(scales, dtype=float)
    # Identical jobs as one class (as max_min): the problem is symmetric under swapping them, so
    # they share one X by construction (an interior point is not exactly symmetric otherwise).
    first, cls, mult = job_classes(C, scales_all, runnable, floor_all)
    C, scales, runnable, floor = C[first], scales_all[first], runnable[first], floor_all[first]
    n = len(first)
    A = sp.vstack([-coef_rows(C), job_rows(n, k), cap_rows(scales * mult, k)], format="csr")
    b = np.concatenate([-floor, np.ones(n), np.asarray(caps, dtype=float)])
    with warnings.catch_warnings():
        # run_crossover is passed to HiGHS verbatim; scipy warns that it does not know it.
        warnings.simplefilter("ignore", OptimizeWarning)
        res = linprog(np.zeros(n * k), A_ub=A, b_ub=b, bounds=x_bounds(runnable), method="highs-ipm",
                      options={"presolve": False, "run_crossover": "off"})
    if res.status != 0 or res.x is None:
        return None
    X = np.where(runnable, np.clip(res.x.reshape(n, k), 0.0, 1.0), 0.0)
    X /= np.maximum(X.sum(axis=1, keepdims=True), 1.0)
    used = (X * (scales * mult)[:, None]).sum(axis=0)
    caps_f = np.asarray(caps, dtype=float)
    X = X * np.where(used > caps_f, caps_f / np.maximum(used, 1e-300), 1.0)[None, :]
    return X[cls]


def job_classes(*per_job: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group jobs whose data rows are identical: (first index of each class, class of each job, sizes)."""
    key = np.column_stack([np.asarray(a, dtype=float).reshape(len(a), -1) for a in per_job])
    _, first, inv, counts = np.unique(key, axis=0, return_index=True, return_inverse=True, return_counts=True)
    return first, inv.ravel(), counts


def max_min(C: np.ndarray, scales: np.ndarray, caps: np.ndarray, runnable: np.ndarray,
            fill: bool = True, what: str = "max-min") -> tuple[np.ndarray, float]:
    """Maximise ``min_i sum_k C[i, k] X[i, k]`` over the single-job polytope; returns (X, optimum).

    With ``fill`` a second LP keeps every job at >= the optimum (less ``EPS_FIX`` relative) and
    maximises the sum of ``C * X``, so capacity the bottleneck jobs cannot use goes to others.

    Jobs with identical data (row of C, scale, runnable types) are solved as one class of
    multiplicity m: the problem is symmetric under swapping them and its objectives are concave,
    so averaging any optimum over the class gives an optimum where they all share one X (the
    same optimum value, and the natural fair answer). Fairness policies have few classes (job
    type x scale x weight), which keeps their LPs small whatever the number of jobs.
    """
    n, k = C.shape
    if n == 0:
        return np.zeros((0, k)), float("inf")
    first, cls, mult = job_classes(C, scales, runnable)
    Xc, t = _max_min(C[first], scales[first], mult.astype(float), caps, runnable[first], fill, what)
    return Xc[cls], t


def max_sum(C: np.ndarray, scales: np.ndarray, caps: np.ndarray, runnable: np.ndarray,
            floor: float | np.ndarray | None = None, what: str = "max-sum") -> tuple[np.ndarray, float]:
    """Maximise ``sum_ik C[i, k] X[i, k]``, optionally with every job's ``sum_k C X >= floor``
    (identical jobs solved as one class, as in ``max_min``)."""
    n, k = C.shape
    if n == 0:
        return np.zeros((0, k)), 0.0
    fl = None if floor is None else np.broadcast_to(np.asarray(floor, dtype=float), (n,))
    first, cls, mult = job_classes(C, scales, runnable, *(() if fl is None else (fl,)))
    Xc, v = _max_sum(C[first], scales[first], mult.astype(float), caps, runnable[first],
                     None if fl is None else fl[first], what)
    return Xc[cls], v


def _max_min(C: np.ndarray, scales: np.ndarray, mult: np.ndarray, caps: np.ndarray, runnable: np.ndarray,
             fill: bool, what: str) -> tuple[np.ndarray, float]:
    n, k = C.shape
    nk = n * k
    # Jobs that cannot get anything (all-zero rows: nowhere to run) do not bound t.
    active = np.flatnonzero((C > 0).any(axis=1))
    if active.size == 0:
        return np.zeros((n, k)), 0.0
    m = active.size
    A_thr = coef_rows(C, extra=1)[active]
    t_col = sp.csr_matrix((np.ones(m), (np.arange(m), np.full(m, nk))), shape=(m, nk + 1))
    A = sp.vstack([t_col - A_thr, job_rows(n, k, 1), cap_rows(scales * mult, k, 1)], format="csr")
    b = np.concatenate([np.zeros(m), np.ones(n), caps])
    c = np.zeros(nk + 1)
    c[-1] = -1.0
    x, fun = solve(c, A, b, x_bounds(runnable, [(0.0, None)]), what=what)
    t = -fun
    if not fill:
        return x[:nk].reshape(n, k), t
    X, _ = _max_sum(C, scales, mult, caps, runnable, np.full(n, t * (1 - EPS_FIX)), what + " (fill)")
    return X, t


def _max_sum(C: np.ndarray, scales: np.ndarray, mult: np.ndarray, caps: np.ndarray, runnable: np.ndarray,
             floor: np.ndarray | None, what: str) -> tuple[np.ndarray, float]:
    n, k = C.shape
    blocks = [job_rows(n, k), cap_rows(scales * mult, k)]
    rhs = [np.ones(n), caps]
    if floor is not None:
        active = np.flatnonzero((C > 0).any(axis=1))
        blocks.append(-coef_rows(C)[active])
        rhs.append(-floor[active])
    x, fun = solve(-(C * mult[:, None]).ravel(), sp.vstack(blocks, format="csr"), np.concatenate(rhs),
                   x_bounds(runnable), what=what)
    return x.reshape(n, k), -fun


def equal_share_throughput(T: np.ndarray, scales: np.ndarray, caps: np.ndarray, runnable: np.ndarray) -> np.ndarray:
    """Steps/s of each job under an equal 1/n share of every type's GPUs (the normaliser of the
    fairness policies): time fraction ``f_i = min(1, C / (n scale_i))`` spread over the types it can
    run on in proportion to their GPU counts (``C`` = all GPUs)."""
    n = T.shape[0]
    C = caps.sum()
    f = np.minimum(1.0, C / (n * scales))
    return f * (np.where(runnable, T, 0.0) @ caps) / C  # 0 for a job that can run nowhere


def equal_share_X(scales: np.ndarray, caps: np.ndarray, runnable: np.ndarray) -> np.ndarray:
    """The (feasible) allocation behind ``equal_share_throughput``."""
    n = len(scales)
    C = caps.sum()
    f = np.minimum(1.0, C / (n * scales))
    return np.where(runnable, f[:, None] * caps[None, :] / C, 0.0)
