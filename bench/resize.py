"""What an in-place resize costs the survivors, against the restart way (torchrun-style).

Two MLPs trained with Adam on generated data (about 1 M and 25 M parameters), global batch 48 in
V = 6 virtual nodes (2 workers run 3 VNs each, 3 workers 2 each), 1 thread per worker, real
compute (no sleeps), small batches so steps are short. One job per repetition and model:

1. start 2 workers, train ``--warm`` steps;
2. **grow in place** 2 -> 3 (``JobHandle.resize(3, wait=True)``): the newcomer starts, builds the
   job and joins while the survivors keep training; at a step boundary the survivors regroup and
   the full state (weights, Adam moments, step) is broadcast to the newcomer;
3. train ``--after`` steps, then **shrink in place** 3 -> 2, train ``--after`` steps;
4. **restart way**, the way torchrun/TorchElastic changes membership: ``handle.stop()`` (the
   state at that step boundary is written), then a fresh ``vf.launch(..., resume=final.pt,
   workers=3)``: new processes import torch, rebuild the job, load the checkpoint, form a group
   and continue; then the same again back to 2 workers.

Pause (issue 3): from the step boundary where the change is applied (the ``time`` of the last
step of the old generation in ``metrics.jsonl``) to the end of the first step of the new
generation (the ``time`` of its first line), minus a normal step time: the median step time of
the old generation, measured before the change was requested (a newcomer's start-up competes
for the 2 cores). ``pause - new`` subtracts the new generation's median step instead; the
target is judged on the larger of the two. The restart way is measured the same way (last step
of the old run to the first step of the new run, minus the same normal step), and also from the
stop request. Cross-check: ``formed.pause_s`` (publish -> formed, in the coordinator) with
``group_s``, ``transfer_s`` and ``transfer_bytes``.

State-move time at loopback speed: the bytes moved (``formed.transfer_bytes``) divided by the
bandwidth of a gloo broadcast among 3 fresh processes of a buffer of that size, measured in the
same run (``--child-bcast``). Target: pause <= 0.25 s + that time, and >= 10x shorter than the
restart way.

This is a shared 2-core CPU machine: other processes' CPU use during each phase is recorded
(``other_load_cores``) and printed.

    python bench/resize.py            # full run, about 5 minutes on a quiet machine (17 under load)
    python bench/resize.py --quick    # about 2-3 minutes
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

NAME = "resize"
TARGET_FIXED_S = 0.25
TARGET_FACTOR = 10.0
GLOBAL_BATCH = 48
VIRTUAL_NODES = 6
SAMPLES = 4096

# model name -> (layer widths, the last one = classes)
MODELS = {
    "mlp-1m": (512, 1024, 512, 10),
    "mlp-25m": (1024, 4096, 4096, 1024, 10),
}


# --------------------------------------------------------------------------------------------
# The jobs (module-level: worker processes import this file).


def _mlp(widths) -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _data(widths) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, widths[0], generator=g)
    teacher = torch.randn(widths[0], widths[-1], generator=g)
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


def model_1m() -> nn.Module:
    return _mlp(MODELS["mlp-1m"])


def model_25m() -> nn.Module:
    return _mlp(MODELS["mlp-25m"])


def data_1m() -> TensorDataset:
    return _data(MODELS["mlp-1m"])


def data_25m() -> TensorDataset:
    return _data(MODELS["mlp-25m"])


def adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def _job(name: str, model, data):
    import virtualflow as vf

    return vf.Job(model=model, optimizer=adam, loss=C.cross_entropy, dataset=data, global_batch_size=GLOBAL_BATCH,
                  virtual_nodes=VIRTUAL_NODES, seed=C.SEED, name=name)


def job_1m():
    return _job("resize-mlp-1m", model_1m, data_1m)


def job_25m():
    return _job("resize-mlp-25m", model_25m, data_25m)


JOBS = {"mlp-1m": job_1m, "mlp-25m": job_25m}


def n_params(model: str) -> int:
    return sum(p.numel() for p in _mlp(MODELS[model]).parameters())


# --------------------------------------------------------------------------------------------
# Machine load. ``_common.LoadMeter`` counts our *reaped* children only: live worker processes
# would count as "other" load, and a worker reaped inside the window (a killed one, a job that
# ended) would cancel real load. Here our whole process tree is read from /proc instead.


def _tree_cpu_s() -> float:
    """CPU seconds of this process, its live descendants (from /proc) and its reaped children."""
    stats: dict[int, tuple[int, float]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [os.getpid()]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0.0))[1]
        todo += children.get(pid, [])
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return total + c.ru_utime + c.ru_stime


class TreeLoadMeter:
    """CPU cores used by processes outside our process tree while the block ran."""

    def __enter__(self) -> "TreeLoadMeter":
        self._t0, self._b0, self._o0 = time.perf_counter(), C._machine_busy_s(), _tree_cpu_s()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self._t0
        other = (C._machine_busy_s() - self._b0) - (_tree_cpu_s() - self._o0)
        self.other_cores = max(0.0, other) / wall if wall > 0 else 0.0
        self.wall_s = wall


def wait_for_quiet(max_wait_s: float, busy_cores: float = 0.15, sample_s: float = 1.0) -> tuple[float, float]:
    """Wait up to ``max_wait_s`` for other processes to use less than ``busy_cores``; returns
    (seconds waited, the other load in the last sample)."""
    t0 = time.perf_counter()
    while True:
        with TreeLoadMeter() as m:
            time.sleep(sample_s)
        waited = time.perf_counter() - t0
        if m.other_cores < busy_cores or waited >= max_wait_s:
            return waited, m.other_cores


# --------------------------------------------------------------------------------------------
# Reading a run directory.


def read_jsonl(path: str) -> list[dict]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                if line.endswith("\n"):
                    out.append(json.loads(line))
    except FileNotFoundError:
        pass
    return out


def wait_steps(handle, run_dir: str, n: int, *, generation: int | None = None, timeout_s: float = 300.0) -> list[dict]:
    """Block until ``n`` steps (of ``generation`` if given) are in metrics.jsonl; returns its lines."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
        have = [m for m in lines if generation is None or m["generation"] == generation]
        if len(have) >= n:
            return lines
        if handle.done:
            handle.wait(0)  # raises the job's error, if any
            raise RuntimeError(f"the job ended after {len(lines)} steps, before {n} steps were seen")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(have)} of {n} steps after {timeout_s} s in {run_dir}")
        time.sleep(0.05)


