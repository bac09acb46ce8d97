"""Heterogeneous training (issue 4): virtualflow's speed-based VN map on unequal workers.

Emulated slowdown sets {1,1,3,3}, {1,4}, {1,1,1,8} (``vf.launch(..., slowdowns=...)``: a worker
with slowdown s sleeps (s-1) x its measured per-VN compute after each VN). For each set:

  (a) equal split        ``balance=False`` (V/N VNs per worker);
  (b) virtualflow        ``balance=True``: the coordinator measures seconds per VN, solves the VN
                         counts exactly (a worker may get none: it then idles in the reduction and
                         is measured by probes) and publishes a ``rebalance`` generation; measured
                         after it;
  (c) best homogeneous   each speed class of the set alone (``balance=False``), best throughput;
  (d) ideal sum          sum over the set's workers of B / (V * t_vn(s)), t_vn(s) measured once
                         per distinct slowdown with 1 worker running all V VNs.

Throughput = B / median step time (post-warm-up steps of one generation, rank 0's step time).
Prediction error: the controller's ``prediction`` events (solver's predicted step time at the
rebalance against the median of that generation's steps 2-11), and our own check: the solver
fed the per-VN times the controller reports at the end, against our measured median.
Targets: (b)/(d) >= 0.90 for every set (key ``vs_ideal``), (b)/(a) >= 1.4 on {1,1,3,3} (key
``vs_equal``), mean |prediction error| <= 5 % (key ``prediction_error``).

COMPUTE IS SLEEP-EMULATED. This is a 2-core machine shared with other work: real compute does
not scale past 2 processes here (bench NOTES). The job is a tiny linear model whose loss sleeps
``--pace`` (20 ms) per VN, so a VN's "compute" is ~20 ms of sleep plus about 1 ms of real
work, and 4 workers overlap without competing for the cores. From the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.hetero            # 2 repetitions of everything, ~12-15 min
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.hetero --quick    # 1 repetition, fewer steps, ~6-8 min
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from torch import nn
from torch.utils.data import TensorDataset

from bench import harness as H

NAME = "hetero"
TARGET_KEYS = ("vs_ideal", "vs_equal", "prediction_error")
V = 24  # {1,1,3,3} -> 9,9,3,3; {1,4} -> 19/5 or 20/4; {1,1,1,8} -> 8,8,8,0 (or 8,8,7,1): all near the ideal
VN_BATCH = 4
B = V * VN_BATCH
FEATURES = 32
SETS = [[1, 1, 3, 3], [1, 4], [1, 1, 1, 8]]
TARGET_IDEAL = 0.90
TARGET_EQUAL_1133 = 1.4
TARGET_PRED_ERR = 0.05


def pace_s() -> float:
    return float(os.environ.get("VF_HETERO_PACE_S", "0.020"))


# --------------------------------------------------------------------------------------------
# The job (module level: worker processes import it).


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(B * 64, FEATURES, generator=g)
    y = (x @ torch.randn(FEATURES, 10, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


def tiny() -> nn.Module:
    return nn.Linear(FEATURES, 10)


def sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def paced_loss(model, batch):
    """One VN's loss, after a calibrated sleep standing for the VN's compute."""
    time.sleep(pace_s())
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def make_job():
    import virtualflow as vf

    return vf.Job(model=tiny, optimizer=sgd, loss=paced_loss, dataset=data, global_batch_size=B,
                  virtual_nodes=V, seed=0, name=NAME)


# --------------------------------------------------------------------------------------------
# One run.


def watch(handle, slowdowns: list[float], *, warm: int, measure: int, wait_rebalance: bool,
          timeout_s: float) -> dict:
    """Follow a running job until ``measure`` steps after ``warm`` of the generation to measure
    (the last rebalance generation with ``wait_rebalance``, else generation 0) have passed."""
    t0 = time.perf_counter()
    gen_target, gen_step = (None, None) if wait_rebalance else (0, 0)
    status: dict = {}
    rebalance_inputs = None
    while True:
        status = handle.status()
        if handle.done:
            handle.wait()  # raises the job's error
            raise RuntimeError("the job ended before the measurement")
        ctl = handle.controller  # read only; the controller lives in this process
        if wait_rebalance and rebalance_inputs is None and status["generation"] >= 1:
            change = ctl.change_in_flight  # what the solver was given
            rebalance_inputs = {"generation": status["generation"],
                                "detail": dict(change.detail) if change is not None else None,
                                "reduction_s_seen": ctl.reduction_s}
        if (wait_rebalance and status["generation"] >= 1 and status["formed_generation"] == status["generation"]
                and status["generation"] != gen_target):
            # Measure the last generation: the controller may rebalance again (drift).
            gen_target, gen_step = status["generation"], status["step"]
        if gen_target is not None and status["step"] >= gen_step + warm + measure + 1:
            return {"generation": gen_target, "status": status, "rebalance_inputs": rebalance_inputs,
                    "reduction_s": ctl.reduction_s, "measured_step_s": ctl.measured_step_s}
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError(f"{slowdowns} balance={wait_rebalance}: no measurement after {timeout_s} s "
                               f"(step {status.get('step')}, generation {status.get('generation')})")
        time.sleep(0.05)


def run_config(slowdowns: list[float], balance: bool, *, warm: int, measure: int, wait_rebalance: bool,
               timeout_s: float = 300.0) -> dict:
    """Launch, watch until the measurement window has passed, stop; step times from the history."""
    import virtualflow as vf

    run_dir = tempfile.mkdtemp(prefix="vf-hetero-")
    t0 = time.perf_counter()
    with H.LoadMeter() as meter:
        handle = vf.launch(make_job, workers=len(slowdowns), steps=100_000, slowdowns=list(slowdowns),
                           balance=balance, threads_per_worker=1, run_dir=run_dir)
        try:
            seen = watch(handle, slowdowns, warm=warm, measure=measure, wait_rebalance=wait_rebalance,
                         timeout_s=timeout_s)
            result = handle.stop()
        except BaseException:
            handle.kill()
            raise
    events = H.run_events(run_dir)
    hist = result.history
    window = [h for h in hist if h["generation"] == seen["generation"]][warm : warm + measure]
    times = [h["step_time_s"] for h in window]
    med = H.median(times)
    pre = [h["step_time_s"] for h in hist if h["generation"] == 0][2:]
    status_at_end = seen["status"]
    return {
        "slowdowns": list(slowdowns),
        "balance": balance,
        "generation_measured": seen["generation"],
        "generations_seen": sorted({h["generation"] for h in hist}),
        "rebalances": sum(1 for e in events if e.get("event") == "generation" and e.get("reason") == "rebalance"),
        "steps_total": len(hist),
        "counts": [len(v) for v in window[0]["vns"]] if window else [],
        "step_times": times,
        "median_step_s": med,
        "p25_step_s": H.p25(times),
        "p75_step_s": H.quantile(times, 0.75),
        "rebalance_inputs": seen["rebalance_inputs"],
        "samples_per_s": B / med,
        "pre_rebalance_median_step_s": H.median(pre) if wait_rebalance and pre else None,
        "workers_at_end": [{"id": w["id"], "vns": len(w["vns"]), "time_per_vn_s": w.get("time_per_vn_s")}
                           for w in status_at_end.get("workers", [])],
        "controller_predicted_step_s": status_at_end.get("predicted_step_s"),
        "controller_reduction_s": seen["reduction_s"],
        "controller_measured_step_s": seen["measured_step_s"],
        "prediction_events": [e for e in events if e.get("event") == "prediction"],
        "generation_events": [{k: e.get(k) for k in ("generation", "reason", "assignment", "elapsed_s")}
                              for e in events if e.get("event") == "generation"],
        "other_load_cores": meter.other_cores,
        "wall_s": time.perf_counter() - t0,
        "run_dir": run_dir,
    }


def speed_classes(sd: list[float]) -> list[list[float]]:
    return [[s] * sd.count(s) for s in sorted(set(sd))]


def set_label(sd: list[float]) -> str:
    return "{" + ",".join(f"{x:g}" for x in sd) + "}"


# --------------------------------------------------------------------------------------------
# The phases of a run.


def parse_args(argv: list[str] | None):
    p = H.parser(__doc__, quiet_wait=20.0)
    p.add_argument("--reps", type=int, default=None, help="repetitions of every configuration (default 2; quick 1)")
    p.add_argument("--measure", type=int, default=None, help="steps measured per run (default 30; quick 20)")
    p.add_argument("--warm", type=int, default=3, help="steps of the measured generation skipped")
    p.add_argument("--measure-equal", type=int, default=None, help="steps measured for (a) (default 15; quick 10)")
    p.add_argument("--measure-slow", type=int, default=6,
                   help="steps measured for slow-only runs (standalone s>1, slow homogeneous classes)")
    p.add_argument("--pace", type=float, default=0.020, help="sleep per VN standing for compute (s)")
    args = p.parse_args(argv)
    args.reps = args.reps or (1 if args.quick else 2)
    args.measure = args.measure or (20 if args.quick else 30)
    args.measure_equal = args.measure_equal or (10 if args.quick else 15)
    return args


def measure_standalone(args) -> tuple[dict[float, list[dict]], dict[float, float]]:
    """(d): the per-VN time of each distinct slowdown, 1 worker running all V VNs (once: it is the
    same in every set)."""
    standalone: dict[float, list[dict]] = {}
    for s in sorted({s for sd in SETS for s in sd}):
        n = max(8, args.measure // 2) if s == 1 else args.measure_slow
        r = run_config([s], False, warm=args.warm, measure=n, wait_rebalance=False)
        standalone.setdefault(s, []).append(r)
        print(f"  standalone slowdown {s}: step {r['median_step_s'] * 1e3:.1f} ms -> "
              f"{r['median_step_s'] / V * 1e3:.2f} ms/VN  (other load {r['other_load_cores']:.2f} cores)", flush=True)
    t_vn = {s: H.median([r["median_step_s"] for r in rs]) / V for s, rs in standalone.items()}
    return standalone, t_vn


def measure_set(sd: list[float], args) -> tuple[dict[str, list[dict]], dict[str, list[dict]]]:
    """(a), (b) and (c) for one slowdown set, in alternating order across repetitions."""
    runs: dict[str, list[dict]] = {"equal": [], "vf": []}
    homo: dict[str, list[dict]] = {}
    for rep in range(args.reps):
        for which in (["equal", "vf", "homo"] if rep % 2 == 0 else ["homo", "vf", "equal"]):
            if which == "equal":
                runs["equal"].append(run_config(sd, False, warm=args.warm, measure=args.measure_equal,
                                                wait_rebalance=False))
            elif which == "vf":
                runs["vf"].append(run_config(sd, True, warm=args.warm, measure=args.measure, wait_rebalance=True))
            else:
                for sub in speed_classes(sd):
                    # A slow class alone is far slower: fewer steps suffice for its median.
                    m = args.measure if sub[0] == min(sd) else args.measure_slow
                    r = run_config(sub, False, warm=args.warm, measure=m, wait_rebalance=False)
                    homo.setdefault(",".join(f"{x:g}" for x in sub), []).append(r)
    return runs, homo


def predictions(vf_runs: list[dict]) -> tuple[list[dict], list[dict]]:
    """The controller's prediction events for the measured generation, and our own solve() on the
    per-VN times the controller reported at the end (plus its reduction estimate) against our median."""
    from virtualflow.plan.hetero import solve

    ctl_preds, own_preds = [], []
    for r in vf_runs:
        for e in r["prediction_events"]:
            if e.get("generation") == r["generation_measured"]:
                ctl_preds.append({"predicted_step_s": e["predicted_step_s"], "measured_step_s": e["measured_step_s"],
                                  "error": e["error"]})
        tv = [w["time_per_vn_s"] for w in r["workers_at_end"]]
        plan = solve(V, tv, reduction_s=r["controller_reduction_s"])
        d = (r.get("rebalance_inputs") or {}).get("detail") or {}
        tpv = d.get("time_per_vn")
        own_preds.append({"counts": plan.counts, "predicted_step_s": plan.predicted_step_s,
                          "measured_step_s": r["median_step_s"],
                          "error": (plan.predicted_step_s - r["median_step_s"]) / r["median_step_s"],
                          "same_counts_as_run": plan.counts == r["counts"],
                          "tpv_at_end_ms": "/".join(f"{t * 1e3:.1f}" for t in tv),
                          "tpv_at_rebalance_ms": "/".join(f"{t * 1e3:.1f}" for t in tpv.values()) if tpv else "n/a"})
    return ctl_preds, own_preds


def summarize_set(sd: list[float], runs: dict, homo: dict, t_vn: dict[float, float], waited: float) -> dict:
    from virtualflow.plan.hetero import predict_step_s, solve

    med = lambda rs: H.median([r["median_step_s"] for r in rs])  # noqa: E731
    equal_sps, vf_sps = B / med(runs["equal"]), B / med(runs["vf"])
    homo_sps = {k: B / med(rs) for k, rs in homo.items()}
    best_homo = max(homo_sps, key=homo_sps.get)
    ideal_sps = sum(B / (V * t_vn[s]) for s in sd)
    ctl_preds, own_preds = predictions(runs["vf"])
    sa_plan = solve(V, [t_vn[s] for s in sd])
    out = {
        "slowdowns": sd,
        "waited_for_quiet_s": waited,
        "equal": runs["equal"], "vf": runs["vf"], "homogeneous": homo,
        "vf_counts": [r["counts"] for r in runs["vf"]],
        "solver_counts_from_standalone": sa_plan.counts,
        "standalone_prediction_step_s": predict_step_s(runs["vf"][0]["counts"], [t_vn[s] for s in sd]),
        "samples_per_s": {"equal": equal_sps, "vf": vf_sps, "best_homogeneous": homo_sps[best_homo],
                          "ideal": ideal_sps, "homogeneous": homo_sps},
        "best_homogeneous_subset": best_homo,
        "ratio_vf_ideal": vf_sps / ideal_sps,
        "ratio_vf_equal": vf_sps / equal_sps,
        "ratio_vf_homogeneous": vf_sps / homo_sps[best_homo],
        "integer_optimum_over_ideal": (B / sa_plan.predicted_step_s) / ideal_sps,
        "controller_predictions": ctl_preds,
        "own_predictions": own_preds,
    }
    print(f"  {set_label(sd)}: equal {equal_sps:.0f}, vf {vf_sps:.0f} (counts {out['vf_counts']}), best homogeneous "
          f"{homo_sps[best_homo]:.0f} ({best_homo}), ideal {ideal_sps:.0f} samples/s; vf/ideal "
          f"{out['ratio_vf_ideal']:.3f}, vf/equal {out['ratio_vf_equal']:.2f}, vf/homo {out['ratio_vf_homogeneous']:.2f}; "
          f"pred err (controller) {[round(100 * p['error'], 1) for p in ctl_preds]} %, (own) "
          f"{[round(100 * p['error'], 1) for p in own_preds]} %", flush=True)
    return out


def check_targets(sets_out: list[dict], targets: H.Targets) -> dict:
    all_ctl = [abs(p["error"]) for s in sets_out for p in s["controller_predictions"] if p["error"] is not None]
    all_own = [abs(p["error"]) for s in sets_out for p in s["own_predictions"]]
    ideal_met = [targets.at_least("vs_ideal", f"{set_label(s['slowdowns'])}: virtualflow / ideal sum throughput",
                                  s["ratio_vf_ideal"], TARGET_IDEAL) for s in sets_out]
    s1133 = next(s for s in sets_out if s["slowdowns"] == [1, 1, 3, 3])
    equal_met = targets.at_least("vs_equal", "{1,1,3,3}: virtualflow / equal split throughput",
                                 s1133["ratio_vf_equal"], TARGET_EQUAL_1133, "x")
    ctl_err = sum(all_ctl) / len(all_ctl) if all_ctl else float("nan")
    pred_met = targets.at_most("prediction_error", "mean |prediction error| (controller's prediction events)",
                               ctl_err, TARGET_PRED_ERR)
    return {
        "vf_over_ideal_min": min(s["ratio_vf_ideal"] for s in sets_out),
        "vf_over_ideal_met": all(ideal_met),
        "vf_over_equal_1133": s1133["ratio_vf_equal"],
        "vf_over_equal_1133_met": equal_met,
        "mean_abs_prediction_error_controller": ctl_err if all_ctl else None,
        "mean_abs_prediction_error_own": sum(all_own) / len(all_own) if all_own else None,
        "prediction_error_met": pred_met,
    }


# --------------------------------------------------------------------------------------------
# Report.


def markdown(run: H.Run, args, payload: dict) -> str:
    sets_out, targets, t_vn = payload["sets"], payload["targets"], payload["standalone_time_per_vn_s"]
    rows = []
    for s in sets_out:
        sp = s["samples_per_s"]
        rows.append([set_label(s["slowdowns"]), f"{sp['equal']:.0f}", f"{sp['vf']:.0f}",
                     f"{sp['best_homogeneous']:.0f} ({s['best_homogeneous_subset']})", f"{sp['ideal']:.0f}",
                     f"**{s['ratio_vf_ideal']:.3f}**", f"**{s['ratio_vf_equal']:.2f}x**",
                     f"{s['ratio_vf_homogeneous']:.2f}x", f"{s['integer_optimum_over_ideal']:.3f}",
                     " / ".join("-".join(map(str, c)) for c in s["vf_counts"])])
    table = H.md_table(["slowdowns", "(a) equal split", "(b) virtualflow", "(c) best homogeneous", "(d) ideal sum",
                        "(b)/(d)", "(b)/(a)", "(b)/(c)", "integer optimum/(d)", "VN counts (b)"], rows)
    prow = []
    for s in sets_out:
        for i, (cp, op) in enumerate(zip(s["controller_predictions"] or [None] * len(s["own_predictions"]),
                                         s["own_predictions"])):
            prow.append([set_label(s["slowdowns"]), i + 1,
                         H.num(cp and cp["predicted_step_s"] * 1e3, ".1f", none="n/a"), H.num(cp and cp["measured_step_s"] * 1e3, ".1f", none="n/a"),
                         f"{100 * cp['error']:+.1f} %" if cp and cp["error"] is not None else "n/a",
                         f"{op['predicted_step_s'] * 1e3:.1f}", f"{op['measured_step_s'] * 1e3:.1f}",
                         f"{100 * op['error']:+.1f} %", op["tpv_at_rebalance_ms"], op["tpv_at_end_ms"]])
    ptable = H.md_table(["slowdowns", "rep", "controller predicted (ms)", "controller measured, steps 2-11 (ms)",
                         "error", "solve() on final per-VN times + reduction (ms)", "our median (ms)", "error",
                         "per-VN ms given to the solver at the rebalance", "per-VN ms at the end"], prow)
    srows = [[s, f"{H.median([r['median_step_s'] for r in rs]) * 1e3:.1f}", f"{t_vn[s] * 1e3:.2f}",
              f"{B / (V * t_vn[s]):.0f}"] for s, rs in payload["standalone_runs"].items()]
    stable = H.md_table(["slowdown", "1-worker step (ms, V VNs)", "per VN (ms)", "standalone samples/s"], srows)
    ml = payload["machine_load"]
    ok = lambda b: "met" if b else "MISSED"  # noqa: E731
    verdict = [
        f"- (b)/(d) >= {TARGET_IDEAL}: **{ok(targets['vf_over_ideal_met'])}** (min {targets['vf_over_ideal_min']:.3f}).",
        f"- (b)/(a) >= {TARGET_EQUAL_1133}x on {{1,1,3,3}}: **{ok(targets['vf_over_equal_1133_met'])}** "
        f"({targets['vf_over_equal_1133']:.2f}x).",
        f"- mean |prediction error| <= 5 %: **{ok(targets['prediction_error_met'])}** "
        f"(controller's prediction events: {100 * (targets['mean_abs_prediction_error_controller'] or float('nan')):.1f} %; "
        f"own solve() check: {100 * (targets['mean_abs_prediction_error_own'] or float('nan')):.1f} %).",
    ]
    return "\n".join([
        f"# Heterogeneous training (issue 4){' — quick run' if args.quick else ''}", "",
        H.env_markdown(payload["environment"]), "",
        f"**Compute is sleep-emulated**: a tiny linear model whose loss sleeps {args.pace * 1e3:.0f} ms per VN; "
        f"slowdown s sleeps (s-1) x the measured VN compute after each VN (`vf.launch(slowdowns=...)`). "
        f"Real compute cannot scale past 2 processes on this 2-core machine. V={V}, B={B} ({VN_BATCH} per VN), "
        f"1 thread per worker; {args.reps} repetition(s) of every configuration (standalone runs: once), medians "
        f"of {args.measure} steps for (b) and the fast class of (c), {args.measure_equal} for (a), "
        f"{args.measure_slow} for slow-only runs, after {args.warm} warm-up steps of the measured generation (for "
        f"(b): the generation formed by the rebalance). Throughput = B / median step time; with 2 repetitions, the "
        f"median of the per-run medians.", "",
        f"Machine load (other processes, in cores, during the runs): median {ml['other_load_cores_median']:.2f}, "
        f"max {ml['other_load_cores_max']:.2f}; load average at start {ml['loadavg_start'][0]:.2f}, "
        f"at end {ml['loadavg_end'][0]:.2f}.", "",
        "## Throughput (samples/s)", "", table, "",
        "(c) is the best of each speed class of the set alone, equal split. 'integer optimum/(d)': the best any "
        "integer VN map (counts >= 0) can do relative to the ideal sum with the standalone per-VN times (V is "
        "finite). A worker with 0 VNs stays a member: it joins the gradient reduction with a zero "
        "contribution and its speed is re-measured by probes (one VN timed while it waits for the others).", "",
        "## Targets", "", *verdict, "",
        "## Solver prediction against measured step time", "", ptable, "",
        "## Standalone per-VN time (1 worker, all V VNs)", "", stable, "",
        f"Reproduce: `{run.command(NAME, f' --pace {args.pace:g}' if args.pace != 0.020 else '')}`",
    ])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = H.Run(NAME, args, TARGET_KEYS)
    os.environ["VF_HETERO_PACE_S"] = str(args.pace)  # workers inherit it
    H.apply_malloc_mode("stable")
    logging.getLogger("virtualflow").setLevel(logging.ERROR)
    print(H.banner(f"virtualflow heterogeneous training, V={V}, B={B}, emulated slowdowns {SETS}"))
    print(f"  COMPUTE IS SLEEP-EMULATED: {args.pace * 1e3:.0f} ms sleep per VN + a tiny linear model; "
          f"2 shared cores cannot show real-compute scaling past 2 processes.")
    print(f"  reps={args.reps}, measured steps per run={args.measure} (after {args.warm} warm-up steps of the "
          f"generation)", flush=True)
    load0 = os.getloadavg()
    standalone, t_vn = measure_standalone(args)
    sets_out = []
    for sd in SETS:
        waited, _ = H.wait_for_quiet(args.quiet_wait)
        runs, homo = measure_set(sd, args)
        sets_out.append(summarize_set(sd, runs, homo, t_vn, waited))
    targets = check_targets(sets_out, run.targets)

    loads = [r["other_load_cores"] for s in sets_out for k in ("equal", "vf") for r in s[k]]
    loads += [r["other_load_cores"] for s in sets_out for rs in s["homogeneous"].values() for r in rs]
    loads += [r["other_load_cores"] for rs in standalone.values() for r in rs]
    payload = {
        "benchmark": run.name,
        "environment": H.environment(),
        "config": {"V": V, "B": B, "vn_batch": VN_BATCH, "pace_s": args.pace, "sets": SETS, "reps": args.reps,
                   "measure_steps": args.measure, "measure_steps_equal": args.measure_equal,
                   "measure_steps_slow_only": args.measure_slow, "warm_steps": args.warm, "quick": args.quick,
                   "compute": "sleep-emulated (loss sleeps pace_s per VN; tiny linear model)",
                   "threads_per_worker": 1, "malloc": {k: os.environ.get(k) for k in H.MALLOC_STABLE}},
        "standalone_time_per_vn_s": {f"{s:g}": t for s, t in t_vn.items()},
        "standalone_runs": {f"{s:g}": rs for s, rs in standalone.items()},
        "sets": sets_out,
        "targets": targets,
        "machine_load": {"loadavg_start": load0, "loadavg_end": os.getloadavg(),
                         "other_load_cores_median": H.median(loads), "other_load_cores_max": max(loads)},
        "wall_s": run.elapsed_s,
    }
    md = markdown(run, args, payload)
    print()
    print(md)
    return run.finish(payload, md)


if __name__ == "__main__":
    sys.exit(main())
