"""Per-step cost of the control plane when no change is pending, on the digits example.

The same job (``examples/digits.py:make_job``: a small CNN with BatchNorm, global batch 64 in 8
virtual nodes), the same 2 workers with 1 thread each, run with the control plane on (the
default: a heartbeat thread per worker that bumps its store counter, reads the control sequence
number and checks the generation's abort flag, each beat) and off
(``launch(..., control_plane=False)``: no heartbeat thread, no control reads). Runs alternate
(on, off, then off, on, ...); per run, the median of rank 0's post-warm-up step times from
``Result.history``; the overhead is the median over pairs of (on / off) - 1. Target (issue 3):
<= 2 % of the step time, end to end (key ``overhead``) and by the direct estimate (key
``direct_overhead``).

The end-to-end ratio on a shared 2-core machine is noisy, so the control plane's cost is also
measured directly, from its behaviour:

* **heartbeats per step**: one more run with the control plane on; the launcher reads every
  worker's heartbeat counter (``vf/hb/<id>`` in the coordinator's store) after the warm-up and
  near the end, and divides the beats by the steps trained meanwhile;
* **time per heartbeat**: a fresh 1-thread process runs virtualflow's own heartbeat
  (``virtualflow.runtime.channel.Heartbeat``, watching a generation's abort flag as a worker
  does) back to back for a few seconds against a TCPStore hosted by this process, as the
  coordinator hosts it; time / beats. The same while 2 CPU-bound processes keep both cores busy.

Direct estimate = heartbeats per step x time per heartbeat / median step (control plane off),
per worker, counted as if on the step path. It covers what the heartbeat thread does, whatever
that is; a store round trip on the step path itself (rank 0 read the control number before
every step up to b5ae33f) would show only end to end. The single store operations are timed too
(``int(store.get(key))``, ``store.add(key, 1)``).

From the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.control_overhead            # about 6 minutes
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.control_overhead --quick    # about 2 minutes
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import subprocess
import sys
import time
from types import SimpleNamespace

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from bench import harness as H

NAME = "control_overhead"
TARGET_KEYS = ("overhead", "direct_overhead")
MODULE = "bench.control_overhead"
TARGET = 0.02
WORKERS = 2
JOB = H.repo_path("examples/digits.py") + ":make_job"
BUSY_LOOP = "import torch\nx = torch.randn(256, 256)\nwhile True:\n    x = torch.tanh(x @ x)\n"


def run_once(control_plane: bool, steps: int) -> dict:
    import virtualflow as vf

    t0 = time.perf_counter()
    result = vf.launch(JOB, workers=WORKERS, steps=steps, threads_per_worker=1, control_plane=control_plane).wait()
    return {"step_times": [h["step_time_s"] for h in result.history], "wall_s": time.perf_counter() - t0}


# --------------------------------------------------------------------------------------------
# Heartbeats per step, read from the coordinator's store during a run.


def _beats(handle) -> tuple[float, int, dict[int, int]]:
    from virtualflow.comm import protocol

    status = handle.status()
    store = handle.coordinator.store
    return time.time(), status["step"], {w["id"]: int(store.add(protocol.heartbeat_key(w["id"]), 0))
                                         for w in status["workers"]}


def count_heartbeats(steps: int, warmup: int, timeout_s: float = 300.0) -> dict:
    """Run the job with the control plane on; beats per worker between the end of the warm-up
    and about 10 steps before the end, per step and per second."""
    import virtualflow as vf

    handle = vf.launch(JOB, workers=WORKERS, steps=steps, threads_per_worker=1)
    marks = []
    deadline = time.monotonic() + timeout_s
    try:
        for at in (warmup, max(warmup + 1, steps - 10)):
            while handle.status()["step"] < at:
                if handle.done or time.monotonic() > deadline:
                    handle.wait(0)
                    raise RuntimeError(f"the heartbeat run ended before step {at}")
                time.sleep(0.02)
            marks.append(_beats(handle))
        handle.wait()
    except BaseException:
        handle.kill()
        raise
    (t0, s0, b0), (t1, s1, b1) = marks
    per_worker = {w: b1[w] - b0[w] for w in b1 if w in b0}
    beats = H.median(list(per_worker.values()))
    return {"steps": s1 - s0, "seconds": t1 - t0, "beats_per_worker": per_worker,
            "heartbeats_per_step": beats / max(1, s1 - s0), "heartbeat_interval_s": (t1 - t0) / max(1.0, beats)}


# --------------------------------------------------------------------------------------------
# The store operations and one heartbeat, timed from a fresh process:
# ``-m bench.control_overhead --child-store JSON``.


def store_child(cfg: dict) -> dict:
    import torch.distributed as dist

    from virtualflow.comm import protocol
    from virtualflow.runtime.channel import Heartbeat

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", cfg["port"], is_master=False, timeout=datetime.timedelta(seconds=60))
    out: dict = {}
    for op in ("get", "add"):
        times = []
        for i in range(cfg["n"] + 100):
            t0 = time.perf_counter()
            if op == "get":
                int(store.get(protocol.CONTROL_SEQ_KEY))  # a control read
            else:
                store.add("vf/bench/hb", 1)  # a heartbeat's counter
            if i >= 100:
                times.append(time.perf_counter() - t0)
        out[op] = times
    # virtualflow's own heartbeat, back to back (interval 0), watching generation 0's abort flag.
    # It reads only the store address, its interval, the fleet's size and the timeouts from the worker's configuration.
    hb_cfg = SimpleNamespace(store_host="127.0.0.1", store_port=cfg["port"], heartbeat_interval_s=0.0,
                             initial_workers=2, options=SimpleNamespace(coordinator_timeout_s=15.0,
                                                                        heartbeat_timeout_s=3.0))
    hb = Heartbeat(hb_cfg, worker_id=cfg["hb_worker"])
    hb.watch(0, rank=0)  # rank 0's beat: the counter, the control sequence, the abort flag
    t0 = time.perf_counter()
    hb.start()
    time.sleep(cfg["hb_seconds"])
    hb.stop()
    seconds = time.perf_counter() - t0
    beats = int(store.add(protocol.heartbeat_key(cfg["hb_worker"]), 0))
    out["heartbeat"] = {"beats": beats, "seconds": seconds}
    return out


def measure_store(n: int, busy: int = 0, hb_seconds: float = 3.0) -> dict:
    """Time the store operations and a heartbeat from a fresh process; with ``busy`` CPU-bound
    processes (1 thread each) running meanwhile, as the 2 workers keep both cores busy during
    training, so the store's server thread (in this process) and the client wait for a core."""
    import torch.distributed as dist

    from virtualflow.comm import protocol

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    store.set(protocol.CONTROL_SEQ_KEY, "0")
    cfg = {"port": store.port, "n": n, "hb_worker": 1000 + busy, "hb_seconds": hb_seconds}
    hogs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP], env=H.child_env(1)) for _ in range(busy)]
    try:
        if hogs:
            time.sleep(3.0)  # past their start-up
        res = H.run_child(MODULE, ["--child-store", json.dumps(cfg)], 1)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    out = {op: {"median_us": 1e6 * H.median(t), "p90_us": 1e6 * H.quantile(t, 0.9), "mean_us": 1e6 * sum(t) / len(t)}
           for op, t in res.items() if op in ("get", "add")}
    hb = res["heartbeat"]
    out["heartbeat"] = {**hb, "mean_us": 1e6 * hb["seconds"] / max(1, hb["beats"])}
    return out


