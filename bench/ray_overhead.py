"""What the Ray backend costs: step time on Ray actors vs local processes, and the resize pause
in place on Ray vs restarting the worker group from a checkpoint on Ray actors (Ray Train's way).

One Ray instance on this machine (``ray.init(num_cpus=4)``: 4 *logical* CPUs, so that 3 workers
of 1 CPU fit; the machine has 2 cores) stays up for the whole run, so its daemons (GCS, raylet,
agents) load the machine in the local runs as much as in the Ray runs; their idle CPU use is
measured and reported. Ray's processes are this process's descendants, but the raylet does not
reap its workers into its CPU times, so the load meter polls the process tree (``poll_s``) to
count an exited actor's CPU as ours, not as other load.

1. **Step time.** The same job (the harness's MLP, 2.63 M parameters, SGD + momentum, B = 256 in
   V = 8 virtual nodes, default mode, 1 thread per worker) on 2 workers: local processes, then 2
   Ray actors of 1 CPU each, in interleaved pairs (local/Ray, Ray/local, ...). Per run, the median
   step time after ``--warm`` steps (``Result.history``); per pair, Ray's median / local's.
   Target: median of the pairs' ratios <= 1.05 (key ``step_ratio``).
2. **Resize pause.** ``bench/resize.py``'s 1 M-parameter job (Adam, B = 48, V = 6, 1 thread), all
   on Ray actors: start 2, grow **in place** to 3 (``handle.resize(3, wait=True)``: the new actor
   starts and builds the job while the others train; the state moves at a step boundary), then
   shrink in place to 2; then **the restart way**, as Ray Train changes a worker group:
   ``handle.stop()`` (the state at that step boundary is written), every actor is gone, a new
   group of 3 (then 2) actors is created with ``resume=final.pt``: new processes import torch,
   rebuild the job, load the checkpoint, form a group and continue. Ray Train is not installed
   here (``ray[train]``); this restart does less than it would (no placement group to tear down
   and recreate, no trainer/controller actors), so it favours the restart. The pause is
   ``bench/resize.py``'s: end of the first step of the new generation minus end of the last step
   of the old one, minus a normal step (the larger reading for in place, the smaller for the
   restart). Target: restart pause / in-place pause >= 10 (key ``restart_factor``).

Real compute on 2 cores: the ratios, not the absolute times, are the result. From the
repository root::

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.ray_overhead            # about 5 min
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.ray_overhead --quick    # about 2 min
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from bench import harness as H

NAME = "ray_overhead"
TARGET_KEYS = ("step_ratio", "restart_factor")
TARGET_STEP_RATIO = 1.05
TARGET_PAUSE_FACTOR = 10.0
GLOBAL_BATCH = 256
VIRTUAL_NODES = 8
WORKERS = 2
RAY_CPUS = 4
POLL_S = 0.1  # see harness.LoadMeter: Ray actors exit without being reaped into our CPU times


def step_job():
    """The step-time workload (module level: workers import this file)."""
    import virtualflow as vf

    return vf.Job(model=H.mlp, optimizer=H.sgd, loss=H.cross_entropy, dataset=H.bench_data,
                  global_batch_size=GLOBAL_BATCH, virtual_nodes=VIRTUAL_NODES, seed=H.SEED, name="ray-overhead")


def _backend(backend: str) -> dict:
    return {"backend": "ray", "cpus_per_worker": 1} if backend == "ray" else {}


# --------------------------------------------------------------------------------------------
# 1. Step time.


def step_run(backend: str, steps: int, warm: int) -> dict:
    import virtualflow as vf

    with H.LoadMeter(poll_s=POLL_S) as meter:
        result = vf.train(step_job, workers=WORKERS, steps=warm + steps, threads_per_worker=1, **_backend(backend))
    times = [h["step_time_s"] for h in result.history[warm:]]
    return {"backend": backend, "median_step_s": H.median(times), "p25_step_s": H.p25(times),
            "p75_step_s": H.quantile(times, 0.75), "wall_s": meter.wall_s, "step_times_s": times,
            "other_load_cores": meter.other_cores}


def step_pairs(args) -> list[dict]:
    """Interleaved pairs; a pair during which other processes used more than ``--max-other-cores``
    is run again (up to ``--retries`` times, then kept and marked)."""
    out = []
    for i in range(args.pairs):
        order = H.pair_order(i, "local", "ray")
        for attempt in range(args.retries + 1):
            H.wait_for_quiet(args.quiet_wait)
            runs = {b: step_run(b, args.steps, args.warm) for b in order}
            load = max(r["other_load_cores"] for r in runs.values())
            ratio = runs["ray"]["median_step_s"] / runs["local"]["median_step_s"]
            print(f"  pair {i + 1}/{args.pairs} ({' then '.join(order)}): local "
                  f"{1e3 * runs['local']['median_step_s']:.1f} ms, Ray {1e3 * runs['ray']['median_step_s']:.1f} ms "
                  f"per step -> {ratio:.3f}x  (other load {load:.2f} cores)", flush=True)
            if load <= args.max_other_cores or attempt == args.retries:
                break
            print(f"    other processes used {load:.2f} cores (> {args.max_other_cores}): repeating the pair",
                  flush=True)
        out.append({"order": list(order), "ratio": ratio, "attempts": attempt + 1,
                    "loaded": load > args.max_other_cores, **{b: runs[b] for b in order}})
    return out


# --------------------------------------------------------------------------------------------
# 2. Resize pause on Ray: in place vs restart from a checkpoint.


def _launch(workers: int, run_dir: str, resume: str | None = None):
    import virtualflow as vf

    return vf.launch(H.RESIZE_JOBS["mlp-1m"], workers=workers, steps=100_000, run_dir=run_dir, threads_per_worker=1,
                     resume=resume, backend="ray", cpus_per_worker=1)


def resize_rep(warm: int, after: int, tmp: str) -> dict:
    dirs = [os.path.join(tmp, x) for x in ("inplace", "restart3", "restart2")]
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    out: dict = {}
    handle = _launch(2, dirs[0])
    try:
        H.wait_steps(handle, dirs[0], warm)
        for name, target, g_old in (("grow", 3, 0), ("shrink", 2, 1)):
            with H.LoadMeter(poll_s=POLL_S) as meter:
                t_request = time.time()
                handle.resize(target, wait=True, timeout_s=180)
                H.wait_steps(handle, dirs[0], after, generation=g_old + 1)
            out[name] = H.pause_of(H.run_metrics(dirs[0]), H.run_events(dirs[0]), g_old, g_old + 1, t_request)
            out[name]["other_load_cores"] = meter.other_cores
        for name, workers, old_dir, new_dir in (("restart_grow", 3, dirs[0], dirs[1]),
                                                ("restart_shrink", 2, dirs[1], dirs[2])):
            with H.LoadMeter(poll_s=POLL_S) as meter:
                handle, out[name] = H.restart_pause(handle, old_dir, new_dir, after,
                                                    lambda run_dir, resume, n=workers: _launch(n, run_dir, resume))
            out[name]["other_load_cores"] = meter.other_cores
        handle.stop(timeout_s=120)
    except BaseException:
        handle.kill()
        raise
    return out


def resize_reps(args, tmp: str) -> list[dict]:
    reps = []
    for i in range(args.reps):
        H.wait_for_quiet(args.quiet_wait)
        rep = resize_rep(args.resize_warm, args.after, tmp)
        reps.append(rep)
        print(f"  rep {i + 1}: in place grow {1e3 * rep['grow']['pause_judged_s']:.0f} ms, shrink "
              f"{1e3 * rep['shrink']['pause_judged_s']:.0f} ms; restart grow "
              f"{rep['restart_grow']['pause_judged_s']:.2f} s, shrink {rep['restart_shrink']['pause_judged_s']:.2f} s",
              flush=True)
    return reps


def ray_idle_cores(seconds: float = 3.0) -> float:
    """CPU cores the Ray daemons (our process tree, minus this process) use while nothing runs."""
    import resource

    def own() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    t0, tree0, own0 = time.perf_counter(), H.tree_cpu_s(), own()
    time.sleep(seconds)
    return ((H.tree_cpu_s() - tree0) - (own() - own0)) / (time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------
# The phases of a run.


def parse_args(argv: list[str] | None):
    p = H.parser(__doc__, reps=3, reps_help="resize repetitions (fresh jobs)", quiet_wait=15.0)
    p.add_argument("--pairs", type=int, default=6, help="interleaved local/Ray pairs for the step time")
    p.add_argument("--steps", type=int, default=40, help="measured steps per step-time run")
    p.add_argument("--warm", type=int, default=5, help="steps left out at the start of a step-time run")
    p.add_argument("--resize-warm", type=int, default=30, help="steps before the first resize")
    p.add_argument("--after", type=int, default=15, help="steps of each new generation before the next change")
    p.add_argument("--max-other-cores", type=float, default=0.3,
                   help="repeat a step-time pair during which other processes used more CPU than this")
    p.add_argument("--retries", type=int, default=2, help="repetitions of a loaded pair")
    args = p.parse_args(argv)
    if args.quick:
        args.pairs, args.steps, args.reps, args.resize_warm, args.after = 2, 30, 1, 20, 10
    return args


def pause_summary(reps: list[dict], targets: H.Targets) -> tuple[list[list], dict[str, float], bool]:
    rows, factors = [], {}
    for change, restart in (("grow", "restart_grow"), ("shrink", "restart_shrink")):
        inplace = H.median([r[change]["pause_judged_s"] for r in reps])
        rs = H.median([r[restart]["pause_judged_s"] for r in reps])
        factor = rs / inplace if inplace > 0 else float("inf")
        factors[change] = factor
        met = targets.at_least("restart_factor", f"{change} on Ray: restart pause / in-place pause", factor,
                               TARGET_PAUSE_FACTOR, "x")
        rows.append([
            "2 -> 3" if change == "grow" else "3 -> 2",
            f"{1e3 * inplace:.0f} ({1e3 * max(r[change]['pause_judged_s'] for r in reps):.0f})",
            f"{1e3 * H.median([r[change]['idle_s'] for r in reps]):.0f}",
            f"{1e3 * H.median([r[change]['transfer_s'] for r in reps]):.0f}",
            f"{H.median([r[change]['newcomer_startup_s'] or 0.0 for r in reps]):.2f}" if change == "grow" else "-",
            f"{rs:.2f} ({H.median([r[restart]['from_request_s'] for r in reps]):.2f})",
            f"{factor:.1f}x", H.yes_no(met),
            f"{max(max(r[change]['other_load_cores'], r[restart]['other_load_cores']) for r in reps):.2f}",
        ])
    return rows, factors, all(f >= targets.limit("restart_factor", TARGET_PAUSE_FACTOR) for f in factors.values())


STEP_HEADER = ["config", "local ms/step", "Ray ms/step", "Ray / local (median of pairs)", "pair range", "target",
               "met", "other load (cores)"]
PAUSE_HEADER = ["change", "in place ms (max)", "idle ms", "transfer ms", "newcomer start-up s",
                "restart s (from request)", "restart / in place", ">= 10x", "other load (cores)"]


def markdown(run: H.Run, args, ray_version: str, idle: float, pairs, reps, step_rows, pause_rows,
             step_met: bool, pause_met: bool, step_ratio: float, factors: dict) -> str:
    return "\n\n".join([
        f"# {run.name}: the Ray backend against the local backend and against a restart",
        H.env_markdown() + f"  \nRay {ray_version}, one local instance with {RAY_CPUS} logical CPUs; its daemons "
        f"used {idle:.3f} cores while idle (present during local and Ray runs alike).",
        f"**Step time.** The harness's MLP ({H.param_count() / 1e6:.2f} M params, SGD + momentum), B={GLOBAL_BATCH} "
        f"in V={VIRTUAL_NODES} virtual nodes, default mode, {WORKERS} workers of 1 thread: local processes vs Ray "
        f"actors of 1 CPU; {len(pairs)} interleaved pairs, {args.steps} measured steps each after {args.warm}; ratio "
        f"per pair = Ray's median step / local's. A pair during which other processes used more than "
        f"{args.max_other_cores} cores was run again (up to {args.retries} times); "
        f"{sum(x['loaded'] for x in pairs)} of {len(pairs)} kept pairs still ran above that.",
        H.md_table(STEP_HEADER, step_rows),
        f"**Resize pause on Ray.** `bench/resize.py`'s mlp-1m job ({H.resize_params('mlp-1m') / 1e6:.2f} M params, "
        f"Adam), B={H.RESIZE_BATCH}, V={H.RESIZE_VNS}, all workers Ray actors of 1 CPU. In place = "
        f"`handle.resize(n)`; restart = stop (state written) and a new group of Ray actors with `resume=final.pt` "
        f"(Ray Train's way; Ray Train itself is not installed here, and this restart skips its placement group "
        f"and controller actors, which favours the restart). Pause as in `bench/resize.py`: gap between the last "
        f"step of the old generation and the first of the new, minus a normal step (in place: the larger reading; "
        f"restart: the smaller). Median over {len(reps)} repetition(s).",
        H.md_table(PAUSE_HEADER, pause_rows),
        f"Targets: step time {'met' if step_met else 'NOT met'} ({step_ratio:.3f}x vs <= {TARGET_STEP_RATIO}); "
        f"pause {'met' if pause_met else 'NOT met'} "
        f"({', '.join(f'{k} {v:.1f}x' for k, v in factors.items())} vs >= {TARGET_PAUSE_FACTOR:g}x). "
        f"Real compute on 2 cores shared with Ray's daemons; `other load` = cores used by processes outside this "
        f"benchmark's process tree (max over runs).",
        f"Reproduce: `{run.command(NAME)}`",
    ])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = H.Run(NAME, args, TARGET_KEYS)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    import ray

    print(H.banner(f"Ray backend overhead (ray {ray.__version__}): step time vs local, resize pause vs restart"))
    ray.init(num_cpus=RAY_CPUS, include_dashboard=False, logging_level=logging.WARNING)
    tmp = tempfile.mkdtemp(prefix="vf-ray-overhead-")
    try:
        idle = ray_idle_cores()
        print(f"  Ray daemons idle: {idle:.3f} cores")
        print(f"step time: {WORKERS} workers, MLP {H.param_count() / 1e6:.2f} M params, B={GLOBAL_BATCH}, "
              f"V={VIRTUAL_NODES}, 1 thread each; {args.pairs} interleaved pairs of {args.steps} measured steps")
        pairs = step_pairs(args)
        print(f"resize pause on Ray: {H.resize_params('mlp-1m') / 1e6:.2f} M params with Adam, B={H.RESIZE_BATCH}, "
              f"V={H.RESIZE_VNS}; {args.reps} repetition(s)")
        reps = resize_reps(args, tmp)
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)

    ratios = [x["ratio"] for x in pairs]
    step_ratio = H.median(ratios)
    step_met = run.targets.at_most("step_ratio", f"{WORKERS} workers: Ray / local step time (median of pairs)",
                                   step_ratio, TARGET_STEP_RATIO)
    pause_rows, factors, pause_met = pause_summary(reps, run.targets)
    step_rows = [[f"{WORKERS} workers, V={VIRTUAL_NODES}",
                  f"{1e3 * H.median([x['local']['median_step_s'] for x in pairs]):.1f}",
                  f"{1e3 * H.median([x['ray']['median_step_s'] for x in pairs]):.1f}", f"{step_ratio:.3f}",
                  f"{min(ratios):.3f}-{max(ratios):.3f}", f"<= {TARGET_STEP_RATIO}", H.yes_no(step_met),
                  f"{max(max(x['local']['other_load_cores'], x['ray']['other_load_cores']) for x in pairs):.2f}"]]
    env = H.environment()
    env["ray"] = ray.__version__
    payload = {
        "benchmark": run.name, "environment": env, "args": vars(args), "ray_logical_cpus": RAY_CPUS,
        "ray_idle_cores": idle,
        "step_time": {"workers": WORKERS, "global_batch_size": GLOBAL_BATCH, "virtual_nodes": VIRTUAL_NODES,
                      "params": H.param_count(), "median_ratio": step_ratio, "ratios": ratios,
                      "target": TARGET_STEP_RATIO, "met": step_met, "pairs": pairs},
        "resize": {"params": H.resize_params("mlp-1m"), "global_batch_size": H.RESIZE_BATCH,
                   "virtual_nodes": H.RESIZE_VNS, "factors": factors, "target": TARGET_PAUSE_FACTOR,
                   "met": pause_met, "reps": reps, "ray_train_installed": False},
    }
    print()
    print(H.text_table(STEP_HEADER, step_rows))
    print()
    print(H.text_table(PAUSE_HEADER, pause_rows))
    return run.finish(payload, markdown(run, args, ray.__version__, idle, pairs, reps, step_rows, pause_rows,
                                        step_met, pause_met, step_ratio, factors))


if __name__ == "__main__":
    sys.exit(main())