def pause_of(metrics: list[dict], events: list[dict], gen_old: int, gen_new: int, t_request: float) -> dict:
    """The pause of the change from ``gen_old`` to ``gen_new`` (see the module docstring)."""
    old = [m for m in metrics if m["generation"] == gen_old]
    new = [m for m in metrics if m["generation"] == gen_new]
    steady_old = [m["step_time_s"] for m in old if m["time"] <= t_request][2:]  # skip the first steps
    steady_old = steady_old or [m["step_time_s"] for m in old]
    steady_new = [m["step_time_s"] for m in new[2:]] or [m["step_time_s"] for m in new]
    gap = new[0]["time"] - old[-1]["time"]
    normal_old, normal_new = C.median(steady_old), C.median(steady_new)
    formed = next(e for e in events if e["event"] == "formed" and e["generation"] == gen_new)
    ready = [e for e in events if e["event"] == "ready" and e["time"] >= t_request]
    return {
        "gap_s": gap, "normal_step_old_s": normal_old, "normal_step_new_s": normal_new,
        "pause_s": gap - normal_old, "pause_vs_new_s": gap - normal_new,
        "pause_judged_s": gap - min(normal_old, normal_new),
        "idle_s": gap - new[0]["step_time_s"],  # the survivors step nothing: group, agreement, transfer
        "first_new_step_time_s": new[0]["step_time_s"], "boundary_step": old[-1]["step"],
        "formed_pause_s": formed["pause_s"], "group_s": formed["group_s"], "transfer_s": formed["transfer_s"],
        "transfer_bytes": formed["transfer_bytes"],
        "newcomer_startup_s": ready[0]["startup_s"] if ready else None,
        "request_to_boundary_s": old[-1]["time"] - t_request,
    }


# --------------------------------------------------------------------------------------------
# One repetition: grow and shrink in place, then the restart way both directions.


def _launch(model: str, workers: int, run_dir: str, resume: str | None = None):
    import virtualflow as vf

    return vf.launch(JOBS[model], workers=workers, steps=100_000, run_dir=run_dir, threads_per_worker=1,
                     resume=resume)


