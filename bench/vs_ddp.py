"""virtualflow with 2 workers against PyTorch DistributedDataParallel doing the same accumulation.

Global batch B = 256 in V = 8 virtual nodes: each of the 2 processes runs 4 micro-batches of 32.
(a) ``virtualflow.launch(make_job, workers=2, virtual_nodes=8, threads_per_worker=1)``;
(b) DDP over gloo, 2 fresh processes (1 thread each) on a TCPStore the launcher hosts on a free
port, the way a PyTorch user accumulates::

    opt.zero_grad()
    for k in range(4):                                   # this rank's micro-batches
        ctx = ddp.no_sync() if k < 3 else nullcontext()  # all-reduce only on the last backward
        with ctx:
            (loss_fn(ddp, micro_batch_k) / 4).backward()
    opt.step()

Per-step time: median over post-warm-up steps of rank 0's step time (end of step to end of step,
inside the training process) in both; runs interleaved (A B, then B A). Target (issue):
virtualflow <= 1.00x DDP (key ``time_ratio``). Both compute the same thing: their final weights
are compared (key ``weight_diff``). Memory: each process's own peak RSS (VmHWM).

This is a 2-core CPU machine: 2 processes with 1 thread each fill it, so this is a ratio at equal
worker counts, not a scaling result. From the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.vs_ddp            # about 2.5-4 minutes
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.vs_ddp --quick    # under a minute on a quiet machine
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from bench import harness as H

NAME = "vs_ddp"
TARGET_KEYS = ("time_ratio", "weight_diff")
MODULE = "bench.vs_ddp"
TARGET_RATIO = 1.00
TARGET_WEIGHT_DIFF = 1e-5
WORKERS = 2


def make_job():
    """The job virtualflow trains (imported by the worker processes)."""
    return H.mlp_job(NAME, virtual_nodes=8)


# --------------------------------------------------------------------------------------------
# (b) DDP, one child process per rank (``-m bench.vs_ddp --child-ddp JSON``): bench/harness/ddp.py.


def alternating_rank(cfg: dict) -> dict:
    """Diagnostic: virtualflow's engine (internal API: VNEngine + BucketReducer on its own gloo group)
    and DDP alternating step by step in the same 2 processes, so host noise cancels."""
    import torch.distributed as dist

    from virtualflow.comm.groups import make_group
    from virtualflow.plan.data import DataPlan
    from virtualflow.plan.vnmap import contiguous_assignment
    from virtualflow.runtime.engine import BatchLoader, VNEngine

    rank, world, V, B, steps = cfg["rank"], cfg["world"], cfg["V"], cfg["B"], cfg["steps"]
    store = H.init_rank(cfg)
    ddp_model, ddp_step = H.ddp_stepper(rank, world, V, B)
    ds = H.bench_data()
    torch.manual_seed(H.SEED)
    model = H.mlp()
    engine = VNEngine(model, H.sgd(model.parameters()), None, H.cross_entropy, DataPlan(len(ds), B, V, H.SEED),
                      BatchLoader(ds, None), seed=H.SEED, batchnorm="mean", deterministic=False,
                      device=torch.device("cpu"))
    group = make_group(store, 0, rank, world, 120.0, torch.device("cpu"))
    engine.set_membership(group, contiguous_assignment(V, world))
    t_vf, t_ddp = [], []
    for step in range(steps):
        for which in (("vf", "ddp") if step % 2 == 0 else ("ddp", "vf")):
            t0 = time.perf_counter()
            engine.step(step, 0) if which == "vf" else ddp_step(step)
            (t_vf if which == "vf" else t_ddp).append(time.perf_counter() - t0)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), ddp_model.module.parameters()))
    max_diff = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), ddp_model.module.parameters()))
    dist.barrier()
    if group.pg is not None:
        group.pg.shutdown()
    dist.destroy_process_group()
    return {"rank": rank, "vf_step_times": t_vf, "ddp_step_times": t_ddp, "bit_identical": same,
            "max_abs_weight_diff": max_diff}


def run_ddp(V: int, B: int, steps: int, save: str | None, warmup: int, mode: str = "--child-ddp") -> list[dict]:
    return H.run_ddp(MODULE, WORKERS, V, B, steps, save, warmup, flag=mode)


# --------------------------------------------------------------------------------------------
# (a) virtualflow.


def run_vf(V: int, B: int, steps: int, warmup: int) -> dict:
    import virtualflow as vf

    os.environ["VF_BENCH_EVAL_EVERY"] = str(warmup)  # rank 0 samples its page faults at `warmup`
    cpu0, t0 = time.process_time(), time.perf_counter()
    handle = vf.launch(make_job, workers=WORKERS, steps=steps, virtual_nodes=V, global_batch_size=B,
                       threads_per_worker=1)
    pids = lambda: {w["id"]: w["pid"] for w in handle.status()["workers"]}  # noqa: E731
    with H.PeakPoller(pids, period_s=0.25) as poller:  # rank 1's VmHWM (rank 0 reports its own)
        result = handle.wait()
    evals = [e for e in result.eval_history if "minor_faults" in e]
    faults = ((evals[-1]["minor_faults"] - evals[0]["minor_faults"]) / max(1, evals[-1]["step"] - evals[0]["step"])
              if len(evals) >= 2 else float("nan"))
    return {
        "faults_per_step": faults,
        "step_times": [h["step_time_s"] for h in result.history],
        "losses": [h["loss"] for h in result.history],
        "vmhwm_mib": [result.metrics.get("vmhwm_mib"), poller.peak_mib.get(1, float("nan"))],
        "vmhwm_rank0_polled_mib": poller.peak_mib.get(0, float("nan")),
        "peak_rss_mib": [result.peak_rss_mib.get(w) for w in range(WORKERS)],
        "launcher_cpu_s": time.process_time() - cpu0,
        "wall_s": time.perf_counter() - t0,
        "state_dict": result.state_dict,
    }


# --------------------------------------------------------------------------------------------
# The phases of a run.


def parse_args(argv: list[str] | None):
    p = H.parser(__doc__, reps=10, reps_help="interleaved repetitions (pairs)", quiet_wait=120.0)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10, help="steps excluded from the medians")
    p.add_argument("--vns", type=int, default=8)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--max-other-load", type=float, default=0.10,
                   help="repeat a pair of runs when other processes used more CPU cores than this meanwhile")
    p.add_argument("--retries", type=int, default=2, help="repetitions of a disturbed pair")
    p.add_argument("--malloc", choices=["stable", "default"], default="stable",
                   help="glibc allocator settings of every training process (see bench/harness/machine.py); "
                        "'default' writes vs_ddp_default_malloc.*")
    p.add_argument("--alt-steps", type=int, default=80,
                   help="steps of the alternating diagnostic (virtualflow engine and DDP step by step in the same "
                        "2 processes; 0: skip)")
    p.add_argument("--child-ddp", help=argparse.SUPPRESS)
    p.add_argument("--child-alternating", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_ddp or args.child_alternating:
        return args
    if args.quick:
        args.steps, args.warmup, args.reps, args.alt_steps = 20, 5, 2, 30
    if args.steps <= args.warmup or args.warmup < 1:
        p.error(f"--steps={args.steps} must exceed --warmup={args.warmup} (at least 1)")
    if args.vns % WORKERS or args.batch % args.vns:
        p.error(f"--vns must be a multiple of {WORKERS} and divide --batch")
    return args


def measure_pairs(args, tmp: str) -> dict[str, list]:
    """Interleaved pairs: virtualflow (2 workers) and DDP (2 ranks)."""
    out: dict[str, list] = {"vf": [], "ddp": [], "weight_diffs": [], "ddp_load": []}
    w = args.warmup
    save = os.path.join(tmp, "ddp.pt")
    for rep in range(args.reps):
        runs = H.run_pair(
            {"vf": lambda: run_vf(args.vns, args.batch, args.steps, w),
             "ddp": lambda: {"ranks": run_ddp(args.vns, args.batch, args.steps, save, w)}},
            H.pair_order(rep, "vf", "ddp"), max_other_cores=args.max_other_load, retries=args.retries,
            quiet_wait_s=args.quiet_wait, label=f"rep {rep}")
        out["weight_diffs"].append(H.state_max_abs_diff(runs["vf"].pop("state_dict"), torch.load(save)))
        out["vf"].append(runs["vf"])
        out["ddp"].append(runs["ddp"]["ranks"])
        out["ddp_load"].append(runs["ddp"]["other_load_cores"])
        a, b = H.median(runs["vf"]["step_times"][w:]), H.median(runs["ddp"]["ranks"][0]["step_times"][w:])
        print(f"  rep {rep}: virtualflow {1e3 * a:7.2f} ms, DDP {1e3 * b:7.2f} ms, ratio {a / b:.3f}", flush=True)
    return out


def alternating_diagnostic(args) -> dict | None:
    """virtualflow's engine and DDP step by step in the same 2 processes (host noise cancels)."""
    w = args.warmup
    if args.alt_steps <= w:
        return None
    H.wait_for_quiet(args.quiet_wait)
    try:
        ranks = run_ddp(args.vns, args.batch, args.alt_steps, None, w, mode="--child-alternating")
    except Exception as exc:  # noqa: BLE001 - internal API: report, do not fail the benchmark
        print(f"  alternating diagnostic skipped: {str(exc)[-300:]}")
        return None
    a, b = ranks[0]["vf_step_times"][w:], ranks[0]["ddp_step_times"][w:]
    alt = {"vf_median_step_s": H.median(a), "ddp_median_step_s": H.median(b),
           "time_ratio": H.median(a) / H.median(b), "p25_time_ratio": H.p25(a) / H.p25(b),
           "bit_identical": all(r["bit_identical"] for r in ranks),
           "max_abs_weight_diff": max(r["max_abs_weight_diff"] for r in ranks), "raw": ranks}
    print(f"  alternating diagnostic: engine {1e3 * alt['vf_median_step_s']:.2f} ms, DDP "
          f"{1e3 * alt['ddp_median_step_s']:.2f} ms, ratio {alt['time_ratio']:.3f} "
          f"(p25 ratio {alt['p25_time_ratio']:.3f})", flush=True)
    return alt


