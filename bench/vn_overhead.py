"""Virtual-node overhead: one virtualflow worker against a hand-written accumulation loop.

For V in {1, 8, 32} virtual nodes over a global batch of B = 256, the same MLP, data, seed and
optimizer are trained (a) by ``virtualflow.train(make_job, workers=1, ...)`` and (b) by the loop
a PyTorch user would write, in a fresh process with the same thread count::

    for step in range(S):
        xb, yb = X[idx], Y[idx]                  # the step's shuffled global batch
        opt.zero_grad()
        for v in range(V):                       # micro-batches of B/V samples
            loss = loss_fn(model, (xb[v*n:(v+1)*n], yb[v*n:(v+1)*n])) * (1 / V)
            loss.backward()
        opt.step()

Per-step time: virtualflow's ``Result.history[i]["step_time_s"]`` (measured inside the worker,
end of step to end of step), the loop's measured the same way; medians after warm-up steps,
runs interleaved (A B, then B A) to cancel machine noise. Target (issue): virtualflow
<= 1.02x the hand loop. Both runs compute the same thing: their final weights are compared.

Memory: a process's own peak RSS (VmHWM) for both; a separate probe at B = 4096 (where
activations are large enough to see) checks that peak memory does not grow with V.

    python bench/vn_overhead.py            # full run, about 4-5 minutes on 2 cores
    python bench/vn_overhead.py --quick    # about 1 minute
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

NAME = "vn_overhead"
TARGET_RATIO = 1.02


def make_job():
    """The job virtualflow trains (imported by the worker process)."""
    return C.bench_job(NAME, virtual_nodes=1)


# --------------------------------------------------------------------------------------------
# (b) the hand-written loop, run as a child process: ``vn_overhead.py --child-hand JSON``.


def hand_loop(cfg: dict) -> dict:
    threads, V, B, steps = cfg["threads"], cfg["V"], cfg["B"], cfg["steps"]
    torch.set_num_threads(threads)
    X, Y = C.bench_data().tensors
    torch.manual_seed(C.SEED)
    model = C.mlp()
    opt = C.sgd(model.parameters())
    model.train()
    n = B // V
    steps_per_epoch = len(X) // B
    epoch, order = -1, None
    times, losses, ends = [], [], []
    setup_mib = C.vmhwm_mib()
    faults_at = {}
    stop_file = cfg.get("stop_file")  # concurrent mode: run until the launcher creates this file
    if stop_file:
        open(cfg["ready_file"], "w").close()
    t_prev = time.perf_counter()
    for step in range(steps):
        if stop_file and os.path.exists(stop_file):
            steps = step
            break
        if step == cfg.get("warmup", 0):
            faults_at[step] = C.minor_faults()
        e, i = divmod(step, steps_per_epoch)
        if e != epoch:  # same sample order as virtualflow's DataPlan (a DataLoader would shuffle too)
            epoch, order = e, torch.randperm(len(X), generator=torch.Generator().manual_seed(C.SEED + e))
        idx = order[i * B : (i + 1) * B]
        xb, yb = X[idx], Y[idx]
        opt.zero_grad(set_to_none=True)
        loss_sum = torch.zeros(())
        for v in range(V):
            loss = C.cross_entropy(model, (xb[v * n : (v + 1) * n], yb[v * n : (v + 1) * n])) * (1.0 / V)
            loss.backward()
            loss_sum += loss.detach()
        opt.step()
        losses.append(float(loss_sum))  # logged, as virtualflow reports each step's loss
        now = time.perf_counter()
        times.append(now - t_prev)
        ends.append(time.time())
        t_prev = now
    faults_at[steps] = C.minor_faults()
    (s0, f0), (s1, f1) = min(faults_at.items()), max(faults_at.items())
    if cfg.get("save"):
        torch.save(model.state_dict(), cfg["save"])
    return {"step_times": times, "losses": losses, "vmhwm_mib": C.vmhwm_mib(), "ru_maxrss_mib": C.ru_maxrss_mib(),
            "vmhwm_after_setup_mib": setup_mib, "faults_per_step": (f1 - f0) / max(1, s1 - s0), "step_ends": ends}


def run_hand(V: int, B: int, threads: int, steps: int, save: str | None = None, warmup: int = 0) -> dict:
    cfg = {"V": V, "B": B, "threads": threads, "steps": steps, "save": save, "warmup": warmup}
    return C.run_child([os.path.abspath(__file__), "--child-hand", json.dumps(cfg)], threads)


# --------------------------------------------------------------------------------------------
# Diagnostic (off by default): virtualflow (1 worker, 1 thread) and the hand loop (1 thread)
# running at the same time, one per core, compared over the same time window. Meant to cancel
# host noise while keeping the worker loop's costs; on this VM each vCPU's speed drifts on its
# own, so it did not (kept for machines where it does). The launcher's polling (about 2% of a
# core) is shared between the two here instead of being charged to virtualflow.


def run_concurrent(V: int, B: int, steps: int, warmup: int, tmp: str) -> dict:
    import subprocess

    import virtualflow as vf

    stop, ready = os.path.join(tmp, f"stop-{V}"), os.path.join(tmp, f"ready-{V}")
    for f in (stop, ready):
        if os.path.exists(f):
            os.remove(f)
    cfg = {"V": V, "B": B, "threads": 1, "steps": 100 * steps, "warmup": 0, "stop_file": stop, "ready_file": ready}
    hand = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child-hand", json.dumps(cfg)],
                            env=C.child_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while not os.path.exists(ready) and time.time() < deadline and hand.poll() is None:
            time.sleep(0.05)
        run_dir = os.path.join(tmp, f"concurrent-{V}")
        os.environ["VF_BENCH_EVAL_EVERY"] = "0"
        vf.train(make_job, workers=1, steps=steps, virtual_nodes=V, global_batch_size=B, threads_per_worker=1,
                 run_dir=run_dir)
    finally:
        open(stop, "w").close()
        out, err = hand.communicate(timeout=120)
    if hand.returncode != 0:
        raise RuntimeError(f"hand loop exited {hand.returncode}: {err[-2000:]}")
    h = json.loads(out.strip().splitlines()[-1])
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    vf_recs = recs[warmup:]
    lo = vf_recs[0]["time"] - vf_recs[0]["step_time_s"]
    hi = vf_recs[-1]["time"]
    hand_in = [t for t, end in zip(h["step_times"], h["step_ends"]) if lo + t <= end <= hi]
    vf_times = [r["step_time_s"] for r in vf_recs]
    return {"vf_step_times": vf_times, "hand_step_times_in_window": hand_in,
            "vf_median_step_s": C.median(vf_times), "hand_median_step_s": C.median(hand_in),
            "time_ratio": C.median(vf_times) / C.median(hand_in)}


# --------------------------------------------------------------------------------------------
# Diagnostic: virtualflow's step engine (internal API) and the hand loop alternating step by step
# in one process (``--child-alternating JSON``). Both see the same machine state within
# milliseconds, so host noise cancels; what remains is the engine's own per-step and per-VN cost.


def alternating(cfg: dict) -> dict:
    from virtualflow.comm.groups import Group
    from virtualflow.plan.data import DataPlan
    from virtualflow.runtime.engine import BatchLoader, VNEngine

    threads, V, B, steps = cfg["threads"], cfg["V"], cfg["B"], cfg["steps"]
    torch.set_num_threads(threads)
    ds = C.bench_data()
    X, Y = ds.tensors
    torch.manual_seed(C.SEED)
    model = C.mlp()
    engine = VNEngine(model, C.sgd(model.parameters()), None, C.cross_entropy,
                      DataPlan(len(ds), B, V, C.SEED), BatchLoader(ds, None), seed=C.SEED, batchnorm="mean",
                      deterministic=False, device=torch.device("cpu"))
    engine.set_membership(Group(0, 0, 1, None), [list(range(V))])
    torch.manual_seed(C.SEED)
    ref = C.mlp()
    opt = C.sgd(ref.parameters())
    n, steps_per_epoch, orders = B // V, len(X) // B, {}

    def hand_step(step: int) -> None:
        e, i = divmod(step, steps_per_epoch)
        if e not in orders:
            orders.clear()
            orders[e] = torch.randperm(len(X), generator=torch.Generator().manual_seed(C.SEED + e))
        idx = orders[e][i * B : (i + 1) * B]
        xb, yb = X[idx], Y[idx]
        opt.zero_grad(set_to_none=True)
        loss_sum = torch.zeros(())
        for v in range(V):
            loss = C.cross_entropy(ref, (xb[v * n : (v + 1) * n], yb[v * n : (v + 1) * n])) * (1.0 / V)
            loss.backward()
            loss_sum += loss.detach()
        opt.step()
        float(loss_sum)

    t_engine, t_hand = [], []
    for step in range(steps):
        first_engine = step % 2 == 0  # alternate which goes first, too
        for which in (("e", "h") if first_engine else ("h", "e")):
            t0 = time.perf_counter()
            engine.step(step, 0) if which == "e" else hand_step(step)
            (t_engine if which == "e" else t_hand).append(time.perf_counter() - t0)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    return {"engine_step_times": t_engine, "hand_step_times": t_hand, "bit_identical": same}


# --------------------------------------------------------------------------------------------
# (a) virtualflow.


def run_vf(V: int, B: int, threads: int, steps: int, warmup: int = 0) -> dict:
    import virtualflow as vf

    os.environ["VF_BENCH_EVAL_EVERY"] = str(warmup)  # the worker samples its page faults at `warmup`
    cpu0, t0 = time.process_time(), time.perf_counter()
    result = vf.train(make_job, workers=1, steps=steps, virtual_nodes=V, global_batch_size=B,
                      threads_per_worker=threads)
    evals = [e for e in result.eval_history if "minor_faults" in e]
    faults = ((evals[-1]["minor_faults"] - evals[0]["minor_faults"]) / max(1, evals[-1]["step"] - evals[0]["step"])
              if len(evals) >= 2 else float("nan"))
    return {
        "faults_per_step": faults,
        "step_times": [h["step_time_s"] for h in result.history],
        "losses": [h["loss"] for h in result.history],
        "vmhwm_mib": result.metrics.get("vmhwm_mib"),
        "peak_rss_mib": result.peak_rss_mib.get(0),  # what virtualflow itself reports
        "launcher_cpu_s": time.process_time() - cpu0,
        "wall_s": time.perf_counter() - t0,
        "state_dict": result.state_dict,
    }


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="short run (1 repetition, 1 thread, fewer steps)")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=6, help="steps excluded from the medians")
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions (pairs) of every configuration")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--vns", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--mem-batch", type=int, default=4096, help="global batch of the memory probe (0: skip)")
    p.add_argument("--mem-steps", type=int, default=3)
    p.add_argument("--max-other-load", type=float, default=0.10,
                   help="repeat a pair of runs when other processes used more CPU cores than this meanwhile")
    p.add_argument("--retries", type=int, default=2, help="repetitions of a disturbed pair")
    p.add_argument("--quiet-wait", type=float, default=120.0,
                   help="wait up to this many seconds for a quiet machine before each pair (0: do not wait)")
    p.add_argument("--malloc", choices=["stable", "default"], default="stable",
                   help="glibc allocator settings of every training process (see bench/_common.py); "
                        "'default' writes results/vn_overhead_default_malloc.*")
    p.add_argument("--alt-steps", type=int, default=40,
                   help="steps of the in-process alternating diagnostic, per V, 1 thread (0: skip)")
    p.add_argument("--concurrent-steps", type=int, default=0,
                   help="steps of the side-by-side diagnostic (virtualflow and hand loop at once, 1 thread "
                        "each, one per core; 0: skip). Off by default: on this VM each core's speed drifts "
                        "independently, so it cancelled little noise (ratios 0.80-1.26 for the same code)")
    p.add_argument("--concurrent-reps", type=int, default=2)
    p.add_argument("--child-hand", help=argparse.SUPPRESS)
    p.add_argument("--child-alternating", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.child_hand:
        print(json.dumps(hand_loop(json.loads(args.child_hand))))
        return 0
    if args.child_alternating:
        print(json.dumps(alternating(json.loads(args.child_alternating))))
        return 0
    if args.quick:
        args.steps, args.warmup, args.reps, args.threads, args.mem_steps, args.alt_steps = 16, 4, 2, [1], 2, 20
    if args.steps <= args.warmup or args.warmup < 1:
        p.error(f"--steps={args.steps} must exceed --warmup={args.warmup} (at least 1)")
    malloc_env = C.apply_malloc_mode(args.malloc)
    name = NAME if args.malloc == "stable" else f"{NAME}_default_malloc"
    torch.set_num_threads(1)  # the launcher does no real compute; leave the cores to the worker
    import logging

    logging.basicConfig(level=logging.WARNING)
    print(C.banner(f"virtualflow VN overhead: 1 worker vs hand-written accumulation loop "
                   f"(MLP {C.param_count() / 1e6:.2f} M params, B={args.batch}, SGD momentum)"))
    print(f"  allocator: {args.malloc} {malloc_env or '(glibc defaults)'}")
    t_start = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="vn_overhead-")

    # ---- timing: interleaved A B / B A --------------------------------------------------------
    configs = [(t, V) for t in args.threads for V in args.vns]
    raw: dict[tuple[int, int], dict] = {c: {"vf": [], "hand": [], "max_abs_weight_diff": [], "max_abs_loss_diff": []}
                                       for c in configs}
    for rep in range(args.reps):
        for k, (t, V) in enumerate(configs):
            order = ("vf", "hand") if (rep + k) % 2 == 0 else ("hand", "vf")
            save = os.path.join(tmp, f"hand-{t}-{V}.pt")
            runs = C.run_pair(
                {"vf": lambda: run_vf(V, args.batch, t, args.steps, args.warmup),
                 "hand": lambda: run_hand(V, args.batch, t, args.steps, save, args.warmup)},
                order, max_other_cores=args.max_other_load, retries=args.retries, quiet_wait_s=args.quiet_wait,
                label=f"rep {rep} threads={t} V={V}")
            runs["hand"]["state_dict"] = torch.load(save)
            a, b = runs["vf"], runs["hand"]
            raw[(t, V)]["max_abs_weight_diff"].append(C.state_max_abs_diff(a["state_dict"], b["state_dict"]))
            raw[(t, V)]["max_abs_loss_diff"].append(max(abs(x - y) for x, y in zip(a["losses"], b["losses"])))
            for r in runs.values():
                del r["state_dict"]
            raw[(t, V)]["vf"].append(a)
            raw[(t, V)]["hand"].append(b)
            ra = C.median(a["step_times"][args.warmup:]) / C.median(b["step_times"][args.warmup:])
            print(f"  rep {rep} threads={t} V={V:>2}: virtualflow {1e3 * C.median(a['step_times'][args.warmup:]):7.2f} ms, "
                  f"hand {1e3 * C.median(b['step_times'][args.warmup:]):7.2f} ms, ratio {ra:.3f}", flush=True)

    rows = []
    for (t, V) in configs:
        d = raw[(t, V)]
        vf_all = [x for r in d["vf"] for x in r["step_times"][args.warmup:]]
        hand_all = [x for r in d["hand"] for x in r["step_times"][args.warmup:]]
        vf_times, hand_times = [r["step_times"] for r in d["vf"]], [r["step_times"] for r in d["hand"]]
        per_rep = C.paired_ratios(vf_times, hand_times, args.warmup)
        per_rep_p25 = C.paired_ratios(vf_times, hand_times, args.warmup, lambda x: C.quantile(x, 0.25))
        vf_med, hand_med = C.median(vf_all), C.median(hand_all)
        ratio = C.median(per_rep)
        rows.append({
            "threads": t, "virtual_nodes": V, "micro_batch": args.batch // V,
            "vf_median_step_s": vf_med, "hand_median_step_s": hand_med,
            "time_ratio": ratio,
            "time_ratio_per_rep": per_rep,
            "pooled_time_ratio": vf_med / hand_med,
            "p25_time_ratio": C.median(per_rep_p25),
            "target_time_ratio": TARGET_RATIO, "target_met": ratio <= TARGET_RATIO,
            "vf_vmhwm_mib": C.median([r["vmhwm_mib"] for r in d["vf"]]),
            "hand_vmhwm_mib": C.median([r["vmhwm_mib"] for r in d["hand"]]),
            "mem_ratio": C.median([r["vmhwm_mib"] for r in d["vf"]]) / C.median([r["vmhwm_mib"] for r in d["hand"]]),
            "vf_reported_peak_rss_mib": C.median([r["peak_rss_mib"] for r in d["vf"]]),
            "hand_ru_maxrss_mib": C.median([r["ru_maxrss_mib"] for r in d["hand"]]),
            "vf_launcher_cpu_s_per_run": C.median([r["launcher_cpu_s"] for r in d["vf"]]),
            "vf_minor_faults_per_step": C.median([r["faults_per_step"] for r in d["vf"]]),
            "hand_minor_faults_per_step": C.median([r["faults_per_step"] for r in d["hand"]]),
            "max_abs_weight_diff": max(d["max_abs_weight_diff"]),
            "max_abs_loss_diff": max(d["max_abs_loss_diff"]),
            "raw": {"vf_step_times": [r["step_times"] for r in d["vf"]],
                    "hand_step_times": [r["step_times"] for r in d["hand"]],
                    "vf_vmhwm_mib": [r["vmhwm_mib"] for r in d["vf"]],
                    "hand_vmhwm_mib": [r["vmhwm_mib"] for r in d["hand"]],
                    "hand_vmhwm_after_setup_mib": [r["vmhwm_after_setup_mib"] for r in d["hand"]],
                    "vf_wall_s": [r["wall_s"] for r in d["vf"]],
                    "vf_other_load_cores": [r["other_load_cores"] for r in d["vf"]],
                    "hand_other_load_cores": [r["other_load_cores"] for r in d["hand"]],
                    "attempts": [r["attempt"] + 1 for r in d["vf"]]},
        })

    # ---- memory probe: peak memory must not grow with V ------------------------------------
    mem_rows = []
    if args.mem_batch:
        mem_vns = [v for v in (1, 32) if args.mem_batch % v == 0]
        for k, V in enumerate(mem_vns):
            order = ("vf", "hand") if k % 2 == 0 else ("hand", "vf")
            runs = C.run_pair(
                {"vf": lambda: run_vf(V, args.mem_batch, 1, args.mem_steps),
                 "hand": lambda: run_hand(V, args.mem_batch, 1, args.mem_steps)},
                order, max_other_cores=args.max_other_load, retries=args.retries, quiet_wait_s=args.quiet_wait,
                label=f"memory probe V={V}")
            runs["vf"].pop("state_dict")
            mem_rows.append({
                "virtual_nodes": V, "global_batch": args.mem_batch, "micro_batch": args.mem_batch // V,
                "vf_vmhwm_mib": runs["vf"]["vmhwm_mib"], "hand_vmhwm_mib": runs["hand"]["vmhwm_mib"],
                "mem_ratio": runs["vf"]["vmhwm_mib"] / runs["hand"]["vmhwm_mib"],
                "hand_vmhwm_after_setup_mib": runs["hand"]["vmhwm_after_setup_mib"],
                "vf_reported_peak_rss_mib": runs["vf"]["peak_rss_mib"],
                "hand_ru_maxrss_mib": runs["hand"]["ru_maxrss_mib"],
                "other_load_cores": max(runs["vf"]["other_load_cores"], runs["hand"]["other_load_cores"]),
            })
            print(f"  memory probe B={args.mem_batch} V={V:>2}: virtualflow VmHWM {runs['vf']['vmhwm_mib']:.1f} MiB, "
                  f"hand {runs['hand']['vmhwm_mib']:.1f} MiB", flush=True)
    mem_claim = None
    if len(mem_rows) == 2:
        lo, hi = mem_rows
        mem_claim = {
            "vf_peak_V32_minus_V1_mib": hi["vf_vmhwm_mib"] - lo["vf_vmhwm_mib"],
            "hand_peak_V32_minus_V1_mib": hi["hand_vmhwm_mib"] - lo["hand_vmhwm_mib"],
            "vf_peak_does_not_grow_with_V": hi["vf_vmhwm_mib"] <= lo["vf_vmhwm_mib"] + 1.0,
        }

    # ---- diagnostic: virtualflow and hand loop side by side (1 thread each) ----------------
    conc_rows = []
    if args.concurrent_steps > args.warmup:
        for V in args.vns:
            runs = []
            for rep in range(args.concurrent_reps):
                C.wait_for_quiet(args.quiet_wait) if args.quiet_wait > 0 else None
                runs.append(run_concurrent(V, args.batch, args.concurrent_steps, args.warmup, tmp))
            ratios = [r["time_ratio"] for r in runs]
            conc_rows.append({"threads": 1, "virtual_nodes": V, "time_ratio": C.median(ratios), "time_ratio_per_rep": ratios,
                              "vf_median_step_s": C.median([r["vf_median_step_s"] for r in runs]),
                              "hand_median_step_s": C.median([r["hand_median_step_s"] for r in runs]), "raw": runs})
            print(f"  side by side V={V:>2}: virtualflow {1e3 * conc_rows[-1]['vf_median_step_s']:7.2f} ms, hand "
                  f"{1e3 * conc_rows[-1]['hand_median_step_s']:7.2f} ms, ratios {' '.join(f'{x:.3f}' for x in ratios)}",
                  flush=True)

    # ---- diagnostic: engine and hand loop alternating step by step in one process ------------
    alt_rows = []
    if args.alt_steps > args.warmup:
        for V in args.vns:
            cfg = {"V": V, "B": args.batch, "threads": 1, "steps": args.alt_steps}
            C.wait_for_quiet(args.quiet_wait) if args.quiet_wait > 0 else None
            try:
                r = C.run_child([os.path.abspath(__file__), "--child-alternating", json.dumps(cfg)], 1)
            except Exception as exc:  # internal API: report, do not fail the benchmark
                print(f"  alternating diagnostic skipped: {str(exc)[-300:]}")
                break
            e, h = r["engine_step_times"][args.warmup:], r["hand_step_times"][args.warmup:]
            alt_rows.append({"threads": 1, "virtual_nodes": V, "engine_median_step_s": C.median(e),
                             "hand_median_step_s": C.median(h), "time_ratio": C.median(e) / C.median(h),
                             "p25_time_ratio": C.quantile(e, 0.25) / C.quantile(h, 0.25),
                             "extra_per_vn_us": 1e6 * (C.median(e) - C.median(h)) / V,
                             "bit_identical": r["bit_identical"], "raw": r})
            print(f"  alternating V={V:>2}: engine {1e3 * C.median(e):7.2f} ms, hand {1e3 * C.median(h):7.2f} ms, "
                  f"ratio {C.median(e) / C.median(h):.3f}", flush=True)

    # ---- report ----------------------------------------------------------------------------
    header = ["threads", "V", "B/V", "virtualflow ms", "hand ms", "time ratio", "per-pair ratios", "p25 ratio",
              f"<= {TARGET_RATIO}", "vf VmHWM MiB", "hand VmHWM MiB", "mem ratio", "vf reported peak MiB",
              "faults/step vf, hand"]
    table = [[r["threads"], r["virtual_nodes"], r["micro_batch"], f"{1e3 * r['vf_median_step_s']:.2f}",
              f"{1e3 * r['hand_median_step_s']:.2f}", f"{r['time_ratio']:.3f}",
              " ".join(f"{x:.3f}" for x in r["time_ratio_per_rep"]), f"{r['p25_time_ratio']:.3f}",
              "yes" if r["target_met"] else "NO",
              f"{r['vf_vmhwm_mib']:.1f}", f"{r['hand_vmhwm_mib']:.1f}", f"{r['mem_ratio']:.3f}",
              f"{r['vf_reported_peak_rss_mib']:.1f}",
              f"{r['vf_minor_faults_per_step']:.0f}, {r['hand_minor_faults_per_step']:.0f}"] for r in rows]
    mem_header = ["B", "V", "B/V", "vf VmHWM MiB", "hand VmHWM MiB", "mem ratio", "vf reported peak MiB",
                  "hand ru_maxrss MiB"]
    mem_table = [[r["global_batch"], r["virtual_nodes"], r["micro_batch"], f"{r['vf_vmhwm_mib']:.1f}",
                  f"{r['hand_vmhwm_mib']:.1f}", f"{r['mem_ratio']:.3f}", f"{r['vf_reported_peak_rss_mib']:.1f}",
                  f"{r['hand_ru_maxrss_mib']:.1f}"] for r in mem_rows]
    config = {"steps": args.steps, "warmup": args.warmup, "reps": args.reps, "threads": args.threads,
              "virtual_nodes": args.vns, "global_batch": args.batch, "quick": args.quick,
              "model": f"MLP {C.IN_FEATURES}-{C.HIDDEN}-{C.HIDDEN}-{C.HIDDEN}-{C.CLASSES} ReLU",
              "params": C.param_count(), "optimizer": "SGD lr=0.01 momentum=0.9",
              "dataset": f"synthetic {C.DATASET_SIZE}x{C.IN_FEATURES}",
              "mem_batch": args.mem_batch, "mem_steps": args.mem_steps,
              "max_other_load_cores": args.max_other_load, "retries": args.retries,
              "malloc": args.malloc, "malloc_env": malloc_env,
              "virtualflow_source": C.vf_source(),
              "timing": "per-step: end of step to end of step inside the training process. 'time ratio' = "
                        "median over interleaved pairs of (virtualflow median step / hand median step), "
                        "post-warm-up steps; 'ms' columns = medians pooled over all pairs; 'p25 ratio' = the "
                        "same paired ratio of lower-quartile step times (less sensitive to host noise)",
              "memory": "VmHWM = the process's own peak RSS (virtualflow: read by the worker after the last "
                        "step, through Job.evaluate); 'vf reported peak' = Result.peak_rss_mib (ru_maxrss up to "
                        "e402a8c, which includes the launcher's RSS inherited across exec; VmHWM at worker exit "
                        "from b277f06)"}
    payload = {"benchmark": name, "environment": C.environment(), "config": config, "results": rows,
               "alternating_diagnostic": alt_rows, "side_by_side_diagnostic": conc_rows,
               "memory_probe": mem_rows, "memory_claim": mem_claim, "target_time_ratio": TARGET_RATIO,
               "all_targets_met": all(r["target_met"] for r in rows),
               "wall_time_s": time.perf_counter() - t_start}
    print()
    print(C.text_table(header, table))
    if mem_rows:
        print()
        print(C.text_table(mem_header, mem_table))
        if mem_claim:
            print(f"  peak V=32 - V=1 at B={args.mem_batch}: virtualflow {mem_claim['vf_peak_V32_minus_V1_mib']:+.1f} MiB, "
                  f"hand {mem_claim['hand_peak_V32_minus_V1_mib']:+.1f} MiB")
    alt_header = ["V", "engine ms", "hand ms", "ratio", "p25 ratio", "extra us/VN", "bit-identical"]
    alt_table = [[r["virtual_nodes"], f"{1e3 * r['engine_median_step_s']:.2f}", f"{1e3 * r['hand_median_step_s']:.2f}",
                  f"{r['time_ratio']:.3f}", f"{r['p25_time_ratio']:.3f}", f"{r['extra_per_vn_us']:.0f}",
                  "yes" if r["bit_identical"] else "NO"] for r in alt_rows]
    conc_header = ["V", "virtualflow ms", "hand ms", "ratio", "per-rep ratios"]
    conc_table = [[r["virtual_nodes"], f"{1e3 * r['vf_median_step_s']:.2f}", f"{1e3 * r['hand_median_step_s']:.2f}",
                   f"{r['time_ratio']:.3f}", " ".join(f"{x:.3f}" for x in r["time_ratio_per_rep"])] for r in conc_rows]
    if conc_rows:
        print()
        print("  diagnostic: virtualflow (1 worker) and the hand loop side by side, 1 thread each, one per core")
        print(C.text_table(conc_header, conc_table))
    if alt_rows:
        print()
        print("  diagnostic: VNEngine.step and the hand loop alternating step by step in one process (1 thread)")
        print(C.text_table(alt_header, alt_table))
    print(f"  same computation: max |weight diff| {max(r['max_abs_weight_diff'] for r in rows):.2e}, "
          f"max |loss diff| {max(r['max_abs_loss_diff'] for r in rows):.2e}")
    md = [f"# {name}: one virtualflow worker vs a hand-written accumulation loop", "",
          C.env_markdown(), "",
          f"Workload: {config['model']} ({C.param_count() / 1e6:.2f} M params), {config['optimizer']}, "
          f"global batch {args.batch}, {args.steps} steps ({args.warmup} warm-up), {args.reps} interleaved "
          f"repetitions. Time ratio = median over interleaved pairs of virtualflow's median step time / the "
          f"hand loop's (target <= {TARGET_RATIO}); p25 ratio = the same with lower-quartile step times. "
          f"Memory = each training process's own peak RSS (VmHWM). Allocator: {args.malloc} "
          f"({malloc_env or 'glibc defaults'}, the same for both sides; see bench/_common.py).", "",
          C.md_table(header, table)]
    if mem_rows:
        md += ["", f"Memory probe (B={args.mem_batch}, 1 thread, {args.mem_steps} steps): peak memory must not "
                   f"grow with V.", "", C.md_table(mem_header, mem_table)]
        if mem_claim:
            md += ["", f"Peak V=32 minus V=1: virtualflow {mem_claim['vf_peak_V32_minus_V1_mib']:+.1f} MiB, "
                       f"hand loop {mem_claim['hand_peak_V32_minus_V1_mib']:+.1f} MiB."]
    if conc_rows:
        md += ["", f"Diagnostic (host noise cancelled, worker loop included): virtualflow (1 worker) and the hand "
                   f"loop running at the same time, 1 thread each (one per core), {args.concurrent_steps} virtualflow "
                   f"steps ({args.warmup} warm-up) against the hand-loop steps in the same time window, "
                   f"{args.concurrent_reps} repetitions. The launcher's polling is shared by both here.", "",
               C.md_table(conc_header, conc_table)]
    if alt_rows:
        md += ["", f"Diagnostic (host noise cancelled): virtualflow's `VNEngine.step` and the hand loop alternating "
                   f"step by step in one process, 1 thread, {args.alt_steps} steps each ({args.warmup} warm-up). "
                   f"This isolates the engine's own cost from worker-process effects.", "",
               C.md_table(alt_header, alt_table)]
    md += ["", "`vf reported peak` is `Result.peak_rss_mib` as virtualflow reports it, read when the worker "
               "exits (after writing the final state). Up to commit e402a8c it was ru_maxrss, which on Linux "
               "carries the launching process's RSS across exec; from b277f06 on it is the worker's own VmHWM.",
           "", f"Reproduce: `OMP_NUM_THREADS=1 .venv/bin/python bench/{NAME}.py"
               f"{' --quick' if args.quick else ''}{' --malloc default' if args.malloc == 'default' else ''}`"]
    jp, mp = C.write_results(name, payload, "\n".join(md))
    print(f"wrote {jp} and {mp} ({time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
