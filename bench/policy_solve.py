"""Solve time of every scheduling policy, and of space sharing against the straightforward LP.

Workload: n jobs of Gavel's measured types (``virtualflow.cluster.gavel_data_dir()``'s
``simulation_throughputs.json``) drawn like the issue's trace generator (GPU counts 1/2/4/8 with
probabilities .70/.10/.15/.05, durations 10^U(1.5,3) minutes w.p. 0.8 else 10^U(3,4), total
steps = duration x single-GPU V100 steps/s), a third of the multi-GPU jobs elastic (min 1 GPU),
a quarter with an SLO, weights {1, 2, 5}, mid-flight (random progress and age); cluster of 3
types (v100, p100, k80) with n/4 GPUs each and per-hour prices. Sizes 256, 1024, 2048, 4096 jobs
(space sharing: 64-4096).

Measured: wall time of ``policy.allocate(PolicyInput(...))`` (building the throughput matrix,
the sparse LP and HiGHS included; median of repeats, fresh input each time). Space sharing is
also solved as the straightforward pairwise LP (one variable per same-size pair and type,
HiGHS) in a child process stopped after ``--ref-timeout-s``; sizes whose predicted time exceeds
``--ref-budget-s`` are skipped and marked; the objectives are compared.

Up to 12fc184 this benchmark also timed the cvxpy formulations of ``tests/cluster_reference.py``
(results in ``bench/results/policy_solve.*`` of that commit); a benchmark no longer imports test
code, and those references stay the tests' business.

Targets (issue): every non-space-sharing policy <= 1 s at 2048 jobs (key ``policy_s``); space
sharing <= 5 s at 512 (key ``space_sharing_s``). With ``--quick`` (256 jobs, space sharing 64)
the same limits are checked at the sizes measured: a necessary condition, not the target.
From the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.policy_solve           # full run
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.policy_solve --quick   # 256 jobs (space sharing 64), 1 repeat
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

from bench import harness as H
from virtualflow.cluster import (
    Cluster, JobSpec, PolicyInput, ThroughputTable, gavel_data_dir, get_policy, policy_names,
)

NAME = "policy_solve"
TARGET_KEYS = ("policy_s", "space_sharing_s")
SIZES = (256, 1024, 2048, 4096)
SS_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)
TYPES = ("v100", "p100", "k80")
PRICES = {"v100": 2.48, "p100": 1.46, "k80": 0.45}  # $ per GPU-hour (cloud on-demand, as in Gavel)
TARGET_S = 1.0
TARGET_N = 2048
SS_TARGET_S = 5.0
SS_TARGET_N = 512
SS = "las_space_sharing"


def load_table() -> ThroughputTable:
    return ThroughputTable.from_gavel_json(gavel_data_dir() / "simulation_throughputs.json")


def workload(table: ThroughputTable, n: int, seed: int = 0) -> PolicyInput:
    rng = np.random.default_rng(seed)
    cluster = Cluster(gpus={t: max(1, n // 4) for t in TYPES}, prices=dict(PRICES))
    biggest = max(cluster.gpus.values())
    jobs: list[JobSpec] = []
    while len(jobs) < n:
        jt = table.job_types[rng.integers(len(table.job_types))]
        s = int(rng.choice([1, 2, 4, 8], p=[0.70, 0.10, 0.15, 0.05]))
        if s > biggest or not table.has(jt, s) or not any(table.throughput(jt, t, s) > 0 for t in TYPES):
            continue
        minutes = 10 ** rng.uniform(1.5, 3) if rng.random() < 0.8 else 10 ** rng.uniform(3, 4)
        steps = minutes * 60 * table.throughput(jt, "v100", 1) if table.has(jt, 1) else minutes * 60 * 10.0
        elastic = s > 1 and rng.random() < 1 / 3
        jobs.append(JobSpec(job_id=len(jobs), job_type=jt, scale_factor=s, min_gpus=1 if elastic else None,
                            total_steps=float(steps), weight=float(rng.choice([1.0, 2.0, 5.0])),
                            slo_s=float(minutes * 60 * rng.uniform(1.5, 4)) if rng.random() < 0.25 else None,
                            arrival_s=float(rng.uniform(0, 3600))))
    total = np.array([j.total_steps for j in jobs])
    return PolicyInput(jobs=jobs, cluster=cluster, table=table, time_s=3600.0,
                       steps_done=total * rng.uniform(0, 0.5, n), elapsed_s=rng.uniform(0, 3600, n))


def pairwise_lp(inp: PolicyInput) -> float:
    """Space sharing as the straightforward pairwise LP (no pruning, no aggregation by class), built
    with sparse index arrays and solved by HiGHS: one variable per (pair of same-size jobs, type)
    where both jobs can run. Max-min only (no fill stage). Returns the max-min value."""
    import scipy.sparse as sp
    from scipy.optimize import linprog

    from virtualflow.cluster.policies.fairness import las_coefficients

    n, k = inp.n, len(inp.types)
    T = np.where(inp.runnable, inp.T, 0.0)
    Cn = las_coefficients(T, inp.scales, inp.capacities, inp.runnable, inp.weights)
    norm = np.divide(Cn, T, out=np.zeros_like(T), where=T > 0).max(axis=1)
    ia, ib = np.triu_indices(n, k=1)
    same = inp.scales[ia] == inp.scales[ib]
    ia, ib = ia[same], ib[same]
    Cab = inp.table.colocation_arrays([j.job_type for j in inp.jobs], inp.scales.astype(int), inp.types, ia, ib)
    ok = inp.runnable[ia] & inp.runnable[ib] & ~np.isnan(Cab[..., 0])
    p, kk = np.nonzero(ok)
    a, b, ca, cb = ia[p], ib[p], Cab[p, kk, 0], Cab[p, kk, 1]
    m, nk = p.size, n * k
    nv = nk + m
    jrow, xcol, ycol = np.repeat(np.arange(n), k), np.arange(nk), nk + np.arange(m)
    rows = np.concatenate([jrow, a, b])
    cols = np.concatenate([xcol, ycol, ycol])
    thr = sp.csr_matrix((np.concatenate([Cn.ravel(), ca * norm[a], cb * norm[b]]), (rows, cols)), shape=(n, nv + 1))
    tim = sp.csr_matrix((np.ones(rows.size), (rows, cols)), shape=(n, nv + 1))
    cap = sp.csr_matrix((np.concatenate([np.repeat(inp.scales, k), inp.scales[a]]),
                         (np.concatenate([np.tile(np.arange(k), n), kk]), np.concatenate([xcol, ycol]))),
                        shape=(k, nv + 1))
    tcol = sp.csr_matrix((np.ones(n), (np.arange(n), np.full(n, nv))), shape=(n, nv + 1))
    A = sp.vstack([tcol - thr, tim, cap], format="csr")
    bnd = np.zeros((nv + 1, 2))
    bnd[:nk, 1] = inp.runnable.ravel()
    bnd[nk:, 1] = 1.0
    bnd[nv, 1] = np.inf
    c = np.zeros(nv + 1)
    c[-1] = -1.0
    res = linprog(c, A_ub=A, b_ub=np.concatenate([np.zeros(n), np.ones(n), inp.capacities]), bounds=bnd,
                  method="highs")
    return -float(res.fun)


def _pairwise_child(n: int, conn) -> None:
    inp = workload(load_table(), n)
    t0 = time.perf_counter()
    obj = pairwise_lp(inp)
    conn.send((obj, time.perf_counter() - t0))


def run_pairwise(n: int, timeout_s: float) -> dict[str, Any]:
    """The pairwise LP in a forked child, stopped after ``timeout_s``."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_pairwise_child, args=(n, child))
    proc.start()
    child.close()
    t0 = time.perf_counter()
    out: dict[str, Any]
    if parent.poll(timeout_s):
        try:
            obj, secs = parent.recv()
            out = {"pairwise_s": secs, "pairwise_objective": obj}
        except EOFError:
            out = {"pairwise_error": "child exited without a result"}
    else:
        out = {"pairwise_timeout_s": timeout_s}
    if proc.is_alive():
        proc.kill()
    proc.join()
    out["pairwise_wall_s"] = time.perf_counter() - t0
    return out


