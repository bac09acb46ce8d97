"""Space sharing (Gavel's LAS with space sharing): two jobs may share the same GPUs, each running
at its co-location throughput from the table.

Rows of the allocation: every job alone, plus pairs ``(a, b)`` of jobs with the same GPU count. A
pair on type ``k`` gives each job its co-located steps/s for the time it runs, occupies both jobs'
time and uses the pair's GPUs once. Policy: heterogeneity-aware weighted max-min fairness
(``las``) over each job's total effective throughput (alone + in pairs), then filled.

The straightforward LP has a variable per (pair of jobs, type): ~n^2/2 of them (44 s at 512 jobs
with HiGHS here). Three exact reductions make it small:

1. **Pruning.** A pair on type ``k`` is useful only when ``Ca / T[a, k] + Cb / T[b, k] > 1``;
   otherwise running the two apart for ``Ca / T[a, k]`` and ``Cb / T[b, k]`` of that time gives both
   the same progress with no more GPU-time and no more of either job's time. (In Gavel's table only
   single-GPU pairs ever pass.)
2. **Aggregation by class.** Co-location throughputs depend only on the jobs' *classes* (job type,
   GPU count). So the LP decides ``y[i, c, k]``: the time job ``i`` spends sharing type ``k`` with
   *some* job of class ``c``. Such totals come from actual pairs iff (a) for classes ``a != b``,
   ``sum_{i in a} y[i, b, k] = sum_{j in b} y[j, a, k]`` (a transport plan with these margins
   exists: the north-west-corner rule builds one), and (b) within one class, no job holds more than
   half of the class's total, ``2 y[i, a, k] <= sum_j y[j, a, k]`` (a symmetric, zero-diagonal
   plan exists: lay the totals around a circle and pair each point with the antipodal one). The
   GPU use of pair time is ``scale / 2`` per unit of ``y`` (each pair is counted from both sides).
3. **Groups of identical jobs.** Jobs with the same normalised throughputs (job type x scale x
   weight) are interchangeable in the LP, whose objectives are concave: averaging an optimum over
   a group is still optimal, so one ``X`` row and one ``y`` per group suffice, with the group's
   multiplicity in the capacity and consistency rows. The LP's size then depends on the number of
   distinct groups (a few hundred with Gavel's table and a few weights), not on the number of jobs.

Same optimum as the pairwise LP (the tests check it against a cvxpy pairwise formulation).

Invariant: pair rows only name two different jobs with the same GPU count; pairs are rebuilt from
each job's ``y`` (its group's) by the two constructions above, so each job's time and throughput
equal the LP's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from virtualflow.cluster.policies import lp
from virtualflow.cluster.policies.base import Allocation, PolicyInput
from virtualflow.cluster.policies.fairness import las_coefficients


def ragged_arange(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + c)`` for each (s, c), without a Python loop."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.intp)
    offsets = np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts) + (np.arange(total) - offsets)


def overlap_segments(cu: np.ndarray, cv: np.ndarray, lo: float, hi: float, shift: float = 0.0
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Segments of [lo, hi): (owner in ``cu``'s partition of x, owner in ``cv``'s of x + shift, length).

    ``cu``/``cv`` are cumulative sums: item ``i`` of u owns ``[cu[i-1], cu[i])``."""
    pts = np.concatenate([[lo], cu[(cu > lo) & (cu < hi)], cv[(cv - shift > lo) & (cv - shift < hi)] - shift, [hi]])
    pts = np.unique(pts)
    length = np.diff(pts)
    mid = pts[:-1] + length / 2
    i = np.minimum(np.searchsorted(cu, mid, side="right"), len(cu) - 1)
    j = np.minimum(np.searchsorted(cv, mid + shift, side="right"), len(cv) - 1)
    return i, j, length