def summarize(m: dict, args, targets: H.Targets) -> dict:
    w = args.warmup
    vf_runs, ddp_runs = m["vf"], m["ddp"]
    vf_all = [x for r in vf_runs for x in r["step_times"][w:]]
    ddp_all = [x for r in ddp_runs for x in r[0]["step_times"][w:]]
    vf_med, ddp_med = H.median(vf_all), H.median(ddp_all)
    vf_times, ddp_times = [r["step_times"] for r in vf_runs], [r[0]["step_times"] for r in ddp_runs]
    per_rep = H.paired_ratios(vf_times, ddp_times, w)
    ratio = H.median(per_rep)
    met = targets.at_most("time_ratio", f"{WORKERS} workers V={args.vns}: virtualflow / DDP step time (median of "
                                        f"pairs)", ratio, TARGET_RATIO)
    targets.at_most("weight_diff", "same computation: max |final weight difference|, virtualflow vs DDP",
                    max(m["weight_diffs"]), TARGET_WEIGHT_DIFF)
    vf_mem = [H.median([r["vmhwm_mib"][k] for r in vf_runs]) for k in range(WORKERS)]
    ddp_mem = [H.median([r[k]["vmhwm_mib"] for r in ddp_runs]) for k in range(WORKERS)]
    return {
        "workers": WORKERS, "threads_per_worker": 1, "virtual_nodes": args.vns, "global_batch": args.batch,
        "micro_batch": args.batch // args.vns,
        "vf_median_step_s": vf_med, "ddp_median_step_s": ddp_med, "time_ratio": ratio,
        "time_ratio_per_rep": per_rep, "pooled_time_ratio": vf_med / ddp_med,
        "p25_time_ratio": H.median(H.paired_ratios(vf_times, ddp_times, w, H.p25)),
        "target_time_ratio": targets.limit("time_ratio", TARGET_RATIO), "target_met": met,
        "vf_vmhwm_mib_per_rank": vf_mem, "ddp_vmhwm_mib_per_rank": ddp_mem,
        "mem_ratio_per_rank": [a / b for a, b in zip(vf_mem, ddp_mem)],
        "vf_reported_peak_rss_mib": [H.median([r["peak_rss_mib"][k] for r in vf_runs]) for k in range(WORKERS)],
        "ddp_ru_maxrss_mib": [H.median([r[k]["ru_maxrss_mib"] for r in ddp_runs]) for k in range(WORKERS)],
        "vf_launcher_cpu_s_per_run": H.median([r["launcher_cpu_s"] for r in vf_runs]),
        "vf_minor_faults_per_step_rank0": H.median([r["faults_per_step"] for r in vf_runs]),
        "ddp_minor_faults_per_step_rank0": H.median([r[0]["faults_per_step"] for r in ddp_runs]),
        "max_abs_weight_diff": max(m["weight_diffs"]),
        "raw": {"vf_step_times": vf_times,
                "ddp_step_times_rank0": ddp_times,
                "ddp_step_times_rank1": [r[1]["step_times"] for r in ddp_runs],
                "vf_vmhwm_mib": [r["vmhwm_mib"] for r in vf_runs],
                "vf_vmhwm_rank0_polled_mib": [r["vmhwm_rank0_polled_mib"] for r in vf_runs],
                "ddp_vmhwm_mib": [[x["vmhwm_mib"] for x in r] for r in ddp_runs],
                "vf_wall_s": [r["wall_s"] for r in vf_runs],
                "vf_other_load_cores": [r["other_load_cores"] for r in vf_runs],
                "ddp_other_load_cores": m["ddp_load"],
                "attempts": [r["attempt"] + 1 for r in vf_runs]},
    }