# --------------------------------------------------------------------------------------------
# The phases of a run.


def parse_args(argv: list[str] | None):
    p = H.parser(__doc__, reps=16, reps_help="interleaved pairs of runs (on, off)", quiet_wait=10.0)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30, help="steps excluded from the medians")
    p.add_argument("--store-ops", type=int, default=5000, help="timed store operations of the direct measurement")
    p.add_argument("--child-store", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_store:
        return args
    if args.quick:
        args.steps, args.warmup, args.reps, args.store_ops = 150, 20, 3, 2000
    if args.steps <= args.warmup + 10 or args.warmup < 1:
        p.error(f"--steps={args.steps} must exceed --warmup={args.warmup} (at least 1) by more than 10")
    return args


def measure_pairs(args) -> list[dict]:
    w = args.warmup
    pairs = []
    for rep in range(args.reps):
        waited, load0 = H.wait_for_quiet(args.quiet_wait)
        runs = {}
        for flag in H.pair_order(rep, True, False):
            with H.LoadMeter() as meter:
                runs[flag] = run_once(flag, args.steps)
            runs[flag]["other_load_cores"] = meter.other_cores
        on, off = H.median(runs[True]["step_times"][w:]), H.median(runs[False]["step_times"][w:])
        pairs.append({"on": runs[True], "off": runs[False], "ratio": on / off, "waited_for_quiet_s": waited,
                      "other_load_before_cores": load0})
        print(f"  pair {rep}: control plane on {1e3 * on:.2f} ms, off {1e3 * off:.2f} ms, ratio {on / off:.4f}; "
              f"other load {runs[True]['other_load_cores']:.2f} / {runs[False]['other_load_cores']:.2f} cores",
              flush=True)
    return pairs


def measure_direct(args) -> dict:
    beats = count_heartbeats(args.steps, args.warmup)
    print(f"  heartbeats: {beats['heartbeats_per_step']:.3f} per step per worker (one every "
          f"{1e3 * beats['heartbeat_interval_s']:.0f} ms)", flush=True)
    store = measure_store(args.store_ops)
    print(f"  from a fresh process: control read int(store.get(key)) median {store['get']['median_us']:.1f} us "
          f"(p90 {store['get']['p90_us']:.1f}); store.add median {store['add']['median_us']:.1f} us; one heartbeat "
          f"{store['heartbeat']['mean_us']:.1f} us", flush=True)
    busy = measure_store(args.store_ops, busy=WORKERS)
    print(f"  the same with {WORKERS} CPU-bound processes keeping both cores busy: control read median "
          f"{busy['get']['median_us']:.1f} us (p90 {busy['get']['p90_us']:.1f}); store.add median "
          f"{busy['add']['median_us']:.1f} us; one heartbeat {busy['heartbeat']['mean_us']:.1f} us", flush=True)
    return {"beats": beats, "store": store, "busy": busy}


def summarize(pairs: list[dict], direct: dict, args, targets: H.Targets) -> dict:
    w = args.warmup
    per_pair = [x["ratio"] for x in pairs]
    ratio = H.median(per_pair)
    on_med = H.median([t for x in pairs for t in x["on"]["step_times"][w:]])
    off_med = H.median([t for x in pairs for t in x["off"]["step_times"][w:]])
    p25 = H.median([H.p25(x["on"]["step_times"][w:]) / H.p25(x["off"]["step_times"][w:]) for x in pairs])
    store, busy, beats = direct["store"], direct["busy"], direct["beats"]
    per_step = beats["heartbeats_per_step"]
    est = per_step * store["heartbeat"]["mean_us"] * 1e-6 / off_med
    est_busy = per_step * busy["heartbeat"]["mean_us"] * 1e-6 / off_med
    e2e_met = targets.at_most("overhead", f"end to end: control plane on / off - 1 (median of {len(pairs)} pairs)",
                              ratio - 1.0, TARGET)
    direct_met = targets.at_most("direct_overhead", "direct: heartbeats per step x time per heartbeat / step",
                                 est, TARGET)
    return {
        "workers": WORKERS, "steps": args.steps, "warmup": w, "pairs": args.reps,
        "on_median_step_s": on_med, "off_median_step_s": off_med,
        "overhead": ratio - 1.0, "ratio_per_pair": per_pair, "pooled_overhead": on_med / off_med - 1.0,
        "p25_overhead": p25 - 1.0,
        "control_read_median_us": store["get"]["median_us"], "control_read_p90_us": store["get"]["p90_us"],
        "heartbeat_add_median_us": store["add"]["median_us"],
        "heartbeat_us": store["heartbeat"]["mean_us"], "heartbeat_busy_us": busy["heartbeat"]["mean_us"],
        "heartbeats_per_step": per_step, "heartbeat_interval_s": beats["heartbeat_interval_s"],
        "direct_overhead": est, "direct_overhead_busy": est_busy,
        "control_read_busy_median_us": busy["get"]["median_us"], "control_read_busy_p90_us": busy["get"]["p90_us"],
        "control_read_busy_mean_us": busy["get"]["mean_us"],
        "target": targets.limit("overhead", TARGET), "target_met_end_to_end": e2e_met, "target_met_direct": direct_met,
        "other_load_cores_max": max(max(x["on"]["other_load_cores"], x["off"]["other_load_cores"]) for x in pairs),
        "other_load_cores_median": H.median([x[k]["other_load_cores"] for x in pairs for k in ("on", "off")]),
    }


HEADER = ["workers", "step ms on", "step ms off", "overhead (median of pairs)", "per-pair ratios", "p25 overhead",
          "heartbeats per step", "heartbeat us (busy cores)", "direct estimate (busy cores)",
          "control read us (p90)", f"<= {100 * TARGET:g} %", "other load cores (median, max)"]


def table(row: dict) -> list[list]:
    return [[WORKERS, f"{1e3 * row['on_median_step_s']:.2f}", f"{1e3 * row['off_median_step_s']:.2f}",
             f"{100 * row['overhead']:+.2f} %", " ".join(f"{x:.3f}" for x in row["ratio_per_pair"]),
             f"{100 * row['p25_overhead']:+.2f} %", f"{row['heartbeats_per_step']:.3f}",
             f"{row['heartbeat_us']:.0f} ({row['heartbeat_busy_us']:.0f})",
             f"{100 * row['direct_overhead']:.2f} % ({100 * row['direct_overhead_busy']:.2f} %)",
             f"{row['control_read_median_us']:.0f} ({row['control_read_p90_us']:.0f})",
             f"end-to-end {H.yes_no(row['target_met_end_to_end'])}, direct {H.yes_no(row['target_met_direct'])}",
             f"{row['other_load_cores_median']:.2f}, {row['other_load_cores_max']:.2f}"]]


def markdown(run: H.Run, args, row: dict) -> str:
    return "\n".join([
        f"# {run.name}: per-step control-plane cost with no change pending (digits example)", "", H.env_markdown(), "",
        f"Job: `examples/digits.py:make_job` (CNN with BatchNorm and dropout, global batch 64 in 8 virtual nodes), "
        f"{WORKERS} workers x 1 thread, {args.steps} steps ({args.warmup} warm-up), {args.reps} alternating pairs of "
        f"runs with the control plane on (default: heartbeat thread) and off (`control_plane=False`). Overhead = "
        f"median over pairs of (on / off median step) - 1; p25 = the same with lower-quartile steps. Direct "
        f"estimate = heartbeats per step and worker (read from the workers' heartbeat counters in the "
        f"coordinator's store during one more run: one every {1e3 * row['heartbeat_interval_s']:.0f} ms) x the "
        f"time of one heartbeat (virtualflow's `Heartbeat` run back to back in a fresh 1-thread process against a "
        f"TCPStore hosted by the benchmark process, watching an abort flag as a worker does) / the median step "
        f"with the control plane off, counted as if on the step path; in brackets the same while {WORKERS} "
        f"CPU-bound 1-thread processes keep both cores busy (as the workers do while training). Target: <= "
        f"{100 * TARGET:g} %.", "",
        H.md_table(HEADER, table(row)), "",
        "`other load` = CPU cores used by other processes on this shared 2-core machine during each run.", "",
        f"Reproduce: `{run.command(NAME)}`"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child_store:
        print(json.dumps(store_child(json.loads(args.child_store))), flush=True)
        # Skip interpreter teardown, as virtualflow's own workers do: the store's background
        # threads can abort the process while C++ statics are destroyed.
        os._exit(0)
    run = H.Run(NAME, args, TARGET_KEYS)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    print(H.banner(f"control-plane overhead with no change pending (digits CNN, B=64, V=8, {WORKERS} workers x "
                   f"1 thread, {args.steps} steps, {args.warmup} warm-up)"))
    pairs = measure_pairs(args)
    direct = measure_direct(args)
    row = summarize(pairs, direct, args, run.targets)
    config = {"job": JOB, "workers": WORKERS, "threads_per_worker": 1, "steps": args.steps, "warmup": args.warmup,
              "pairs": args.reps, "quick": args.quick, "store_ops": args.store_ops,
              "timing": "rank 0's step times from Result.history (checkpoint/evaluation time excluded by the worker); "
                        "overhead = median over alternating pairs of (median step on / median step off) - 1",
              "direct": "heartbeats per step and worker (counters read from the coordinator's store during one more "
                        "run) x mean time of one virtualflow Heartbeat beat run back to back in a fresh 1-thread "
                        "process / median step off"}
    payload = {"benchmark": run.name, "environment": H.environment(), "config": config, "results": [row],
               "raw": {"pairs": [{"ratio": x["ratio"], "on": x["on"], "off": x["off"],
                                  "waited_for_quiet_s": x["waited_for_quiet_s"]} for x in pairs],
                       "heartbeats": direct["beats"], "store": direct["store"], "store_busy": direct["busy"]},
               "target": f"control-plane overhead <= {100 * TARGET:g} % of step time"}
    print()
    print(H.text_table(HEADER, table(row)))
    return run.finish(payload, markdown(run, args, row))


if __name__ == "__main__":
    sys.exit(main())
