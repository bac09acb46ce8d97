"""What the Ray backend costs: step time on Ray actors vs local processes, and the resize pause
in place on Ray vs restarting the worker group from a checkpoint on Ray actors (Ray Train's way).

One Ray instance on this machine (``ray.init(num_cpus=4)``: 4 *logical* CPUs, so that 3 workers
of 1 CPU fit; the machine has 2 cores) stays up for the whole run, so its daemons (GCS, raylet,
agents) load the machine in the local runs as much as in the Ray runs; their idle CPU use is
measured and reported.

1. **Step time.** The same job (``_common``'s MLP, 2.63 M parameters, SGD + momentum, B = 256 in
   V = 8 virtual nodes, default mode, 1 thread per worker) on 2 workers: local processes, then 2
   Ray actors of 1 CPU each, in interleaved pairs (local/Ray, Ray/local, ...). Per run, the median
   step time after ``--warm`` steps (``Result.history``); per pair, Ray's median / local's.
   Target: median of the pairs' ratios <= 1.05.
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
   restart). Target: restart pause / in-place pause >= 10.

Real compute on 2 cores: the ratios, not the absolute times, are the result.

    OMP_NUM_THREADS=1 .venv/bin/python bench/ray_overhead.py            # about 5 min
    OMP_NUM_THREADS=1 .venv/bin/python bench/ray_overhead.py --quick    # about 2 min
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import threading
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import resize as R  # noqa: E402  (the resize job, pause arithmetic and run-directory readers)

NAME = "ray_overhead"
TARGET_STEP_RATIO = 1.05
TARGET_PAUSE_FACTOR = 10.0
GLOBAL_BATCH = 256
VIRTUAL_NODES = 8
WORKERS = 2
RAY_CPUS = 4


def step_job():
    """The step-time workload (module level: workers import this file)."""
    import virtualflow as vf

    return vf.Job(model=C.mlp, optimizer=C.sgd, loss=C.cross_entropy, dataset=C.bench_data,
                  global_batch_size=GLOBAL_BATCH, virtual_nodes=VIRTUAL_NODES, seed=C.SEED, name="ray-overhead")


def _backend(backend: str) -> dict:
    return {"backend": "ray", "cpus_per_worker": 1} if backend == "ray" else {}


# --------------------------------------------------------------------------------------------
# Machine load. Ray's worker processes are the raylet's children, not ours: when they exit their
# CPU time reaches no rusage of ours, so ``resize.TreeLoadMeter`` would count it as other
# processes' load. This meter polls our process tree every 0.1 s and keeps the last CPU time
# seen of every process in it, exited ones included.


def _tree_cpu_by_pid() -> dict[int, float]:
    stats: dict[int, tuple[int, float]] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, [os.getpid()]
    while todo:
        pid = todo.pop()
        if pid in stats:
            out[pid] = stats[pid][1]
        todo += children.get(pid, [])
    return out


class PolledLoadMeter:
    """CPU cores used by processes outside this process tree while the block ran."""

    def __enter__(self) -> "PolledLoadMeter":
        self._base = _tree_cpu_by_pid()
        self._last = dict(self._base)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._t0, self._b0 = time.perf_counter(), C._machine_busy_s()
        self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.wait(0.1):
            self._last.update(_tree_cpu_by_pid())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._last.update(_tree_cpu_by_pid())
        wall = time.perf_counter() - self._t0
        ours = sum(v - self._base.get(pid, 0.0) for pid, v in self._last.items())
        other = (C._machine_busy_s() - self._b0) - ours
        self.other_cores = max(0.0, other) / wall if wall > 0 else 0.0


# --------------------------------------------------------------------------------------------
# 1. Step time.


def step_run(backend: str, steps: int, warm: int) -> dict:
    import virtualflow as vf

    with PolledLoadMeter() as meter:
        t0 = time.perf_counter()
        result = vf.train(step_job, workers=WORKERS, steps=warm + steps, threads_per_worker=1, **_backend(backend))
        wall = time.perf_counter() - t0
    times = [h["step_time_s"] for h in result.history[warm:]]
    return {"backend": backend, "median_step_s": C.median(times), "p25_step_s": C.quantile(times, 0.25),
            "p75_step_s": C.quantile(times, 0.75), "wall_s": wall, "step_times_s": times,
            "other_load_cores": meter.other_cores}


def step_pairs(pairs: int, steps: int, warm: int, quiet_wait_s: float, max_other_cores: float,
               retries: int) -> list[dict]:
    """Interleaved pairs; a pair during which other processes used more than ``max_other_cores``
    is run again (up to ``retries`` times, then kept and marked)."""
    out = []
    for i in range(pairs):
        order = ("local", "ray") if i % 2 == 0 else ("ray", "local")
        for attempt in range(retries + 1):
            if quiet_wait_s > 0:
                R.wait_for_quiet(quiet_wait_s)
            runs = {b: step_run(b, steps, warm) for b in order}
            load = max(r["other_load_cores"] for r in runs.values())
            ratio = runs["ray"]["median_step_s"] / runs["local"]["median_step_s"]
            print(f"  pair {i + 1}/{pairs} ({' then '.join(order)}): local {1e3 * runs['local']['median_step_s']:.1f} "
                  f"ms, Ray {1e3 * runs['ray']['median_step_s']:.1f} ms per step -> {ratio:.3f}x  "
                  f"(other load {load:.2f} cores)", flush=True)
            if load <= max_other_cores or attempt == retries:
                break
            print(f"    other processes used {load:.2f} cores (> {max_other_cores}): repeating the pair", flush=True)
        out.append({"order": list(order), "ratio": ratio, "attempts": attempt + 1, "loaded": load > max_other_cores,
                    **{b: runs[b] for b in order}})
    return out


# --------------------------------------------------------------------------------------------
# 2. Resize pause on Ray: in place vs restart from a checkpoint.


def _launch(workers: int, run_dir: str, resume: str | None = None):
    import virtualflow as vf

    return vf.launch(R.JOBS["mlp-1m"], workers=workers, steps=100_000, run_dir=run_dir, threads_per_worker=1,
                     resume=resume, backend="ray", cpus_per_worker=1)


def _restart(old_handle, old_dir: str, new_dir: str, workers: int, after: int):
    """Stop the job (state written) and continue it on a new group of ``workers`` Ray actors."""
    gen = R.read_jsonl(os.path.join(old_dir, "metrics.jsonl"))[-1]["generation"]
    t_request = time.time()
    old_handle.stop(timeout_s=120)
    t_stopped = time.time()
    old = [m for m in R.read_jsonl(os.path.join(old_dir, "metrics.jsonl")) if m["generation"] == gen]
    handle = _launch(workers, new_dir, resume=os.path.join(old_dir, "final.pt"))
    t_launched = time.time()
    lines = R.wait_steps(handle, new_dir, after)
    steady_old = [m["step_time_s"] for m in old if m["time"] <= t_request][2:] or [m["step_time_s"] for m in old]
    normal_old, normal_new = C.median(steady_old), C.median([m["step_time_s"] for m in lines[2:]])
    gap = lines[0]["time"] - old[-1]["time"]
    return handle, {
        "gap_s": gap, "normal_step_old_s": normal_old, "normal_step_new_s": normal_new,
        "pause_s": gap - normal_old, "pause_judged_s": gap - max(normal_old, normal_new),
        "from_request_s": lines[0]["time"] - t_request, "boundary_step": old[-1]["step"],
        "resumed_step": lines[0]["step"], "stop_returned_after_boundary_s": t_stopped - old[-1]["time"],
        "launch_call_s": t_launched - t_stopped, "launch_to_first_step_s": lines[0]["time"] - t_launched,
    }


def resize_rep(warm: int, after: int, tmp: str) -> dict:
    dirs = [os.path.join(tmp, x) for x in ("inplace", "restart3", "restart2")]
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    out: dict = {}
    handle = _launch(2, dirs[0])
    try:
        R.wait_steps(handle, dirs[0], warm)
        for name, target, g_old in (("grow", 3, 0), ("shrink", 2, 1)):
            with PolledLoadMeter() as meter:
                t_request = time.time()
                handle.resize(target, wait=True, timeout_s=180)
                R.wait_steps(handle, dirs[0], after, generation=g_old + 1)
            events = R.read_jsonl(os.path.join(dirs[0], "events.jsonl"))
            out[name] = R.pause_of(R.read_jsonl(os.path.join(dirs[0], "metrics.jsonl")), events, g_old, g_old + 1,
                                   t_request)
            out[name]["other_load_cores"] = meter.other_cores
        for name, workers, old_dir, new_dir in (("restart_grow", 3, dirs[0], dirs[1]),
                                                ("restart_shrink", 2, dirs[1], dirs[2])):
            with PolledLoadMeter() as meter:
                handle, out[name] = _restart(handle, old_dir, new_dir, workers, after)
            out[name]["other_load_cores"] = meter.other_cores
        handle.stop(timeout_s=120)
    except BaseException:
        handle.kill()
        raise
    return out


# --------------------------------------------------------------------------------------------


def ray_idle_cores(seconds: float = 3.0) -> float:
    """CPU cores the Ray daemons (our process tree, minus this process) use while nothing runs."""
    import resource

    def own() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    t0, tree0, own0 = time.perf_counter(), R._tree_cpu_s(), own()
    time.sleep(seconds)
    return ((R._tree_cpu_s() - tree0) - (own() - own0)) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="2 pairs, 1 resize repetition, fewer steps")
    p.add_argument("--pairs", type=int, default=6, help="interleaved local/Ray pairs for the step time")
    p.add_argument("--steps", type=int, default=40, help="measured steps per step-time run")
    p.add_argument("--warm", type=int, default=5, help="steps left out at the start of a step-time run")
    p.add_argument("--reps", type=int, default=3, help="resize repetitions (fresh jobs)")
    p.add_argument("--resize-warm", type=int, default=30, help="steps before the first resize")
    p.add_argument("--after", type=int, default=15, help="steps of each new generation before the next change")
    p.add_argument("--quiet-wait", type=float, default=15.0,
                   help="wait up to this many seconds for a quiet machine before each pair/repetition (0: do not)")
    p.add_argument("--max-other-cores", type=float, default=0.3,
                   help="repeat a step-time pair during which other processes used more CPU than this")
    p.add_argument("--retries", type=int, default=2, help="repetitions of a loaded pair")
    args = p.parse_args(argv)
    if args.quick:
        args.pairs, args.steps, args.reps, args.resize_warm, args.after = 2, 30, 1, 20, 10
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    import ray

    print(C.banner(f"Ray backend overhead (ray {ray.__version__}): step time vs local, resize pause vs restart"))
    t_start = time.perf_counter()
    ray.init(num_cpus=RAY_CPUS, include_dashboard=False, logging_level=logging.WARNING)
    tmp = tempfile.mkdtemp(prefix="vf-ray-overhead-")
    try:
        idle = ray_idle_cores()
        print(f"  Ray daemons idle: {idle:.3f} cores")
        print(f"step time: {WORKERS} workers, MLP {C.param_count() / 1e6:.2f} M params, B={GLOBAL_BATCH}, "
              f"V={VIRTUAL_NODES}, 1 thread each; {args.pairs} interleaved pairs of {args.steps} measured steps")
        pairs = step_pairs(args.pairs, args.steps, args.warm, args.quiet_wait, args.max_other_cores, args.retries)
        print(f"resize pause on Ray: {R.n_params('mlp-1m') / 1e6:.2f} M params with Adam, B={R.GLOBAL_BATCH}, "
              f"V={R.VIRTUAL_NODES}; {args.reps} repetition(s)")
        reps = []
        for i in range(args.reps):
            if args.quiet_wait > 0:
                R.wait_for_quiet(args.quiet_wait)
            rep = resize_rep(args.resize_warm, args.after, tmp)
            reps.append(rep)
            print(f"  rep {i + 1}: in place grow {1e3 * rep['grow']['pause_judged_s']:.0f} ms, shrink "
                  f"{1e3 * rep['shrink']['pause_judged_s']:.0f} ms; restart grow {rep['restart_grow']['pause_judged_s']:.2f} s, "
                  f"shrink {rep['restart_shrink']['pause_judged_s']:.2f} s", flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)

    ratios = [x["ratio"] for x in pairs]
    step_ratio = C.median(ratios)
    rows = []
    pause_rows = []
    factors = {}
    for change, restart in (("grow", "restart_grow"), ("shrink", "restart_shrink")):
        inplace = C.median([r[change]["pause_judged_s"] for r in reps])
        inplace_max = max(r[change]["pause_judged_s"] for r in reps)
        rs = C.median([r[restart]["pause_judged_s"] for r in reps])
        factor = rs / inplace if inplace > 0 else float("inf")
        factors[change] = factor
        pause_rows.append([
            "2 -> 3" if change == "grow" else "3 -> 2",
            f"{1e3 * inplace:.0f} ({1e3 * inplace_max:.0f})",
            f"{1e3 * C.median([r[change]['idle_s'] for r in reps]):.0f}",
            f"{1e3 * C.median([r[change]['transfer_s'] for r in reps]):.0f}",
            f"{C.median([r[change]['newcomer_startup_s'] or 0.0 for r in reps]):.2f}" if change == "grow" else "-",
            f"{rs:.2f} ({C.median([r[restart]['from_request_s'] for r in reps]):.2f})",
            f"{factor:.1f}x", "yes" if factor >= TARGET_PAUSE_FACTOR else "NO",
            f"{max(max(r[change]['other_load_cores'], r[restart]['other_load_cores']) for r in reps):.2f}",
        ])
    step_met = step_ratio <= TARGET_STEP_RATIO
    pause_met = all(f >= TARGET_PAUSE_FACTOR for f in factors.values())
    local_ms = C.median([x["local"]["median_step_s"] for x in pairs]) * 1e3
    ray_ms = C.median([x["ray"]["median_step_s"] for x in pairs]) * 1e3
    rows.append([f"{WORKERS} workers, V={VIRTUAL_NODES}", f"{local_ms:.1f}", f"{ray_ms:.1f}", f"{step_ratio:.3f}",
                 f"{min(ratios):.3f}-{max(ratios):.3f}", f"<= {TARGET_STEP_RATIO}", "yes" if step_met else "NO",
                 f"{max(max(x['local']['other_load_cores'], x['ray']['other_load_cores']) for x in pairs):.2f}"])

    env = C.environment()
    env["ray"] = ray.__version__
    payload = {
        "benchmark": NAME, "environment": env, "args": vars(args), "ray_logical_cpus": RAY_CPUS,
        "ray_idle_cores": idle,
        "step_time": {"workers": WORKERS, "global_batch_size": GLOBAL_BATCH, "virtual_nodes": VIRTUAL_NODES,
                      "params": C.param_count(), "median_ratio": step_ratio, "ratios": ratios,
                      "target": TARGET_STEP_RATIO, "met": step_met, "pairs": pairs},
        "resize": {"params": R.n_params("mlp-1m"), "global_batch_size": R.GLOBAL_BATCH,
                   "virtual_nodes": R.VIRTUAL_NODES, "factors": factors, "target": TARGET_PAUSE_FACTOR,
                   "met": pause_met, "reps": reps, "ray_train_installed": False},
        "wall_time_s": time.perf_counter() - t_start,
    }
    step_header = ["config", "local ms/step", "Ray ms/step", "Ray / local (median of pairs)", "pair range",
                   "target", "met", "other load (cores)"]
    pause_header = ["change", "in place ms (max)", "idle ms", "transfer ms", "newcomer start-up s",
                    "restart s (from request)", "restart / in place", ">= 10x", "other load (cores)"]
    md = "\n\n".join([
        "# ray_overhead: the Ray backend against the local backend and against a restart",
        C.env_markdown() + f"  \nRay {ray.__version__}, one local instance with {RAY_CPUS} logical CPUs; its daemons "
        f"used {idle:.3f} cores while idle (present during local and Ray runs alike).",
        f"**Step time.** `_common`'s MLP ({C.param_count() / 1e6:.2f} M params, SGD + momentum), B={GLOBAL_BATCH} in "
        f"V={VIRTUAL_NODES} virtual nodes, default mode, {WORKERS} workers of 1 thread: local processes vs Ray "
        f"actors of 1 CPU; {len(pairs)} interleaved pairs, {args.steps} measured steps each after {args.warm}; ratio "
        f"per pair = Ray's median step / local's. A pair during which other processes used more than "
        f"{args.max_other_cores} cores was run again (up to {args.retries} times); "
        f"{sum(x['loaded'] for x in pairs)} of {len(pairs)} kept pairs still ran above that.",
        C.md_table(step_header, rows),
        f"**Resize pause on Ray.** `bench/resize.py`'s mlp-1m job ({R.n_params('mlp-1m') / 1e6:.2f} M params, Adam), "
        f"B={R.GLOBAL_BATCH}, V={R.VIRTUAL_NODES}, all workers Ray actors of 1 CPU. In place = "
        f"`handle.resize(n)`; restart = stop (state written) and a new group of Ray actors with `resume=final.pt` "
        f"(Ray Train's way; Ray Train itself is not installed here, and this restart skips its placement group "
        f"and controller actors, which favours the restart). Pause as in `bench/resize.py`: gap between the last "
        f"step of the old generation and the first of the new, minus a normal step (in place: the larger reading; "
        f"restart: the smaller). Median over {len(reps)} repetition(s).",
        C.md_table(pause_header, pause_rows),
        f"Targets: step time {'met' if step_met else 'NOT met'} ({step_ratio:.3f}x vs <= {TARGET_STEP_RATIO}); "
        f"pause {'met' if pause_met else 'NOT met'} "
        f"({', '.join(f'{k} {v:.1f}x' for k, v in factors.items())} vs >= {TARGET_PAUSE_FACTOR:g}x). "
        f"Real compute on 2 cores shared with Ray's daemons; `other load` = cores used by processes outside this "
        f"benchmark's process tree (max over runs).",
        f"Reproduce: `OMP_NUM_THREADS=1 .venv/bin/python bench/ray_overhead.py{' --quick' if args.quick else ''}`",
    ])
    json_path, md_path = C.write_results(NAME, payload, md)
    print()
    print(C.text_table(step_header, rows))
    print()
    print(C.text_table(pause_header, pause_rows))
    print(f"\nwrote {json_path} and {md_path} ({time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
