"""Straightforward cvxpy formulations of the scheduling policies (the tests' independent reference).

Each function rebuilds the problem from the definitions, one job / one type at a time, with
cvxpy and the CLARABEL interior-point solver: a different code path and a different solver from
the policies (sparse index arrays + HiGHS simplex). The convex policies are written in their
natural convex form here (``inv_pos`` of throughput) rather than the LPs the policies solve.
All functions return ``(objective, X)`` with the objective defined as in the policy's docstring.
"""

from __future__ import annotations

import math

import cvxpy as cp
import numpy as np

from virtualflow.cluster.policies.base import PolicyInput

SOLVER = "CLARABEL"
SOLVER_OPTS = {"tol_gap_abs": 1e-9, "tol_gap_rel": 1e-9, "tol_feas": 1e-9, "max_iter": 500}


def throughput_matrix(inp, gpus=None) -> tuple[np.ndarray, np.ndarray]:
    """(T, runnable) from per-entry table lookups (no vectorised helpers)."""
    n, k = len(inp.jobs), len(inp.cluster.types)
    T = np.zeros((n, k))
    ok = np.zeros((n, k), dtype=bool)
    for i, job in enumerate(inp.jobs):
        g = job.scale_factor if gpus is None else int(gpus[i])
        for c, t in enumerate(inp.cluster.types):
            v = inp.table.throughput(job.job_type, t, g)
            if v > 0 and g <= inp.cluster.gpus[t]:
                T[i, c], ok[i, c] = v, True
    return T, ok


def equal_share(inp, T, ok, gpus) -> np.ndarray:
    total = sum(inp.cluster.gpus.values())
    n = len(inp.jobs)
    out = np.zeros(n)
    for i in range(n):
        f = min(1.0, total / (n * gpus[i]))
        out[i] = f * sum(T[i, c] * inp.cluster.gpus[t] for c, t in enumerate(inp.cluster.types)) / total
    return out


def base_constraints(inp, X, ok, gpus) -> list:
    cons = [X >= 0, X <= 1]
    n, k = X.shape
    for i in range(n):
        cons.append(cp.sum(X[i, :]) <= 1)
        for c in range(k):
            if not ok[i, c]:
                cons.append(X[i, c] == 0)
    for c, t in enumerate(inp.cluster.types):
        cons.append(sum(gpus[i] * X[i, c] for i in range(n)) <= inp.cluster.gpus[t])
    return cons


def thr_expr(T, X, i):
    return sum(T[i, c] * X[i, c] for c in range(T.shape[1]))


def solve(prob: cp.Problem) -> float:
    prob.solve(solver=SOLVER, **SOLVER_OPTS)
    if prob.status not in ("optimal", "optimal_inaccurate"):
        raise RuntimeError(f"reference problem status {prob.status}")
    return float(prob.value)


def scales(inp) -> np.ndarray:
    return np.array([j.scale_factor for j in inp.jobs], dtype=float)


def las(inp, agnostic: bool = False, gpus=None):
    g = scales(inp) if gpus is None else np.asarray(gpus, dtype=float)
    T, ok = throughput_matrix(inp, g)
    if agnostic:
        T = ok.astype(float)
    eq = equal_share(inp, T, ok, g)
    n, k = T.shape
    X, t = cp.Variable((n, k)), cp.Variable()
    cons = base_constraints(inp, X, ok, g)
    for i, job in enumerate(inp.jobs):
        if ok[i].any():
            cons.append(t <= thr_expr(T, X, i) / (job.weight * eq[i]))
    return solve(cp.Problem(cp.Maximize(t), cons)), X.value


def finish_time_fairness(inp):
    g = scales(inp)
    T, ok = throughput_matrix(inp)
    eq = equal_share(inp, T, ok, g)
    n, k = T.shape
    X = cp.Variable((n, k))
    rhos = []
    for i, job in enumerate(inp.jobs):
        e = float(inp.elapsed_s[i])
        R = max(job.total_steps - float(inp.steps_done[i]), 1e-9)
        tiso = e + R / eq[i]
        rhos.append((e + R * cp.inv_pos(thr_expr(T, X, i))) / tiso)
    return solve(cp.Problem(cp.Minimize(cp.maximum(*rhos)), base_constraints(inp, X, ok, g))), X.value


