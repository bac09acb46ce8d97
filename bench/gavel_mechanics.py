"""Issue 17: virtualflow's round mechanics against Gavel's, on Gavel's workloads (restarts free, as
in Gavel's simulator).

Round mechanics side by side (``MECHANISMS``; ``--mechanisms`` picks): ``virtualflow``, the
mechanics before issue 17 (``MechanismConfig.lease_first()``), against Gavel's pieces
(``MechanismConfig.gavel()``: per-type queues fastest type first, equal priors after an allocation
change, deficits carried across changes, spread placement when no consolidated one exists; see
docs/cluster.md); ``gavel_consolidated`` (all but spread placement) is the default since issue 17,
chosen on this benchmark's results. The same policies on the same jobs in the same process:

1. **Continuous**: Gavel's continuous multi-GPU workload (``generate_jobs``: Poisson 2 jobs/h,
   steps = duration x one-V100 throughput), 12 V100 + 12 P100 + 12 K80 (4 GPUs per server),
   window of jobs 300-699, round 360 s; ``las_agnostic`` and ``las``; metric: average JCT of the
   window, and the gain agnostic / aware.
2. **Static**: 100 jobs all at time 0 (the same generator, rate 0, scale factors 1/2/4/8),
   8 V100 + 8 P100 + 8 K80; ``makespan`` and ``las``; metrics: makespan, average JCT.

Target (key ``aware_jct_ratio``): the heterogeneity-aware LAS's average JCT under the last
mechanism listed no worse than under the first (first / last >= 1) — an honest check of whether
Gavel's mechanics help; and the figures, side by side.

From the repository root::

    .venv/bin/python -m bench.gavel_mechanics            # continuous seeds 0-2 (800 jobs), static 0-9 (5-20 min on 2 cores)
    .venv/bin/python -m bench.gavel_mechanics --quick    # seed 0, 400 jobs, window 100:300
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from bench import harness as H
from virtualflow.cluster import Cluster, ThroughputTable, gavel_data_dir, get_policy
from virtualflow.cluster.mechanism import MechanismConfig
from virtualflow.cluster.metrics import summarize
from virtualflow.cluster.simulator import SimConfig, simulate
from virtualflow.cluster.traces import GeneratorConfig, generate_jobs

NAME = "gavel_mechanics"
TARGET_KEYS = ("aware_jct_ratio",)
MECHANISMS = ("virtualflow", "equal_prior", "equal_prior_carry", "gavel_consolidated", "gavel")
"""``virtualflow``: the mechanics before issue 17 (``MechanismConfig.lease_first()``: one global
queue, lease holders first after an allocation change); ``equal_prior``: those with Gavel's prior only; ``equal_prior_carry``: plus
carried deficits; ``gavel_consolidated``: all of Gavel's mechanics except spread placement (which
charges no slowdown for a job split over servers)."""


def mechanism(name: str) -> MechanismConfig:
    base = {"round_s": 360.0, "restart_cost_s": 0.0}
    if name == "gavel":
        return MechanismConfig.gavel(**base)
    if name == "gavel_consolidated":  # the default since issue 17
        return MechanismConfig.gavel(placement="consolidated", **base)
    if name == "equal_prior":
        return MechanismConfig.lease_first(prior="equal", **base)
    if name == "equal_prior_carry":
        return MechanismConfig.lease_first(prior="equal", carry_deficits=True, **base)
    if name != "virtualflow":
        raise ValueError(f"mechanism {name!r} must be one of {list(MECHANISMS)}")
    return MechanismConfig.lease_first(**base)


def one(task: tuple) -> dict:
    kind, seed, jobs_n, window, mech, pol = task
    table = ThroughputTable.from_gavel_json(gavel_data_dir() / "simulation_throughputs.json")
    if kind == "continuous":
        cluster = Cluster.parse("v100=12,p100=12,k80=12", gpus_per_server=4)
        jobs = generate_jobs(table, GeneratorConfig(num_jobs=jobs_n, rate_per_hour=2.0, seed=seed))
        cfg = SimConfig(mechanism=mechanism(mech), window=window)
    else:
        cluster = Cluster.parse("v100=8,p100=8,k80=8", gpus_per_server=4)
        jobs = generate_jobs(table, GeneratorConfig(num_jobs=100, rate_per_hour=0.0, seed=seed))
        cfg = SimConfig(mechanism=mechanism(mech))
    t0 = time.perf_counter()
    s = summarize(simulate(jobs, cluster, table, get_policy(pol), cfg))
    out = {"kind": kind, "seed": seed, "mechanism": mech, "policy": pol, "avg_jct_h": s["avg_jct_h"],
           "makespan_h": s["makespan_s"] / 3600.0, "utilisation": s["utilisation"], "restarts": s["restarts"],
           "skipped_fragmented": s["skipped_fragmented"], "unfinished": s["unfinished"],
           "wall_s": time.perf_counter() - t0}
    print(f"{kind} seed {seed} {mech:>11} {pol:>12}: avg JCT {out['avg_jct_h']:7.2f} h, makespan "
          f"{out['makespan_h']:7.1f} h, util {out['utilisation']:.3f}, {out['wall_s']:.0f} s", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = H.parser(__doc__)
    ap.add_argument("--seeds", type=lambda v: [int(x) for x in v.split(",")],
                    help="seeds of the continuous workload (default 0,1,2; --quick: 0)")
    ap.add_argument("--static-seeds", type=lambda v: [int(x) for x in v.split(",")],
                    help="seeds of the static workload (default 0-9; --quick: 0)")
    ap.add_argument("--mechanisms", type=lambda v: v.split(","), default=list(MECHANISMS[:2] + MECHANISMS[3:]),
                    help=f"mechanisms to compare, from {','.join(MECHANISMS)} (default: all but equal_prior_carry)")
    args = ap.parse_args(argv)
    for m in args.mechanisms:
        mechanism(m)  # unknown names fail here, before any run
    mechs = tuple(args.mechanisms)
    extra = "".join(f" {a}" for a in (sys.argv[1:] if argv is None else argv) if a != "--quick")
    run = H.Run(NAME, args, TARGET_KEYS)
    seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    static_seeds = args.static_seeds or ([0] if args.quick else list(range(10)))
    jobs_n, window = (400, (100, 300)) if args.quick else (800, (300, 700))
    print(H.banner("Gavel's round mechanics vs virtualflow's (restarts free)"))
    tasks = [("continuous", s, jobs_n, window, m, p) for s in seeds for m in mechs
             for p in ("las_agnostic", "las")]
    tasks += [("static", s, 100, None, m, p) for s in static_seeds for m in mechs for p in ("makespan", "las")]
    with ProcessPoolExecutor(max_workers=2) as pool:
        runs = list(pool.map(one, tasks))
    get = lambda kind, m, p, key: float(np.mean([r[key] for r in runs  # noqa: E731
                                                 if (r["kind"], r["mechanism"], r["policy"]) == (kind, m, p)]))
    rows = []
    for m in mechs:
        agn, aw = get("continuous", m, "las_agnostic", "avg_jct_h"), get("continuous", m, "las", "avg_jct_h")
        rows.append([m, f"{agn:.2f}", f"{aw:.2f}", f"{agn / aw:.2f}x",
                     f"{get('static', m, 'makespan', 'makespan_h'):.1f}",
                     f"{get('static', m, 'las', 'makespan_h'):.1f}", f"{get('static', m, 'las', 'avg_jct_h'):.2f}"])
    per_run = [[r["kind"], r["seed"], r["mechanism"], r["policy"], f"{r['avg_jct_h']:.2f}", f"{r['makespan_h']:.1f}",
                f"{r['utilisation']:.3f}", r["restarts"], r["skipped_fragmented"]] for r in runs]
    ref, alt = mechs[0], mechs[-1]  # the target compares the last mechanism listed with the first
    ratio = get("continuous", alt, "las", "avg_jct_h") / get("continuous", ref, "las", "avg_jct_h")
    md = "\n".join([
        f"# Gavel's round mechanics vs virtualflow's ({'quick' if args.quick else 'full'} run)",
        "",
        f"`{run.command(NAME, extra)}` — restarts free; continuous: {jobs_n} jobs at 2 jobs/h, window "
        f"{window[0]}:{window[1]}, 12:12:12, seeds {seeds}; static: 100 jobs at t=0 on 8:8:8, seeds {static_seeds[0]}-{static_seeds[-1]}; round 360 s. "
        "Means over seeds.",
        "",
        H.md_table(["mechanism", "continuous: las_agnostic avg JCT (h)", "las avg JCT (h)", "gain",
                    "static: makespan policy, makespan (h)", "las makespan (h)", "las avg JCT (h)"], rows),
        "",
        f"Aware LAS average JCT (continuous), {alt} / {ref}: **{ratio:.3f}**.",
        "",
        "Every run:",
        "",
        H.md_table(["workload", "seed", "mechanism", "policy", "avg JCT (h)", "makespan (h)", "utilisation",
                    "restarts", "skipped (fragmented)"], per_run),
        "",
        H.env_markdown(),
    ])
    run.targets.at_least("aware_jct_ratio", f"aware LAS avg JCT, {ref} / {alt} (>= 1: {alt}'s mechanics are no "
                                            "worse)", 1.0 / ratio, 1.0)
    print(md)
    return run.finish({"runs": runs, f"aware_jct_ratio_{alt}_over_{ref}": ratio, "environment": H.environment()},
                      md)


if __name__ == "__main__":
    sys.exit(main())