def time_policy(name: str, table: ThroughputTable, n: int, repeats: int) -> dict[str, Any]:
    times, obj, info = [], None, {}
    policy = get_policy(name)
    for _ in range(repeats):
        inp = workload(table, n)
        with H.LoadMeter() as meter:
            t0 = time.perf_counter()
            alloc = policy.allocate(inp)
            dt = time.perf_counter() - t0
        times.append(dt)
        obj = alloc.objective
        info = {k: v for k, v in alloc.info.items() if isinstance(v, (int, float))}
        info["other_load_cores"] = meter.other_cores
    return {"policy_s": statistics.median(times), "policy_s_all": times, "objective": obj, "info": info,
            "relaxed_slos": len(alloc.relaxed_slos)}


def fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.0f} ms" if x < 1 else f"{x:.2f} s"


def pairwise_cell(r: dict[str, Any]) -> str:
    if "pairwise_s" in r:
        return f"{fmt_s(r['pairwise_s'])} (rel diff {r['pairwise_rel_diff']:.1e})"
    if "pairwise_timeout_s" in r:
        return f"> {r['pairwise_timeout_s']:.0f} s (stopped)"
    if "pairwise_skipped" in r:
        return f"skipped: {r['pairwise_skipped']}"
    return r.get("pairwise_error", "-")