HEADER = ["workers", "V", "B/V", "virtualflow ms", "DDP ms", "time ratio", "per-pair ratios", "p25 ratio",
          f"<= {TARGET_RATIO}", "vf VmHWM MiB (r0, r1)", "DDP VmHWM MiB (r0, r1)", "mem ratio (r0, r1)",
          "vf reported peak MiB", "faults/step r0 vf, DDP"]


def table_row(row: dict) -> list:
    return [WORKERS, row["virtual_nodes"], row["micro_batch"], f"{1e3 * row['vf_median_step_s']:.2f}",
            f"{1e3 * row['ddp_median_step_s']:.2f}", f"{row['time_ratio']:.3f}",
            " ".join(f"{x:.3f}" for x in row["time_ratio_per_rep"]), f"{row['p25_time_ratio']:.3f}",
            H.yes_no(row["target_met"]),
            ", ".join(f"{x:.1f}" for x in row["vf_vmhwm_mib_per_rank"]),
            ", ".join(f"{x:.1f}" for x in row["ddp_vmhwm_mib_per_rank"]),
            ", ".join(f"{x:.3f}" for x in row["mem_ratio_per_rank"]),
            ", ".join(f"{x:.1f}" for x in row["vf_reported_peak_rss_mib"]),
            f"{row['vf_minor_faults_per_step_rank0']:.0f}, {row['ddp_minor_faults_per_step_rank0']:.0f}"]


