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

COMPUTE IS SLEEP-EMULATED. This is a 2-core machine shared with other work: real compute does
not scale past 2 processes here (bench NOTES). The job is a tiny linear model whose loss sleeps
``--pace`` (20 ms) per VN, so a VN's "compute" is ~20 ms of sleep plus about 1 ms of real
work, and 4 workers overlap without competing for the cores.

    python bench/hetero.py            # full run (2 repetitions of every configuration), ~12-15 min
    python bench/hetero.py --quick    # 1 repetition, fewer steps, ~6-8 min
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

NAME = "hetero"
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


def read_events(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "events.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_config(slowdowns: list[float], balance: bool, *, warm: int, measure: int, wait_rebalance: bool,
               timeout_s: float = 300.0) -> dict:
    """Launch, wait for the generation to measure (the rebalance one with ``wait_rebalance``),
    let ``warm`` steps of it pass, take ``measure`` more, stop; step times from the history."""
    import virtualflow as vf

    run_dir = tempfile.mkdtemp(prefix="vf-hetero-")
    t0 = time.perf_counter()
    with C.LoadMeter() as meter:
        handle = vf.launch(make_job, workers=len(slowdowns), steps=100_000, slowdowns=list(slowdowns),
                           balance=balance, threads_per_worker=1, run_dir=run_dir)
        gen_target, gen_step = (None, None) if wait_rebalance else (0, 0)
        status = {}
        rebalance_inputs = None
        try:
            while True:
                status = handle.status()
                if handle.done:
                    handle.wait()  # raises the job's error
                    raise RuntimeError("the job ended before the measurement")
                if wait_rebalance and rebalance_inputs is None and status["generation"] >= 1:
                    # What the solver was given (read only; the controller lives in this process).
                    ch = handle.controller._change
                    rebalance_inputs = {"generation": status["generation"],
                                        "detail": dict(ch.detail) if ch is not None else None,
                                        "reduction_s_seen": handle.controller.reduction_s}
                if (wait_rebalance and status["generation"] >= 1 and status["formed_generation"] == status["generation"]
                        and status["generation"] != gen_target):
                    # Measure the last generation: the controller may rebalance again (drift).
                    gen_target, gen_step = status["generation"], status["step"]
                if gen_target is not None and status["step"] >= gen_step + warm + measure + 1:
                    break
                if time.perf_counter() - t0 > timeout_s:
                    raise TimeoutError(f"{slowdowns} balance={balance}: no measurement after {timeout_s} s "
                                       f"(step {status.get('step')}, generation {status.get('generation')})")
                time.sleep(0.05)
            status_at_end = status
            controller_reduction_s = handle.controller.reduction_s  # read only (not in status())
            result = handle.stop()
        except BaseException:
            handle.kill()
            raise
    events = read_events(run_dir)
    hist = result.history
    gens = sorted({h["generation"] for h in hist})
    in_gen = [h for h in hist if h["generation"] == gen_target]
    window = in_gen[warm : warm + measure]
    times = [h["step_time_s"] for h in window]
    med = C.median(times)
    counts = [len(v) for v in window[0]["vns"]] if window else []
    pre = [h["step_time_s"] for h in hist if h["generation"] == 0][2:]
    return {
        "slowdowns": list(slowdowns),
        "balance": balance,
        "generation_measured": gen_target,
        "generations_seen": gens,
        "rebalances": sum(1 for e in events if e.get("event") == "generation" and e.get("reason") == "rebalance"),
        "steps_total": len(hist),
        "counts": counts,
        "step_times": times,
        "median_step_s": med,
        "p25_step_s": C.quantile(times, 0.25),
        "p75_step_s": C.quantile(times, 0.75),
        "rebalance_inputs": rebalance_inputs,
        "samples_per_s": B / med,
        "pre_rebalance_median_step_s": C.median(pre) if wait_rebalance and pre else None,
        "workers_at_end": [{"id": w["id"], "vns": len(w["vns"]), "time_per_vn_s": w.get("time_per_vn_s")}
                           for w in status_at_end.get("workers", [])],
        "controller_predicted_step_s": status_at_end.get("predicted_step_s"),
        "controller_reduction_s": controller_reduction_s,
        "prediction_events": [e for e in events if e.get("event") == "prediction"],
        "generation_events": [{k: e.get(k) for k in ("generation", "reason", "assignment", "elapsed_s")}
                              for e in events if e.get("event") == "generation"],
        "other_load_cores": meter.other_cores,
        "wall_s": time.perf_counter() - t0,
        "run_dir": run_dir,
    }


def _tpv_at_rebalance(r: dict) -> str:
    d = (r.get("rebalance_inputs") or {}).get("detail") or {}
    tpv = d.get("time_per_vn")
    return "/".join(f"{t * 1e3:.1f}" for t in tpv.values()) if tpv else "n/a"