# --------------------------------------------------------------------------------------------
# The phases of a run.


def parse_args(argv: list[str] | None):
    p = H.parser(__doc__, reps=3, reps_help="timed repeats per size (median; quick: 1)", quiet_wait=60.0)
    p.add_argument("--ref-budget-s", type=float, default=60.0, help="skip a pairwise LP predicted to take longer")
    p.add_argument("--ref-timeout-s", type=float, default=90.0, help="stop a pairwise LP run after this long")
    p.add_argument("--policies", default=",".join(policy_names()))
    args = p.parse_args(argv)
    if args.quick:
        args.reps = 1
    return args


def measure_policy(name: str, table: ThroughputTable, args) -> list[dict]:
    sizes = ((64,) if args.quick else SS_SIZES) if name == SS else ((256,) if args.quick else SIZES)
    results = []
    prev: tuple[int, float] | None = None  # the last pairwise LP: (jobs, seconds)
    for n in sizes:
        r = {"policy": name, "jobs": n, **time_policy(name, table, n, args.reps)}
        if name == SS:
            predicted = prev[1] * (n / prev[0]) ** 2.0 if prev else None
            if predicted is not None and predicted > args.ref_budget_s:
                r["pairwise_skipped"] = (f"predicted {predicted:.0f} s" if np.isfinite(predicted)
                                         else f"a smaller size ran past {args.ref_timeout_s:.0f} s")
            else:
                r.update(run_pairwise(n, args.ref_timeout_s))
                if "pairwise_s" in r:
                    prev = (n, r["pairwise_s"])
                    r["pairwise_rel_diff"] = abs(r["objective"] - r["pairwise_objective"]) / max(
                        1.0, abs(r["objective"]))
                elif "pairwise_timeout_s" in r:
                    prev = (n, float("inf"))
        results.append(r)
        print(f"  {name:22s} n={n:5d}  policy {fmt_s(r['policy_s']):>9s}"
              + (f"   pairwise LP {pairwise_cell(r)}" if name == SS else ""), flush=True)
    return results