def _restart(model: str, old_handle, old_dir: str, new_dir: str, workers: int, after: int) -> tuple[object, dict]:
    """Stop ``old_handle`` and continue the job on ``workers`` fresh processes from its final state."""
    metrics_before = read_jsonl(os.path.join(old_dir, "metrics.jsonl"))
    gen = metrics_before[-1]["generation"]
    t_request = time.time()
    old_handle.stop(timeout_s=120)
    t_stopped = time.time()
    old = [m for m in read_jsonl(os.path.join(old_dir, "metrics.jsonl")) if m["generation"] == gen]
    handle = _launch(model, workers, new_dir, resume=os.path.join(old_dir, "final.pt"))
    t_launched = time.time()
    lines = wait_steps(handle, new_dir, after)
    steady_old = [m["step_time_s"] for m in old if m["time"] <= t_request][2:] or [m["step_time_s"] for m in old]
    normal_old, normal_new = C.median(steady_old), C.median([m["step_time_s"] for m in lines[2:]])
    gap = lines[0]["time"] - old[-1]["time"]
    return handle, {
        "gap_s": gap, "normal_step_old_s": normal_old, "normal_step_new_s": normal_new,
        "pause_s": gap - normal_old, "pause_vs_new_s": gap - normal_new,
        "pause_judged_s": gap - max(normal_old, normal_new),  # the restart's most favourable reading
        "from_request_s": lines[0]["time"] - t_request, "idle_s": gap - lines[0]["step_time_s"],
        "boundary_step": old[-1]["step"], "resumed_step": lines[0]["step"],
        "stop_returned_after_boundary_s": t_stopped - old[-1]["time"],
        "launch_call_s": t_launched - t_stopped,
        "launch_to_first_step_s": lines[0]["time"] - t_launched,
    }


def one_rep(model: str, warm: int, after: int, tmp: str) -> dict:
    a_dir, b_dir, c_dir = (os.path.join(tmp, x) for x in ("inplace", "restart3", "restart2"))
    for d in (a_dir, b_dir, c_dir):
        shutil.rmtree(d, ignore_errors=True)
    out: dict = {}
    handle = _launch(model, 2, a_dir)
    try:
        wait_steps(handle, a_dir, warm)
        for name, target, g_old in (("grow", 3, 0), ("shrink", 2, 1)):
            with TreeLoadMeter() as meter:
                t_request = time.time()
                handle.resize(target, wait=True, timeout_s=180)
                wait_steps(handle, a_dir, after, generation=g_old + 1)
            events = read_jsonl(os.path.join(a_dir, "events.jsonl"))
            out[name] = pause_of(read_jsonl(os.path.join(a_dir, "metrics.jsonl")), events, g_old, g_old + 1, t_request)
            out[name]["other_load_cores"] = meter.other_cores
        for name, workers, old_dir, new_dir in (("restart_grow", 3, a_dir, b_dir), ("restart_shrink", 2, b_dir, c_dir)):
            with TreeLoadMeter() as meter:
                handle, out[name] = _restart(model, handle, old_dir, new_dir, workers, after)
            out[name]["other_load_cores"] = meter.other_cores
        handle.stop(timeout_s=120)
    except BaseException:
        handle.kill()
        raise
    return out


# --------------------------------------------------------------------------------------------
# Loopback bandwidth of a gloo broadcast among 3 processes: ``resize.py --child-bcast JSON``.


def bcast_rank(cfg: dict) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", cfg["port"], is_master=False, timeout=datetime.timedelta(seconds=120))
    pg = dist.ProcessGroupGloo(dist.PrefixStore("bcast", store), cfg["rank"], cfg["world"],
                               datetime.timedelta(seconds=120))
    buf = torch.ones(cfg["bytes"] // 4, dtype=torch.float32)
    times = []
    for _ in range(cfg["reps"]):
        pg.barrier().wait()
        t0 = time.perf_counter()
        pg.broadcast(buf, 0).wait()
        pg.barrier().wait()  # everyone holds the buffer
        times.append(time.perf_counter() - t0)
    return {"rank": cfg["rank"], "times": times}


def bcast_world() -> int:
    """Processes the grow's state transfer involves: from 5bcfd66 on, ``broadcast_state`` sends
    point to point to the members that are behind (the newcomer: 2 processes); before, it was a
    broadcast to the whole new generation (3)."""
    import inspect

    from virtualflow.runtime.transfer import broadcast_state

    return 2 if "receivers" in inspect.signature(broadcast_state).parameters else 3


def measure_bcast(nbytes: int, world: int = 3, reps: int = 5) -> dict:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child-bcast",
                               json.dumps({"rank": r, "world": world, "port": store.port, "bytes": nbytes,
                                           "reps": reps})],
                              env=C.child_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        if p.returncode != 0:
            raise RuntimeError(f"broadcast rank exited {p.returncode}: {stderr[-2000:]}")
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    t = C.median(outs[0]["times"][1:])  # the first broadcast also connects
    return {"bytes": nbytes, "world": world, "median_s": t, "gb_per_s": nbytes / t / 1e9, "times": outs[0]["times"]}