def makespan(inp):
    """Minimise the largest remaining time R_i / thr_i directly (convex), in seconds."""
    g = scales(inp)
    T, ok = throughput_matrix(inp)
    n, k = T.shape
    X = cp.Variable((n, k))
    times = [max(j.total_steps - float(inp.steps_done[i]), 1e-9) * cp.inv_pos(thr_expr(T, X, i))
             for i, j in enumerate(inp.jobs)]
    return solve(cp.Problem(cp.Minimize(cp.maximum(*times)), base_constraints(inp, X, ok, g))), X.value


def max_throughput(inp):
    g = scales(inp)
    T, ok = throughput_matrix(inp)
    n, k = T.shape
    X = cp.Variable((n, k))
    obj = sum(thr_expr(T, X, i) / T[i].max() for i in range(n))
    return solve(cp.Problem(cp.Maximize(obj), base_constraints(inp, X, ok, g))), X.value


def min_jct(inp):
    g = scales(inp)
    T, ok = throughput_matrix(inp)
    n, k = T.shape
    X = cp.Variable((n, k))
    obj = sum(j.weight * thr_expr(T, X, i) / max(j.total_steps - float(inp.steps_done[i]), 1e-9)
              for i, j in enumerate(inp.jobs))
    return solve(cp.Problem(cp.Maximize(obj), base_constraints(inp, X, ok, g))), X.value


def slo_demands(inp) -> tuple[dict[int, float], list[int]]:
    d, dropped = {}, []
    for i, j in enumerate(inp.jobs):
        if j.slo_s is None:
            continue
        left = j.slo_s - float(inp.elapsed_s[i])
        if left <= 0:
            dropped.append(j.job_id)
        else:
            d[i] = max(j.total_steps - float(inp.steps_done[i]), 1e-9) / left
    return d, dropped


def slo_factor(inp) -> float:
    d, _ = slo_demands(inp)
    if not d:
        return 1.0
    g = scales(inp)
    T, ok = throughput_matrix(inp)
    X, lam = cp.Variable(T.shape), cp.Variable()
    cons = base_constraints(inp, X, ok, g) + [thr_expr(T, X, i) >= lam * di for i, di in d.items()]
    return min(1.0, solve(cp.Problem(cp.Maximize(lam), cons)))


def min_cost(inp, slo: bool = False, iters: int = 50):
    """Throughput per dollar by Dinkelbach's method on cvxpy LPs (the policy uses Charnes-Cooper)."""
    g = scales(inp)
    T, ok = throughput_matrix(inp)
    n, k = T.shape
    prices = [inp.cluster.prices[t] for t in inp.cluster.types]
    X = cp.Variable((n, k))
    num = sum(thr_expr(T, X, i) / T[i].max() for i in range(n))
    den = sum(X[i, c] * g[i] * prices[c] for i in range(n) for c in range(k))
    cons = base_constraints(inp, X, ok, g)
    if slo:
        d, _ = slo_demands(inp)
        lam = slo_factor(inp)
        scale = 1.0 if lam >= 1 else lam * (1 - 1e-7)
        cons += [thr_expr(T, X, i) >= scale * di for i, di in d.items()]
    ratio = 0.0
    for _ in range(iters):
        solve(cp.Problem(cp.Maximize(num - ratio * den), cons))
        new = float(num.value) / float(den.value)
        if new <= ratio * (1 + 1e-10):
            break
        ratio = new
    return ratio, X.value


