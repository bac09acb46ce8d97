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
    import virtualflow as vf

    return vf.Job(
        model=C.mlp,
        optimizer=C.sgd,
        loss=C.cross_entropy,
        dataset=C.bench_data,
        global_batch_size=256,
        virtual_nodes=1,
        seed=C.SEED,
        evaluate=C.memory_metrics,  # runs once, after the last step: reports the worker's VmHWM
        name=NAME,
    )


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
    times, losses = [], []
    setup_mib = C.vmhwm_mib()
    t_prev = time.perf_counter()
    for step in range(steps):
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
        t_prev = now
    if cfg.get("save"):
        torch.save(model.state_dict(), cfg["save"])
    return {"step_times": times, "losses": losses, "vmhwm_mib": C.vmhwm_mib(), "ru_maxrss_mib": C.ru_maxrss_mib(),
            "vmhwm_after_setup_mib": setup_mib}


def run_hand(V: int, B: int, threads: int, steps: int, save: str | None = None) -> dict:
    cfg = {"V": V, "B": B, "threads": threads, "steps": steps, "save": save}
    return C.run_child([os.path.abspath(__file__), "--child-hand", json.dumps(cfg)], threads)


# --------------------------------------------------------------------------------------------
# (a) virtualflow.


def run_vf(V: int, B: int, threads: int, steps: int) -> dict:
    import virtualflow as vf

    cpu0, t0 = time.process_time(), time.perf_counter()
    result = vf.train(make_job, workers=1, steps=steps, virtual_nodes=V, global_batch_size=B,
                      threads_per_worker=threads)
    return {
        "step_times": [h["step_time_s"] for h in result.history],
        "losses": [h["loss"] for h in result.history],
        "vmhwm_mib": result.metrics.get("vmhwm_mib"),
        "peak_rss_mib": result.peak_rss_mib.get(0),  # what virtualflow reports (ru_maxrss)
        "launcher_cpu_s": time.process_time() - cpu0,
        "wall_s": time.perf_counter() - t0,
        "state_dict": result.state_dict,
    }


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="short run (1 repetition, 1 thread, fewer steps)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=8, help="steps excluded from the medians")
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions of every configuration")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--vns", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--mem-batch", type=int, default=4096, help="global batch of the memory probe (0: skip)")
    p.add_argument("--mem-steps", type=int, default=3)
    p.add_argument("--child-hand", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.child_hand:
        print(json.dumps(hand_loop(json.loads(args.child_hand))))
        return 0
    if args.quick:
        args.steps, args.warmup, args.reps, args.threads, args.mem_steps = 16, 5, 1, [1], 2
    if args.steps <= args.warmup:
        p.error(f"--steps={args.steps} must exceed --warmup={args.warmup}")
    torch.set_num_threads(1)  # the launcher does no real compute; leave the cores to the worker
    import logging

    logging.basicConfig(level=logging.WARNING)
    print(C.banner(f"virtualflow VN overhead: 1 worker vs hand-written accumulation loop "
                   f"(MLP {C.param_count() / 1e6:.2f} M params, B={args.batch}, SGD momentum)"))
    t_start = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="vn_overhead-")

    # ---- timing: interleaved A B / B A --------------------------------------------------------
    configs = [(t, V) for t in args.threads for V in args.vns]
    raw: dict[tuple[int, int], dict] = {c: {"vf": [], "hand": [], "max_abs_weight_diff": [], "max_abs_loss_diff": []}
                                       for c in configs}
    for rep in range(args.reps):
        for k, (t, V) in enumerate(configs):
            order = ("vf", "hand") if (rep + k) % 2 == 0 else ("hand", "vf")
            runs = {}
            for which in order:
                if which == "vf":
                    runs["vf"] = run_vf(V, args.batch, t, args.steps)
                else:
                    save = os.path.join(tmp, f"hand-{t}-{V}.pt")
                    runs["hand"] = run_hand(V, args.batch, t, args.steps, save)
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
        per_rep = [C.median(a["step_times"][args.warmup:]) / C.median(b["step_times"][args.warmup:])
                   for a, b in zip(d["vf"], d["hand"])]
        vf_med, hand_med = C.median(vf_all), C.median(hand_all)
        rows.append({
            "threads": t, "virtual_nodes": V, "micro_batch": args.batch // V,
            "vf_median_step_s": vf_med, "hand_median_step_s": hand_med,
            "time_ratio": vf_med / hand_med,
            "time_ratio_per_rep": per_rep,
            "target_time_ratio": TARGET_RATIO, "target_met": vf_med / hand_med <= TARGET_RATIO,
            "vf_vmhwm_mib": C.median([r["vmhwm_mib"] for r in d["vf"]]),
            "hand_vmhwm_mib": C.median([r["vmhwm_mib"] for r in d["hand"]]),
            "mem_ratio": C.median([r["vmhwm_mib"] for r in d["vf"]]) / C.median([r["vmhwm_mib"] for r in d["hand"]]),
            "vf_reported_peak_rss_mib": C.median([r["peak_rss_mib"] for r in d["vf"]]),
            "hand_ru_maxrss_mib": C.median([r["ru_maxrss_mib"] for r in d["hand"]]),
            "vf_launcher_cpu_s_per_run": C.median([r["launcher_cpu_s"] for r in d["vf"]]),
            "max_abs_weight_diff": max(d["max_abs_weight_diff"]),
            "max_abs_loss_diff": max(d["max_abs_loss_diff"]),
            "raw": {"vf_step_times": [r["step_times"] for r in d["vf"]],
                    "hand_step_times": [r["step_times"] for r in d["hand"]],
                    "vf_vmhwm_mib": [r["vmhwm_mib"] for r in d["vf"]],
                    "hand_vmhwm_mib": [r["vmhwm_mib"] for r in d["hand"]],
                    "hand_vmhwm_after_setup_mib": [r["vmhwm_after_setup_mib"] for r in d["hand"]],
                    "vf_wall_s": [r["wall_s"] for r in d["vf"]]},
        })

    # ---- memory probe: peak memory must not grow with V ------------------------------------
    mem_rows = []
    if args.mem_batch:
        mem_vns = [v for v in (1, 32) if args.mem_batch % v == 0]
        for k, V in enumerate(mem_vns):
            order = ("vf", "hand") if k % 2 == 0 else ("hand", "vf")
            runs = {}
            for which in order:
                runs[which] = (run_vf(V, args.mem_batch, 1, args.mem_steps) if which == "vf"
                               else run_hand(V, args.mem_batch, 1, args.mem_steps))
            runs["vf"].pop("state_dict")
            mem_rows.append({
                "virtual_nodes": V, "global_batch": args.mem_batch, "micro_batch": args.mem_batch // V,
                "vf_vmhwm_mib": runs["vf"]["vmhwm_mib"], "hand_vmhwm_mib": runs["hand"]["vmhwm_mib"],
                "mem_ratio": runs["vf"]["vmhwm_mib"] / runs["hand"]["vmhwm_mib"],
                "hand_vmhwm_after_setup_mib": runs["hand"]["vmhwm_after_setup_mib"],
                "vf_reported_peak_rss_mib": runs["vf"]["peak_rss_mib"],
                "hand_ru_maxrss_mib": runs["hand"]["ru_maxrss_mib"],
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

    # ---- report ----------------------------------------------------------------------------
    header = ["threads", "V", "B/V", "virtualflow ms", "hand ms", "time ratio", "per-rep ratios",
              f"<= {TARGET_RATIO}", "vf VmHWM MiB", "hand VmHWM MiB", "mem ratio", "vf reported peak MiB"]
    table = [[r["threads"], r["virtual_nodes"], r["micro_batch"], f"{1e3 * r['vf_median_step_s']:.2f}",
              f"{1e3 * r['hand_median_step_s']:.2f}", f"{r['time_ratio']:.3f}",
              " ".join(f"{x:.3f}" for x in r["time_ratio_per_rep"]), "yes" if r["target_met"] else "NO",
              f"{r['vf_vmhwm_mib']:.1f}", f"{r['hand_vmhwm_mib']:.1f}", f"{r['mem_ratio']:.3f}",
              f"{r['vf_reported_peak_rss_mib']:.1f}"] for r in rows]
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
              "timing": "per-step: end of step to end of step inside the training process; "
                        "median over all post-warm-up steps of all repetitions",
              "memory": "VmHWM = the process's own peak RSS; 'vf reported peak' = Result.peak_rss_mib "
                        "(ru_maxrss, which includes the launcher's RSS inherited across exec)"}
    payload = {"benchmark": NAME, "environment": C.environment(), "config": config, "results": rows,
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
    print(f"  same computation: max |weight diff| {max(r['max_abs_weight_diff'] for r in rows):.2e}, "
          f"max |loss diff| {max(r['max_abs_loss_diff'] for r in rows):.2e}")
    md = [f"# {NAME}: one virtualflow worker vs a hand-written accumulation loop", "",
          C.env_markdown(), "",
          f"Workload: {config['model']} ({C.param_count() / 1e6:.2f} M params), {config['optimizer']}, "
          f"global batch {args.batch}, {args.steps} steps ({args.warmup} warm-up), {args.reps} interleaved "
          f"repetitions. Time ratio = virtualflow median step time / hand loop's (target <= {TARGET_RATIO}). "
          f"Memory = each training process's own peak RSS (VmHWM).", "",
          C.md_table(header, table)]
    if mem_rows:
        md += ["", f"Memory probe (B={args.mem_batch}, 1 thread, {args.mem_steps} steps): peak memory must not "
                   f"grow with V.", "", C.md_table(mem_header, mem_table)]
        if mem_claim:
            md += ["", f"Peak V=32 minus V=1: virtualflow {mem_claim['vf_peak_V32_minus_V1_mib']:+.1f} MiB, "
                       f"hand loop {mem_claim['hand_peak_V32_minus_V1_mib']:+.1f} MiB."]
    md += ["", "`vf reported peak` is `Result.peak_rss_mib` (ru_maxrss): on Linux it carries the launching "
               "process's RSS across exec, so it is not the worker's own peak.",
           "", f"Reproduce: `OMP_NUM_THREADS=1 .venv/bin/python bench/{NAME}.py{' --quick' if args.quick else ''}`"]
    jp, mp = C.write_results(NAME, payload, "\n".join(md))
    print(f"wrote {jp} and {mp} ({time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