def markdown(run: H.Run, args, row: dict, alt: dict | None, malloc_env: dict) -> str:
    w = args.warmup
    alt_text = ([f"Diagnostic (host noise cancelled): virtualflow's `VNEngine.step` (with its `BucketReducer`, own "
                 f"gloo group) and the DDP loop alternating step by step in the same 2 processes, {args.alt_steps} "
                 f"steps ({w} warm-up): engine {1e3 * alt['vf_median_step_s']:.2f} ms, DDP "
                 f"{1e3 * alt['ddp_median_step_s']:.2f} ms, ratio {alt['time_ratio']:.3f} (p25 ratio "
                 f"{alt['p25_time_ratio']:.3f}). It excludes the worker loop and the launcher.", ""] if alt else [])
    return "\n".join([
        f"# {run.name}: virtualflow ({WORKERS} workers) vs DistributedDataParallel with no_sync", "",
        H.env_markdown(), "",
        f"Workload: {H.MLP_DESCRIPTION} ({H.param_count() / 1e6:.2f} M params), SGD lr=0.01 momentum=0.9, global "
        f"batch {args.batch} in {args.vns} virtual nodes ({args.vns // WORKERS} micro-batches of "
        f"{args.batch // args.vns} per process), {WORKERS} processes x 1 thread (fills the 2 cores), "
        f"{args.steps} steps ({w} warm-up), {args.reps} interleaved repetitions. Time ratio = "
        f"median over interleaved pairs of virtualflow's median step time / DDP's (target <= {TARGET_RATIO}); "
        f"p25 ratio = the same with lower-quartile step times. Memory = each process's own peak "
        f"RSS (VmHWM). Final weights differ by at most {row['max_abs_weight_diff']:.1e}. Allocator: {args.malloc} "
        f"({malloc_env or 'glibc defaults'}, the same for both sides; see bench/harness/machine.py).", "",
        H.md_table(HEADER, [table_row(row)]), "",
        *alt_text,
        "`vf reported peak` is `Result.peak_rss_mib` as virtualflow reports it, read when the worker exits "
        "(rank 0: after writing the final state). Up to commit e402a8c it was ru_maxrss, which on Linux carries "
        "the launching process's RSS across exec; from b277f06 on it is the worker's own VmHWM.", "",
        f"Reproduce: `{run.command(NAME, ' --malloc default' if args.malloc == 'default' else '')}`"])