# --------------------------------------------------------------------------------------------


def _fmt(x: float | None, scale: float = 1.0, digits: int = 3) -> str:
    return "-" if x is None else f"{scale * x:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one repetition per model, fewer steps")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    p.add_argument("--reps", type=int, default=3, help="fresh jobs per model")
    p.add_argument("--warm", type=int, default=30, help="steps before the first change")
    p.add_argument("--after", type=int, default=15, help="steps of each new generation before the next change")
    p.add_argument("--quiet-wait", type=float, default=15.0,
                   help="wait up to this many seconds for a quiet machine before each repetition (0: do not wait)")
    p.add_argument("--child-bcast", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_bcast:
        print(json.dumps(bcast_rank(json.loads(args.child_bcast))))
        return 0
    if args.quick:
        args.reps, args.warm, args.after = 1, 20, 10
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in MODELS:
            p.error(f"--models: unknown model {m!r}; choose from {', '.join(MODELS)}")
    import logging

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    print(C.banner(f"in-place resize vs restart (MLPs with Adam, B={GLOBAL_BATCH}, V={VIRTUAL_NODES}, "
                   f"2 -> 3 -> 2 workers, 1 thread each)"))
    print("  real compute (no sleeps): 3 workers on 2 cores run slower steps than 2; the pause subtracts a "
          "normal step")
    t_start = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="vf-resize-")
    rows, raw = [], {}
    try:
        for model in models:
            reps = []
            for rep in range(args.reps):
                waited, load0 = wait_for_quiet(args.quiet_wait) if args.quiet_wait > 0 else (0.0, float("nan"))
                r = one_rep(model, args.warm, args.after, tmp)
                r["waited_for_quiet_s"], r["other_load_before_cores"] = waited, load0
                with TreeLoadMeter() as meter:  # loopback speed now, in about the same conditions
                    r["broadcast"] = measure_bcast(r["grow"]["transfer_bytes"], world=bcast_world())
                r["broadcast"]["other_load_cores"] = meter.other_cores
                reps.append(r)
                print(f"  {model} rep {rep}: grow pause {r['grow']['pause_s']:.3f} s "
                      f"(transfer {r['grow']['transfer_s']:.3f} s, {r['grow']['transfer_bytes'] / 1e6:.0f} MB), "
                      f"shrink pause {r['shrink']['pause_s']:.3f} s; restart {r['restart_grow']['pause_s']:.2f} s "
                      f"/ {r['restart_shrink']['pause_s']:.2f} s; other load "
                      f"{max(r[k]['other_load_cores'] for k in r if isinstance(r[k], dict)):.2f} cores", flush=True)
            nbytes = int(C.median([r["grow"]["transfer_bytes"] for r in reps]))
            bw = {"bytes": nbytes, "median_s": C.median([r["broadcast"]["median_s"] for r in reps]),
                  "world": reps[0]["broadcast"]["world"]}
            bw["gb_per_s"] = nbytes / bw["median_s"] / 1e9
            print(f"  {model}: gloo broadcast of {nbytes / 1e6:.1f} MB among {reps[0]['broadcast']['world']} "
                  f"processes (median of the "
                  f"repetitions): {bw['median_s']:.3f} s ({bw['gb_per_s']:.2f} GB/s)", flush=True)
            raw[model] = {"reps": reps, "broadcast": bw}
            for kind, restart in (("grow", "restart_grow"), ("shrink", "restart_shrink")):
                pause = C.median([r[kind]["pause_s"] for r in reps])
                judged = C.median([r[kind]["pause_judged_s"] for r in reps])
                worst = max(r[kind]["pause_judged_s"] for r in reps)
                moved = C.median([r[kind]["transfer_bytes"] for r in reps])
                state_move = moved / (bw["gb_per_s"] * 1e9) if moved else 0.0
                rst = C.median([r[restart]["pause_s"] for r in reps])
                rst_req = C.median([r[restart]["from_request_s"] for r in reps])
                limit = TARGET_FIXED_S + state_move
                ratio = rst / judged if judged > 0 else float("inf")
                rows.append({
                    "model": model, "params": n_params(model), "change": kind,
                    "from_workers": 2 if kind == "grow" else 3, "to_workers": 3 if kind == "grow" else 2,
                    "pause_s": pause, "pause_vs_new_s": C.median([r[kind]["pause_vs_new_s"] for r in reps]),
                    "pause_judged_s": judged, "pause_judged_max_s": worst,
                    "pause_per_rep_s": [r[kind]["pause_judged_s"] for r in reps],
                    "idle_s": C.median([r[kind]["idle_s"] for r in reps]),
                    "idle_max_s": max(r[kind]["idle_s"] for r in reps),
                    "idle_target_met": max(r[kind]["idle_s"] for r in reps) <= limit,
                    "restart_idle_s": C.median([r[restart]["idle_s"] for r in reps]),
                    "normal_step_old_s": C.median([r[kind]["normal_step_old_s"] for r in reps]),
                    "normal_step_new_s": C.median([r[kind]["normal_step_new_s"] for r in reps]),
                    "formed_pause_s": C.median([r[kind]["formed_pause_s"] for r in reps]),
                    "group_s": C.median([r[kind]["group_s"] for r in reps]),
                    "transfer_s": C.median([r[kind]["transfer_s"] for r in reps]),
                    "transfer_bytes": moved, "state_move_loopback_s": state_move,
                    "newcomer_startup_s": C.median([r[kind]["newcomer_startup_s"] for r in reps
                                                   if r[kind]["newcomer_startup_s"] is not None]),
                    "restart_pause_s": rst, "restart_from_request_s": rst_req,
                    "restart_per_rep_s": [r[restart]["pause_s"] for r in reps],
                    "restart_launch_to_first_step_s": C.median([r[restart]["launch_to_first_step_s"] for r in reps]),
                    "target_pause_s": limit, "pause_target_met": judged <= limit,
                    "restart_ratio": ratio, "ratio_target_met": ratio >= TARGET_FACTOR,
                    "other_load_cores_max": max(max(r[kind]["other_load_cores"], r[restart]["other_load_cores"])
                                                for r in reps),
                })
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    header = ["model", "change", "normal step ms (old, new)", "pause ms", "pause ms (vs new)", "judged ms (max)",
              "idle ms (max)",
              "formed.pause_s ms", "group ms", "transfer ms (MB)", "state move @loopback ms", "target ms", "met",
              "restart s (from request)", "restart / pause", ">= 10x", "other load (cores)"]
    table = [[r["model"], f"{r['from_workers']} -> {r['to_workers']}",
              f"{1e3 * r['normal_step_old_s']:.0f}, {1e3 * r['normal_step_new_s']:.0f}",
              f"{1e3 * r['pause_s']:.0f}", f"{1e3 * r['pause_vs_new_s']:.0f}",
              f"{1e3 * r['pause_judged_s']:.0f} ({1e3 * r['pause_judged_max_s']:.0f})",
              f"{1e3 * r['idle_s']:.0f} ({1e3 * r['idle_max_s']:.0f})",
              f"{1e3 * r['formed_pause_s']:.0f}", f"{1e3 * r['group_s']:.0f}",
              f"{1e3 * r['transfer_s']:.0f} ({r['transfer_bytes'] / 1e6:.0f})",
              f"{1e3 * r['state_move_loopback_s']:.0f}", f"{1e3 * r['target_pause_s']:.0f}",
              "yes" if r["pause_target_met"] else "NO",
              f"{r['restart_pause_s']:.2f} ({r['restart_from_request_s']:.2f})", f"{r['restart_ratio']:.1f}x",
              "yes" if r["ratio_target_met"] else "NO", f"{r['other_load_cores_max']:.2f}"] for r in rows]
    all_met = all(r["pause_target_met"] and r["ratio_target_met"] for r in rows)
    config = {"models": {m: {"widths": MODELS[m], "params": n_params(m)} for m in models}, "optimizer": "Adam lr=1e-3",
              "global_batch": GLOBAL_BATCH, "virtual_nodes": VIRTUAL_NODES, "samples": SAMPLES,
              "threads_per_worker": 1, "reps": args.reps, "warm_steps": args.warm, "steps_after_change": args.after,
              "quick": args.quick,
              "pause": "gap between the metrics.jsonl time of the last old-generation step and of the first "
                       "new-generation step, minus the old generation's median step before the request "
                       "('pause'), or minus the new generation's median step ('vs new'); 'judged' = the larger "
                       "of the two (the restart's 'pause' subtracts the same normal step; its 'judged' the "
                       "smaller). Medians over repetitions.",
              "restart": "handle.stop() (final state written at a step boundary), then vf.launch(resume=final.pt, "
                         "workers=N) in the same launcher process; fresh worker processes",
              "state_move": "formed.transfer_bytes / bandwidth of a gloo broadcast of that many bytes among fresh "
                            "processes (1 thread each; 2 when the transfer goes point to point to the newcomer, "
                            "3 when it is broadcast to the whole generation), measured after each repetition "
                            "(median)", "broadcast_world": bcast_world(),
              "idle": "gap minus the first new-generation step's step_time_s (timed by the worker from the end of "
                      "formation): time without training"}
    payload = {"benchmark": NAME, "environment": C.environment(), "config": config, "results": rows, "raw": raw,
               "target": f"pause <= {TARGET_FIXED_S} s + state move at loopback speed, and restart >= "
                         f"{TARGET_FACTOR:g}x the pause", "all_targets_met": all_met,
               "wall_time_s": time.perf_counter() - t_start}
    print()
    print(C.text_table(header, table))
    print(f"  targets (pause <= {TARGET_FIXED_S} s + state move, restart >= {TARGET_FACTOR:g}x pause): "
          f"{'all met' if all_met else 'NOT all met'}")
    md = [f"# {NAME}: in-place resize vs stop-and-restart", "", C.env_markdown(), "",
          f"Workload: MLPs with Adam (lr 1e-3) on {SAMPLES} generated samples, global batch {GLOBAL_BATCH} in "
          f"{VIRTUAL_NODES} virtual nodes, 1 thread per worker, real compute. "
          + ", ".join(f"{m}: {'-'.join(map(str, MODELS[m]))} ({n_params(m) / 1e6:.2f} M params)" for m in models)
          + f". {args.reps} fresh job(s) per model; per job: {args.warm} steps on 2 workers, grow to 3 in place, "
          f"{args.after} steps, shrink to 2 in place, {args.after} steps, then the restart way to 3 and back to 2.",
          "",
          "Pause = (end of the first step of the new generation) - (end of the last step of the old one), from "
          "`metrics.jsonl`, minus a normal step: the old generation's median step before the request (`pause`) "
          "or the new generation's (`vs new`); `judged` = the larger of the two, median (max) over repetitions. "
          "Restart = the same gap when the job is stopped (`handle.stop()`, final state written) and relaunched "
          "on fresh processes with `resume=final.pt`, minus the old normal step; in brackets from the stop "
          f"request. State move @loopback = bytes moved / the bandwidth of a gloo broadcast of that size among "
          f"{bcast_world()} fresh processes (the processes the transfer involves; measured after each repetition). Target: judged pause <= {TARGET_FIXED_S} s + state move, "
          f"and restart >= {TARGET_FACTOR:g}x the judged pause. 3 workers on 2 cores run slower steps than 2. "
          "`idle` = the same gap minus the first new step's own time (the worker times it from the moment its "
          "generation has formed): the time the survivors do no training at all (rendezvous, group, state "
          "agreement and transfer), free of step-time noise; `judged` also carries the first step's deviation from "
          "a normal step, which on this shared machine is +-0.3 s for the 25 M model.",
          "", C.md_table(header, table), "",
          f"Targets: {'all met' if all_met else 'NOT all met'}. `other load` = CPU cores used by other processes "
          "on this shared machine during the change (max over repetitions).", "",
          f"Reproduce: `OMP_NUM_THREADS=1 .venv/bin/python bench/{NAME}.py{' --quick' if args.quick else ''}`"]
    jp, mp = C.write_results(NAME, payload, "\n".join(md))
    print(f"wrote {jp} and {mp} ({time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