@dataclass(kw_only=True, slots=True)
class LasSpaceSharing:
    """LAS with space sharing (objective: the max-min value of weighted normalised throughput)."""

    name: str = "las_space_sharing"
    fill: bool = True

    def allocate(self, inp: PolicyInput) -> Allocation:
        n, k = inp.n, len(inp.types)
        gpus = {j.job_id: j.scale_factor for j in inp.jobs}
        if n == 0:
            return Allocation(rows=[], X=np.zeros((0, k)), gpus=gpus, objective=0.0)
        T_all = np.where(inp.runnable, inp.T, 0.0)
        Cn_all = las_coefficients(T_all, inp.scales, inp.capacities, inp.runnable, inp.weights)
        # ---- the LP's units: groups of identical jobs (same normalised throughputs, scale, types:
        # job type x scale x weight), multiplicity m; by symmetry one X and one y per group is optimal.
        rep, rep_of, m = lp.job_classes(Cn_all, inp.scales, inp.runnable)
        m = m.astype(float)
        R = rep.size
        T, Cn, scales, runnable = T_all[rep], Cn_all[rep], inp.scales[rep], inp.runnable[rep]
        norm = np.divide(Cn, T, out=np.zeros_like(T), where=T > 0).max(axis=1)  # 1 / (w eq)

        # ---- co-location classes (job type, scale) of the groups, and useful (a <= b, type) entries
        jt = np.array([inp.table.job_type_index(inp.jobs[i].job_type) for i in rep], dtype=np.int64)
        s_int = scales.astype(np.int64)
        _, first, cls = np.unique(jt * 1024 + s_int, return_index=True, return_inverse=True)
        cls = cls.ravel()
        ncls = first.size
        order = np.argsort(cls, kind="stable")
        ngroups = np.bincount(cls, minlength=ncls)
        njobs = np.bincount(cls, weights=m, minlength=ncls)
        start = np.cumsum(ngroups) - ngroups
        ea, eb = np.triu_indices(ncls)  # a <= b
        keep = (s_int[first[ea]] == s_int[first[eb]]) & ((ea != eb) | (njobs[ea] >= 2))
        ea, eb = ea[keep], eb[keep]
        if ea.size and inp.table.has_colocation:
            Cab = inp.table.colocation_arrays([inp.jobs[i].job_type for i in rep], s_int, inp.types,
                                              first[ea], first[eb])  # (E, k, 2)
            Ta, Tb = T[first[ea]], T[first[eb]]
            with np.errstate(divide="ignore", invalid="ignore"):
                gain = np.where(Ta > 0, Cab[..., 0] / Ta, 0.0) + np.where(Tb > 0, Cab[..., 1] / Tb, 0.0)
            ok = (gain > 1) & (Ta > 0) & (Tb > 0) & (np.nan_to_num(Cab[..., 0]) > 0) & (np.nan_to_num(Cab[..., 1]) > 0)
            e_idx, e_k = np.nonzero(ok)
        else:
            e_idx = e_k = np.zeros(0, dtype=np.intp)
            Cab = np.zeros((0, k, 2))
        E = e_idx.size
        a_e, b_e = ea[e_idx], eb[e_idx]
        ca_e, cb_e = Cab[e_idx, e_k, 0], Cab[e_idx, e_k, 1]
        intra = a_e == b_e
        # ---- y variables: side A (groups of a, partner b), then side B (groups of b, partner a; a != b)
        cntA, cntB = ngroups[a_e], np.where(intra, 0, ngroups[b_e])
        yA = order[ragged_arange(start[a_e], cntA)]
        yB = order[ragged_arange(start[b_e], cntB)]
        eA, eB = np.repeat(np.arange(E), cntA), np.repeat(np.arange(E), cntB)
        y_grp = np.concatenate([yA, yB])
        y_ent = np.concatenate([eA, eB])
        y_coef = np.concatenate([ca_e[eA], cb_e[eB]])
        y_side = np.concatenate([np.ones(yA.size), -np.ones(yB.size)])
        V = y_grp.size
        intra_ids = np.flatnonzero(intra)
        n_intra = intra_ids.size
        nk = R * k
        nv = nk + V + n_intra  # then t
        ycol = nk + np.arange(V)
        grow = np.repeat(np.arange(R), k)
        xcol = np.arange(nk)
        # Per group (= per job of the group): normalised throughput and time.
        thr = sp.csr_matrix((np.concatenate([Cn.ravel(), y_coef * norm[y_grp]]),
                             (np.concatenate([grow, y_grp]), np.concatenate([xcol, ycol]))), shape=(R, nv + 1))
        time = sp.csr_matrix((np.ones(nk + V), (np.concatenate([grow, y_grp]), np.concatenate([xcol, ycol]))),
                             shape=(R, nv + 1))
        # GPUs: every job of a group uses them; pair time counted from both sides -> scale / 2.
        cap = sp.csr_matrix((np.concatenate([np.repeat(scales * m, k), m[y_grp] * scales[y_grp] / 2]),
                             (np.concatenate([np.tile(np.arange(k), R), e_k[y_ent]]), np.concatenate([xcol, ycol]))),
                            shape=(k, nv + 1))
        # (a) cross-class consistency (jobs of a with b == jobs of b with a) and each intra total S_e.
        s_col = np.full(E, -1)
        s_col[intra_ids] = nk + V + np.arange(n_intra)
        in_intra = intra[y_ent]
        eq_rows = np.concatenate([y_ent, intra_ids])
        eq_cols = np.concatenate([ycol, s_col[intra_ids]])
        eq_vals = np.concatenate([y_side * m[y_grp], -np.ones(n_intra)])
        A_eq = sp.csr_matrix((eq_vals, (eq_rows, eq_cols)), shape=(E, nv + 1)) if E else None
        # (b) within a class, no job holds more than half of the class's total: 2 y - S_e <= 0.
        yi = np.flatnonzero(in_intra)
        half = sp.csr_matrix((np.concatenate([np.full(yi.size, 2.0), -np.ones(yi.size)]),
                              (np.concatenate([np.arange(yi.size)] * 2), np.concatenate([ycol[yi], s_col[y_ent[yi]]]))),
                             shape=(yi.size, nv + 1))
        active = np.flatnonzero(Cn.any(axis=1))
        t_col = sp.csr_matrix((np.ones(active.size), (np.arange(active.size), np.full(active.size, nv))),
                              shape=(active.size, nv + 1))
        bounds = np.zeros((nv + 1, 2))
        bounds[:nk, 1] = runnable.ravel()
        bounds[nk:nk + V, 1] = 1.0
        bounds[nk + V:nv, 1] = np.inf
        bounds[nv] = (0.0, np.inf)
        b_eq = np.zeros(E) if E else None
        A = sp.vstack([t_col - thr[active], time, cap, half], format="csr")
        b = np.concatenate([np.zeros(active.size), np.ones(R), inp.capacities, np.zeros(yi.size)])
        c = np.zeros(nv + 1)
        c[-1] = -1.0
        x, fun = lp.solve(c, A, b, bounds, A_eq=A_eq, b_eq=b_eq, what=self.name)
        t = -fun
        if self.fill and active.size:
            A2 = sp.vstack([-thr[active], time, cap, half], format="csr")
            b2 = np.concatenate([-np.full(active.size, t * (1 - lp.EPS_FIX)), np.ones(R), inp.capacities,
                                 np.zeros(yi.size)])
            bounds[nv] = (0.0, 0.0)
            obj = -np.asarray((sp.diags(m) @ thr).sum(axis=0)).ravel()
            x, _ = lp.solve(obj, A2, b2, bounds, A_eq=A_eq, b_eq=b_eq, what=self.name + " (fill)")
        X_single = np.clip(x[:nk].reshape(R, k), 0.0, 1.0)[rep_of]
        y_g = np.clip(x[nk:nk + V], 0.0, 1.0)
        # ---- back to jobs: every job of a group gets its group's y; then rebuild pairs.
        live = y_g > 1e-12
        members_order = np.argsort(rep_of, kind="stable")
        m_start = np.cumsum(m.astype(np.intp)) - m.astype(np.intp)
        vi = np.flatnonzero(live)
        cnt = m.astype(np.intp)[y_grp[vi]]
        y_job = members_order[ragged_arange(m_start[y_grp[vi]], cnt)]
        rep_v = np.repeat(vi, cnt)
        pa, pb, pk, pm = self._pairs(y_g[rep_v], y_job, y_ent[rep_v], in_intra[rep_v], y_side[rep_v], e_k, E)
        keys = np.minimum(pa, pb) * n + np.maximum(pa, pb)
        uniq, inv = np.unique(keys, return_inverse=True)
        X_pair = np.zeros((uniq.size, k))
        np.add.at(X_pair, (inv, pk), pm)
        ids = inp.job_ids
        rows = [(int(i),) for i in ids] + [(int(ids[u // n]), int(ids[u % n])) for u in uniq]
        return Allocation(rows=rows, X=np.vstack([X_single, np.clip(X_pair, 0.0, 1.0)]), gpus=gpus, objective=t,
                          info={"pair_variables": int(V), "class_entries": int(E), "pairs_used": int(uniq.size)})

    @staticmethod
    def _pairs(y: np.ndarray, y_job: np.ndarray, y_ent: np.ndarray, in_intra: np.ndarray, y_side: np.ndarray,
               e_k: np.ndarray, E: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Rebuild job pairs (a, b, type, time) from the per-class totals ``y`` (module docstring)."""
        out_a, out_b, out_k, out_m = [], [], [], []
        live = y > 1e-12
        ents = np.unique(y_ent[live])
        by_ent = np.argsort(y_ent, kind="stable")
        bounds = np.searchsorted(y_ent[by_ent], np.arange(E + 1))
        for e in ents:  # one small step per (class pair, type) that is used
            v = by_ent[bounds[e]:bounds[e + 1]]
            v = v[live[v]]
            if in_intra[v[0]]:
                r = y[v]
                cu = np.cumsum(r)
                h = cu[-1] / 2
                i, j, m = overlap_segments(cu, cu, 0.0, h, shift=h)
            else:
                va, vb = v[y_side[v] > 0], v[y_side[v] < 0]
                if va.size == 0 or vb.size == 0:
                    continue
                cu, cv = np.cumsum(y[va]), np.cumsum(y[vb])
                hi = min(cu[-1], cv[-1])
                cu[-1] = cv[-1] = hi  # equal up to the solver's tolerance
                i, j, m = overlap_segments(cu, cv, 0.0, hi)
                i, j = np.flatnonzero(y_side[v] > 0)[i], np.flatnonzero(y_side[v] < 0)[j]  # positions in v
            ok = (m > 1e-12) & (y_job[v[i]] != y_job[v[j]])
            out_a.append(y_job[v[i[ok]]])
            out_b.append(y_job[v[j[ok]]])
            out_k.append(np.full(int(ok.sum()), e_k[e]))
            out_m.append(m[ok])
        if not out_a:
            z = np.zeros(0, dtype=np.intp)
            return z, z, z, np.zeros(0)
        return np.concatenate(out_a), np.concatenate(out_b), np.concatenate(out_k), np.concatenate(out_m)