def water_fill(demand, weights, total) -> list[float]:
    """Progressive filling: raise a common level; jobs stop at their demand."""
    n = len(demand)
    if sum(demand) <= total:
        return [float(d) for d in demand]
    capped = [False] * n
    while True:
        free = total - sum(demand[i] for i in range(n) if capped[i])
        wsum = sum(weights[i] for i in range(n) if not capped[i])
        level = free / wsum
        newly = [i for i in range(n) if not capped[i] and demand[i] <= weights[i] * level]
        if not newly:
            return [float(demand[i]) if capped[i] else weights[i] * level for i in range(n)]
        for i in newly:
            capped[i] = True


def elastic_allowed(inp) -> list[list[int]]:
    biggest = max(inp.cluster.gpus.values())
    out = []
    for j in inp.jobs:
        if not j.elastic:
            out.append([j.scale_factor])
        else:
            out.append([x for x in inp.table.scales if inp.table.has(j.job_type, x)
                        and j.min_gpus <= x <= min(j.scale_factor, biggest)
                        and any(inp.table.throughput(j.job_type, t, x) > 0 and x <= c
                                for t, c in inp.cluster.gpus.items())])
    return out


def elastic_admitted(inp, overload: str = "least_attained") -> list[bool]:
    """Everyone if the minimum counts fit; else in the overload's order (backfilling)."""
    total = sum(inp.cluster.gpus.values())
    lo = [min(a) for a in elastic_allowed(inp)]
    if sum(lo) <= total:
        return [True] * len(inp.jobs)
    if overload == "least_attained" and inp.time_received_s is not None:
        key = lambda i: (sum(inp.time_received_s[i]) / inp.jobs[i].weight, -inp.jobs[i].weight,  # noqa: E731
                         inp.jobs[i].arrival_s, inp.jobs[i].job_id)
    else:
        key = lambda i: (-inp.jobs[i].weight, not inp.steps_done[i] > 0, inp.jobs[i].arrival_s,  # noqa: E731
                         inp.jobs[i].job_id)
    ok, free = [False] * len(inp.jobs), total
    for i in sorted(range(len(inp.jobs)), key=key):
        if lo[i] <= free:
            ok[i], free = True, free - lo[i]
    return ok


def elastic_counts(inp, admitted=None) -> list[int]:
    total = sum(inp.cluster.gpus.values())
    n = len(inp.jobs)
    adm = admitted if admitted is not None else [True] * n
    ids = [i for i in range(n) if adm[i]]
    fill = water_fill([inp.jobs[i].scale_factor for i in ids], [inp.jobs[i].weight for i in ids], total) if ids else []
    share = [0.0] * n
    for i, s in zip(ids, fill):
        share[i] = s
    allowed = elastic_allowed(inp)
    g = []
    for a, s in zip(allowed, share):
        below = [x for x in a if x <= s + 1e-9]
        g.append(max(below) if below else min(a))
    # Shrink the admitted jobs toward their minimum until they fit.
    while sum(g[i] for i in ids) > total:
        can = [i for i in ids if g[i] > min(allowed[i])]
        if not can:
            break
        i = max(can, key=lambda i: (g[i] / max(share[i], 1e-12), -inp.jobs[i].weight, inp.jobs[i].arrival_s,
                                    inp.jobs[i].job_id))
        g[i] = max(x for x in allowed[i] if x < g[i])
    spare = total - sum(g[i] for i in ids)
    idx = sorted((i for i in ids if inp.jobs[i].elastic),
                 key=lambda i: (-inp.jobs[i].weight, inp.jobs[i].arrival_s, inp.jobs[i].job_id))
    grew = True
    while grew and spare > 0:
        grew = False
        for i in idx:
            up = [x for x in allowed[i] if x > g[i]]
            if up and min(up) - g[i] <= spare:
                spare -= min(up) - g[i]
                g[i] = min(up)
                grew = True
    return g


def elastic_fair(inp, overload: str = "least_attained"):
    """(LAS value over the admitted jobs, X of every job (0 for those waiting), counts)."""
    adm = elastic_admitted(inp, overload) if overload != "time_share" else [True] * len(inp.jobs)
    g = elastic_counts(inp, adm)
    ids = [i for i in range(len(inp.jobs)) if adm[i]]
    sub = PolicyInput(jobs=[inp.jobs[i] for i in ids], cluster=inp.cluster, table=inp.table)
    obj, Xs = las(sub, gpus=[g[i] for i in ids])
    X = np.zeros((len(inp.jobs), len(inp.cluster.types)))
    X[ids] = Xs
    return obj, X, g