def run_config(args, malloc_env: dict) -> dict:
    """What was run and how it was measured (the JSON's ``config``)."""
    return {"steps": args.steps, "warmup": args.warmup, "reps": args.reps, "workers": WORKERS,
            "threads_per_worker": 1, "virtual_nodes": args.vns, "global_batch": args.batch, "quick": args.quick,
            "max_other_load_cores": args.max_other_load, "retries": args.retries,
            "malloc": args.malloc, "malloc_env": malloc_env,
            "model": H.MLP_DESCRIPTION, "params": H.param_count(), "optimizer": "SGD lr=0.01 momentum=0.9",
            "dataset": f"synthetic {H.DATASET_SIZE}x{H.IN_FEATURES}",
            "ddp": "gloo, DistributedDataParallel defaults (bucket_cap_mb=25), no_sync() on all but the last "
                   "micro-batch, 2 subprocesses on a launcher-hosted TCPStore (port 0)",
            "timing": "rank 0's per-step time, end of step to end of step inside the training process. "
                      "'time ratio' = median over interleaved pairs of (virtualflow median step / DDP median "
                      "step), post-warm-up steps; 'ms' columns = medians pooled over all pairs; 'p25 ratio' = "
                      "the same paired ratio of lower-quartile step times",
            "memory": "VmHWM = each process's own peak RSS (virtualflow rank 0: reported by the worker after "
                      "the last step; rank 1: polled from the launcher every 0.25 s); 'vf reported peak' = "
                      "Result.peak_rss_mib (ru_maxrss up to e402a8c, which includes the launcher's RSS "
                      "inherited across exec; VmHWM at worker exit from b277f06)"}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child_ddp:
        print(json.dumps(H.ddp_rank(json.loads(args.child_ddp))))
        return 0
    if args.child_alternating:
        print(json.dumps(alternating_rank(json.loads(args.child_alternating))))
        return 0
    malloc_env = H.apply_malloc_mode(args.malloc)
    run = H.Run(NAME if args.malloc == "stable" else f"{NAME}_default_malloc", args, TARGET_KEYS)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    print(H.banner(f"virtualflow ({WORKERS} workers) vs DDP ({WORKERS} processes, gloo, no_sync) "
                   f"(MLP {H.param_count() / 1e6:.2f} M params, B={args.batch}, V={args.vns}: "
                   f"{args.vns // WORKERS} micro-batches of {args.batch // args.vns} per process)"))
    print(f"  allocator: {args.malloc} {malloc_env or '(glibc defaults)'}")

    measured = measure_pairs(args, tempfile.mkdtemp(prefix="vs_ddp-"))
    alt = alternating_diagnostic(args)
    row = summarize(measured, args, run.targets)

    config = run_config(args, malloc_env)
    payload = {"benchmark": run.name, "environment": H.environment(), "config": config, "results": [row],
               "alternating_diagnostic": alt, "target_time_ratio": TARGET_RATIO}
    print()
    print(H.text_table(HEADER, [table_row(row)]))
    if alt:
        print(f"  diagnostic, VNEngine.step and DDP alternating step by step in the same 2 processes "
              f"({args.alt_steps} steps): engine {1e3 * alt['vf_median_step_s']:.2f} ms, DDP "
              f"{1e3 * alt['ddp_median_step_s']:.2f} ms, ratio {alt['time_ratio']:.3f}, p25 ratio "
              f"{alt['p25_time_ratio']:.3f}, max |weight diff| {alt['max_abs_weight_diff']:.1e}")
    print(f"  same computation: max |weight diff| virtualflow vs DDP {row['max_abs_weight_diff']:.2e}")
    return run.finish(payload, markdown(run, args, row, alt, malloc_env))


if __name__ == "__main__":
    sys.exit(main())