def check_targets(results: list[dict], quick: bool, targets: H.Targets) -> list[dict]:
    """Each policy at the target's size (with --quick: at the largest size measured)."""
    verdicts = []
    for name in dict.fromkeys(r["policy"] for r in results):
        mine = [r for r in results if r["policy"] == name]
        ss = name == SS
        want = SS_TARGET_N if ss else TARGET_N
        r = mine[-1] if quick else next((x for x in mine if x["jobs"] == want), None)
        if r is None:
            continue
        key, limit = ("space_sharing_s", SS_TARGET_S) if ss else ("policy_s", TARGET_S)
        note = "" if r["jobs"] == want else f" (quick: target size {want}; a necessary condition only)"
        met = targets.at_most(key, f"{name} at {r['jobs']} jobs: solve time (s){note}", r["policy_s"], limit, " s")
        verdicts.append({"policy": name, "jobs": r["jobs"], "policy_s": r["policy_s"],
                         "target_s": targets.limit(key, limit), "target_jobs": want, "met": met})
    return verdicts


def markdown(run: H.Run, args, results: list[dict], verdicts: list[dict]) -> str:
    rows = [[r["policy"], r["jobs"], fmt_s(r["policy_s"]), f"{r['info']['other_load_cores']:.2f}"] for r in results]
    md = [f"# {run.name}: scheduling policies, solve time", "", H.env_markdown(), "",
          "Workload: Gavel's job types drawn like the trace generator; 3 types (v100, p100, k80) with n/4 GPUs each; "
          f"policy = sparse LP + HiGHS (median of {args.reps}).", "",
          H.md_table(["policy", "jobs", "policy", "other load (cores)"], rows), "",
          "Space sharing, also against the straightforward pairwise LP (one variable per same-size pair and type, "
          "sparse, HiGHS, max-min stage only; the policy prunes dominated pairs, aggregates partners by class and "
          "solves one row per group of identical jobs, then also runs the fill stage):", "",
          H.md_table(["jobs", "policy", "pairwise LP (HiGHS)"],
                     [[r["jobs"], fmt_s(r["policy_s"]), pairwise_cell(r)] for r in results if r["policy"] == SS]), "",
          f"Other processes' CPU use while the policies were timed (this 2-core machine is shared): median "
          f"{statistics.median(r['info']['other_load_cores'] for r in results):.2f} cores, max "
          f"{max(r['info']['other_load_cores'] for r in results):.2f}. The cvxpy references of "
          "`tests/cluster_reference.py` are no longer timed here (see the module docstring).", "",
          "Targets:", ""]
    md += [f"- {v['policy']} at {v['jobs']} jobs: {fmt_s(v['policy_s'])} (target <= {v['target_s']:g} s at "
           f"{v['target_jobs']} jobs): {'met' if v['met'] else 'MISSED'}" for v in verdicts]
    md += ["", f"Command: `{run.command(NAME)}`"]
    return "\n".join(md)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = H.Run(NAME, args, TARGET_KEYS)
    print(H.banner("policy_solve: scheduling policies (sparse LP + HiGHS); space sharing vs the pairwise LP"),
          flush=True)
    waited, _ = H.wait_for_quiet(args.quiet_wait)
    table = load_table()
    get_policy("las").allocate(workload(table, 16))  # warm-up: imports, HiGHS
    results = [r for name in args.policies.split(",") for r in measure_policy(name, table, args)]
    verdicts = check_targets(results, args.quick, run.targets)
    payload = {"benchmark": run.name, "environment": H.environment(), "quick": args.quick, "repeats": args.reps,
               "waited_for_quiet_s": waited, "ref_budget_s": args.ref_budget_s, "ref_timeout_s": args.ref_timeout_s,
               "results": results, "targets": verdicts}
    md = markdown(run, args, results, verdicts)
    print(md)
    return run.finish(payload, md)


if __name__ == "__main__":
    sys.exit(main())