def greedy(inp, key, aware: bool = True) -> np.ndarray:
    """Queue order by ``key(job)``; each job takes its fastest type with room, else waits."""
    T, ok = throughput_matrix(inp)
    free = dict(inp.cluster.gpus)
    types = list(inp.cluster.types)
    X = np.zeros(T.shape)
    for i in sorted(range(len(inp.jobs)), key=lambda i: key(inp.jobs[i], T[i])):
        job = inp.jobs[i]
        best = None
        for c, t in enumerate(types):
            if ok[i, c] and free[t] >= job.scale_factor:
                score = T[i, c] if aware else free[t]
                if best is None or score > best[0]:
                    best = (score, c)
        if best is not None:
            X[i, best[1]] = 1.0
            free[types[best[1]]] -= job.scale_factor
    return X


def fifo(inp) -> np.ndarray:
    return greedy(inp, lambda j, t: (j.arrival_s, j.job_id))


def qssf(inp) -> np.ndarray:
    return greedy(inp, lambda j, t: (j.scale_factor * j.total_steps / t.max(), j.arrival_s, j.job_id))


def las_space_sharing(inp):
    """Pairwise formulation: one variable per (pair of same-size jobs, type), no pruning."""
    g = scales(inp)
    T, ok = throughput_matrix(inp)
    eq = equal_share(inp, T, ok, g)
    n, k = T.shape
    types = list(inp.cluster.types)
    pairs = [(a, b) for a in range(n) for b in range(a + 1, n) if g[a] == g[b]]
    X = cp.Variable((n, k))
    Y = cp.Variable((max(len(pairs), 1), k))
    t = cp.Variable()
    cons = [X >= 0, X <= 1, Y >= 0, Y <= 1]
    thr = [thr_expr(T, X, i) for i in range(n)]
    time = [cp.sum(X[i, :]) for i in range(n)]
    use = [sum(g[i] * X[i, c] for i in range(n)) for c in range(k)]
    for i in range(n):
        for c in range(k):
            if not ok[i, c]:
                cons.append(X[i, c] == 0)
    for p, (a, b) in enumerate(pairs):
        for c, tname in enumerate(types):
            ca, cb = inp.table.colocated(inp.jobs[a].job_type, inp.jobs[b].job_type, tname, int(g[a]))
            if not (ok[a, c] and ok[b, c]):
                cons.append(Y[p, c] == 0)
                continue
            thr[a] = thr[a] + ca * Y[p, c]
            thr[b] = thr[b] + cb * Y[p, c]
            use[c] = use[c] + g[a] * Y[p, c]
        time[a] = time[a] + cp.sum(Y[p, :])
        time[b] = time[b] + cp.sum(Y[p, :])
    cons += [time[i] <= 1 for i in range(n)]
    cons += [use[c] <= inp.cluster.gpus[t_] for c, t_ in enumerate(types)]
    cons += [t <= thr[i] / (inp.jobs[i].weight * eq[i]) for i in range(n) if ok[i].any()]
    return solve(cp.Problem(cp.Maximize(t), cons)), (X.value, Y.value, pairs)


def finish_time_ratio_of(inp, X) -> float:
    """max rho of a single-job allocation X (for checking the policy's reported objective)."""
    g = scales(inp)
    T, ok = throughput_matrix(inp)
    eq = equal_share(inp, T, ok, g)
    worst = 0.0
    for i, j in enumerate(inp.jobs):
        e = float(inp.elapsed_s[i])
        R = max(j.total_steps - float(inp.steps_done[i]), 1e-9)
        thr = float(T[i] @ X[i])
        worst = max(worst, (e + (R / thr if thr > 0 else math.inf)) / (e + R / eq[i]))
    return worst