def speed_classes(sd: list[float]) -> list[list[float]]:
    return [[s] * sd.count(s) for s in sorted(set(sd))]


def fmt(x, nd=3):
    return "n/a" if x is None else f"{x:.{nd}f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a few minutes: 1 repetition, fewer steps")
    p.add_argument("--reps", type=int, default=None, help="repetitions of every configuration (default 2; quick 1)")
    p.add_argument("--measure", type=int, default=None, help="steps measured per run (default 30; quick 20)")
    p.add_argument("--warm", type=int, default=3, help="steps of the measured generation skipped")
    p.add_argument("--measure-equal", type=int, default=None, help="steps measured for (a) (default 15; quick 10)")
    p.add_argument("--measure-slow", type=int, default=6,
                   help="steps measured for slow-only runs (standalone s>1, slow homogeneous classes)")
    p.add_argument("--pace", type=float, default=0.020, help="sleep per VN standing for compute (s)")
    p.add_argument("--quiet-wait", type=float, default=20.0, help="wait up to this long for a quiet machine per set")
    p.add_argument("--out", default=NAME, help="result file name under bench/results")
    args = p.parse_args(argv)
    reps = args.reps or (1 if args.quick else 2)
    measure = args.measure or (20 if args.quick else 30)
    measure_equal = args.measure_equal or (10 if args.quick else 15)
    os.environ["VF_HETERO_PACE_S"] = str(args.pace)  # workers inherit it
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", C.MALLOC_STABLE["MALLOC_MMAP_THRESHOLD_"])
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", C.MALLOC_STABLE["MALLOC_TRIM_THRESHOLD_"])
    import logging

    logging.getLogger("virtualflow").setLevel(logging.ERROR)
    from virtualflow.plan.hetero import predict_step_s, solve

    print(C.banner(f"virtualflow heterogeneous training, V={V}, B={B}, emulated slowdowns {SETS}"))
    print(f"  COMPUTE IS SLEEP-EMULATED: {args.pace * 1e3:.0f} ms sleep per VN + a tiny linear model; "
          f"2 shared cores cannot show real-compute scaling past 2 processes.")
    print(f"  reps={reps}, measured steps per run={measure} (after {args.warm} warm-up steps of the generation)",
          flush=True)
    t_start = time.perf_counter()
    load0 = os.getloadavg()

    # (d) standalone per-VN time of each distinct slowdown: 1 worker, all V VNs.
    standalone: dict[float, list[dict]] = {}
    distinct = sorted({s for sd in SETS for s in sd})
    for rep in range(1):  # once: the per-VN time of a slowdown is the same in every set
        for s in distinct:
            sa_measure = max(8, measure // 2) if s == 1 else args.measure_slow
            r = run_config([s], False, warm=args.warm, measure=sa_measure, wait_rebalance=False)
            standalone.setdefault(s, []).append(r)
            print(f"  standalone slowdown {s}: step {r['median_step_s'] * 1e3:.1f} ms -> "
                  f"{r['median_step_s'] / V * 1e3:.2f} ms/VN  (other load {r['other_load_cores']:.2f} cores)",
                  flush=True)
    t_vn = {s: C.median([r["median_step_s"] for r in rs]) / V for s, rs in standalone.items()}

    sets_out = []
    for sd in SETS:
        waited = C.wait_for_quiet(args.quiet_wait) if args.quiet_wait > 0 else 0.0
        runs: dict[str, list[dict]] = {"equal": [], "vf": []}
        homo: dict[str, list[dict]] = {}
        for rep in range(reps):
            order = ["equal", "vf", "homo"] if rep % 2 == 0 else ["homo", "vf", "equal"]
            for which in order:
                if which == "equal":
                    runs["equal"].append(run_config(sd, False, warm=args.warm, measure=measure_equal,
                                                    wait_rebalance=False))
                elif which == "vf":
                    runs["vf"].append(run_config(sd, True, warm=args.warm, measure=measure, wait_rebalance=True))
                else:
                    for sub in speed_classes(sd):
                        # A slow class alone is far slower: fewer steps suffice for its median.
                        m = measure if sub[0] == min(sd) else args.measure_slow
                        r = run_config(sub, False, warm=args.warm, measure=m, wait_rebalance=False)
                        homo.setdefault(",".join(f"{x:g}" for x in sub), []).append(r)
        med = lambda rs: C.median([r["median_step_s"] for r in rs])  # noqa: E731
        equal_sps = B / med(runs["equal"])
        vf_sps = B / med(runs["vf"])
        homo_sps = {k: B / med(rs) for k, rs in homo.items()}
        best_homo = max(homo_sps, key=homo_sps.get)
        ideal_sps = sum(B / (V * t_vn[s]) for s in sd)
        # Predictions: the controller's events, and our own solve() with the per-VN times the
        # controller reported at the end (plus its reduction estimate) against our median.
        ctl_preds, own_preds = [], []
        for r in runs["vf"]:
            for e in r["prediction_events"]:
                if e.get("generation") == r["generation_measured"]:
                    ctl_preds.append({"predicted_step_s": e["predicted_step_s"], "measured_step_s": e["measured_step_s"],
                                      "error": e["error"]})
            tv = [w["time_per_vn_s"] for w in r["workers_at_end"]]
            plan = solve(V, tv, reduction_s=r["controller_reduction_s"])
            own_preds.append({"counts": plan.counts, "predicted_step_s": plan.predicted_step_s,
                              "measured_step_s": r["median_step_s"],
                              "error": (plan.predicted_step_s - r["median_step_s"]) / r["median_step_s"],
                              "same_counts_as_run": plan.counts == r["counts"],
                              "tpv_at_end_ms": "/".join(f"{t * 1e3:.1f}" for t in tv),
                              "tpv_at_rebalance_ms": _tpv_at_rebalance(r)})
        sa_plan = solve(V, [t_vn[s] for s in sd])
        sa_pred = predict_step_s(runs["vf"][0]["counts"], [t_vn[s] for s in sd])
        out = {
            "slowdowns": sd,
            "waited_for_quiet_s": waited,
            "equal": runs["equal"], "vf": runs["vf"], "homogeneous": homo,
            "vf_counts": [r["counts"] for r in runs["vf"]],
            "solver_counts_from_standalone": sa_plan.counts,
            "standalone_prediction_step_s": sa_pred,
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
        sets_out.append(out)
        print(f"  {{{','.join(f'{x:g}' for x in sd)}}}: equal {equal_sps:.0f}, vf {vf_sps:.0f} (counts "
              f"{out['vf_counts']}), best homogeneous {homo_sps[best_homo]:.0f} ({best_homo}), ideal {ideal_sps:.0f} "
              f"samples/s; vf/ideal {out['ratio_vf_ideal']:.3f}, vf/equal {out['ratio_vf_equal']:.2f}, "
              f"vf/homo {out['ratio_vf_homogeneous']:.2f}; pred err (controller) "
              f"{[round(100 * p['error'], 1) for p in ctl_preds]} %, (own) {[round(100 * p['error'], 1) for p in own_preds]} %",
              flush=True)

    all_ctl = [abs(p["error"]) for s in sets_out for p in s["controller_predictions"] if p["error"] is not None]
    all_own = [abs(p["error"]) for s in sets_out for p in s["own_predictions"]]
    loads = [r["other_load_cores"] for s in sets_out for k in ("equal", "vf") for r in s[k]]
    loads += [r["other_load_cores"] for s in sets_out for rs in s["homogeneous"].values() for r in rs]
    loads += [r["other_load_cores"] for rs in standalone.values() for r in rs]
    s1133 = sets_out[0]
    targets = {
        "vf_over_ideal_min": min(s["ratio_vf_ideal"] for s in sets_out),
        "vf_over_ideal_met": all(s["ratio_vf_ideal"] >= TARGET_IDEAL for s in sets_out),
        "vf_over_equal_1133": s1133["ratio_vf_equal"],
        "vf_over_equal_1133_met": s1133["ratio_vf_equal"] >= TARGET_EQUAL_1133,
        "mean_abs_prediction_error_controller": sum(all_ctl) / len(all_ctl) if all_ctl else None,
        "mean_abs_prediction_error_own": sum(all_own) / len(all_own) if all_own else None,
        "prediction_error_met": bool(all_ctl) and sum(all_ctl) / len(all_ctl) <= TARGET_PRED_ERR,
    }
    payload = {
        "benchmark": NAME,
        "environment": C.environment(),
        "config": {"V": V, "B": B, "vn_batch": VN_BATCH, "pace_s": args.pace, "sets": SETS, "reps": reps,
                   "measure_steps": measure, "measure_steps_equal": measure_equal,
                   "measure_steps_slow_only": args.measure_slow, "warm_steps": args.warm, "quick": args.quick,
                   "compute": "sleep-emulated (loss sleeps pace_s per VN; tiny linear model)",
                   "threads_per_worker": 1, "malloc": {k: os.environ.get(k) for k in C.MALLOC_STABLE}},
        "standalone_time_per_vn_s": {f"{s:g}": t for s, t in t_vn.items()},
        "standalone_runs": {f"{s:g}": rs for s, rs in standalone.items()},
        "sets": sets_out,
        "targets": targets,
        "machine_load": {"loadavg_start": load0, "loadavg_end": os.getloadavg(),
                         "other_load_cores_median": C.median(loads), "other_load_cores_max": max(loads)},
        "wall_s": time.perf_counter() - t_start,
    }

    # ---- report
    rows = []
    for s in sets_out:
        sp = s["samples_per_s"]
        rows.append(["{" + ",".join(f"{x:g}" for x in s["slowdowns"]) + "}",
                     f"{sp['equal']:.0f}", f"{sp['vf']:.0f}", f"{sp['best_homogeneous']:.0f} ({s['best_homogeneous_subset']})",
                     f"{sp['ideal']:.0f}", f"**{s['ratio_vf_ideal']:.3f}**", f"**{s['ratio_vf_equal']:.2f}x**",
                     f"{s['ratio_vf_homogeneous']:.2f}x", f"{s['integer_optimum_over_ideal']:.3f}",
                     " / ".join("-".join(map(str, c)) for c in s["vf_counts"])])
    table = C.md_table(["slowdowns", "(a) equal split", "(b) virtualflow", "(c) best homogeneous", "(d) ideal sum",
                        "(b)/(d)", "(b)/(a)", "(b)/(c)", "integer optimum/(d)", "VN counts (b)"], rows)
    prow = []
    for s in sets_out:
        for i, (cp, op) in enumerate(zip(s["controller_predictions"] or [None] * len(s["own_predictions"]),
                                         s["own_predictions"])):
            prow.append(["{" + ",".join(f"{x:g}" for x in s["slowdowns"]) + "}", i + 1,
                         fmt(cp and cp["predicted_step_s"] * 1e3, 1), fmt(cp and cp["measured_step_s"] * 1e3, 1),
                         f"{100 * cp['error']:+.1f} %" if cp and cp["error"] is not None else "n/a",
                         f"{op['predicted_step_s'] * 1e3:.1f}", f"{op['measured_step_s'] * 1e3:.1f}",
                         f"{100 * op['error']:+.1f} %", op.get("tpv_at_rebalance_ms", "n/a"), op.get("tpv_at_end_ms", "n/a")])
    ptable = C.md_table(["slowdowns", "rep", "controller predicted (ms)", "controller measured, steps 2-11 (ms)",
                         "error", "solve() on final per-VN times + reduction (ms)", "our median (ms)", "error",
                         "per-VN ms given to the solver at the rebalance", "per-VN ms at the end"], prow)
    srows = [[f"{s:g}", f"{C.median([r['median_step_s'] for r in rs]) * 1e3:.1f}", f"{t_vn[s] * 1e3:.2f}",
              f"{B / (V * t_vn[s]):.0f}"] for s, rs in standalone.items()]
    stable = C.md_table(["slowdown", "1-worker step (ms, V VNs)", "per VN (ms)", "standalone samples/s"], srows)
    ml = payload["machine_load"]
    verdict = [
        f"- (b)/(d) >= {TARGET_IDEAL}: **{'met' if targets['vf_over_ideal_met'] else 'MISSED'}** "
        f"(min {targets['vf_over_ideal_min']:.3f}).",
        f"- (b)/(a) >= {TARGET_EQUAL_1133}x on {{1,1,3,3}}: **{'met' if targets['vf_over_equal_1133_met'] else 'MISSED'}** "
        f"({targets['vf_over_equal_1133']:.2f}x).",
        f"- mean |prediction error| <= 5 %: **{'met' if targets['prediction_error_met'] else 'MISSED'}** "
        f"(controller's prediction events: {100 * (targets['mean_abs_prediction_error_controller'] or float('nan')):.1f} %; "
        f"own solve() check: {100 * (targets['mean_abs_prediction_error_own'] or float('nan')):.1f} %).",
    ]
    md = "\n".join([
        f"# Heterogeneous training (issue 4){' — quick run' if args.quick else ''}", "",
        C.env_markdown(), "",
        f"**Compute is sleep-emulated**: a tiny linear model whose loss sleeps {args.pace * 1e3:.0f} ms per VN; "
        f"slowdown s sleeps (s-1) x the measured VN compute after each VN (`vf.launch(slowdowns=...)`). "
        f"Real compute cannot scale past 2 processes on this 2-core machine. V={V}, B={B} ({VN_BATCH} per VN), "
        f"1 thread per worker; {reps} repetition(s) of every configuration (standalone runs: once), medians of "
        f"{measure} steps for (b) and the fast class of (c), {measure_equal} for (a), {args.measure_slow} for "
        f"slow-only runs, after {args.warm} warm-up steps of the measured generation (for (b): the generation "
        f"formed by the rebalance). Throughput = B / median step time; with 2 repetitions, the median of the "
        f"per-run medians.", "",
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
        "Reproduce: `python bench/hetero.py" + (" --quick" if args.quick else "")
        + (f" --pace {args.pace:g}" if args.pace != 0.020 else "") + "`",
    ])
    jp, mp = C.write_results(args.out, payload, md)
    print()
    print(md)
    print(f"\nwrote {jp} and {mp} ({payload['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
