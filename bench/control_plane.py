"""The control plane at scale: the real coordinator and membership controller holding a simulated
fleet of W workers (W = 16, 64, 256 with --quick; and 1,024), measured per W.

Each W runs in a fresh coordinator (this process: its monitor thread, its TCPStore's server
thread) with the fleet in other processes (``bench/harness/fleet.py``: one client process for
the workers' protocol, ``--beaters`` processes for their heartbeat threads, each worker with
two store connections as a real one). A step is ``--step-s`` of waiting. Per W, in order:

1. start: time from ``controller.start()`` to the first generation formed;
2. steady state (``--steps`` steps): the coordinator's CPU per step and as a share of one core
   (this process's, less the threads that only drive the benchmark: its main thread's waits and
   the queues' feeder threads to the fleet's processes; the whole process's share is reported
   beside it),
   store calls and bytes per step (the coordinator's own, and the whole fleet's: the store
   server's load), step-path cost (rank 0's report push), report-to-read latency, record bytes
   per step (``events.jsonl``, ``metrics.jsonl``), ``status.json`` size, this process's RSS;
3. resize W -> W + W/8 and back, twice (the slowest of each reported): request to the new
   generation formed; the coordinator process's CPU for a grow; the workers' store calls
   for the grow (all but their heartbeats: the regroup command, next pointer, record, rendezvous,
   and the steps meanwhile) per member;
4. one death (an exit): death to the next step recorded;
5. a failure storm: 10 % of the workers exit within one second: generations published and
   formed, and first death to the next step (target: one regroup, within the heartbeat timeout
   plus 2 s);
6. a partition of 1 %: silent workers, fenced by heartbeat: time to fence them all;
7. hostile input: W sockets that connect and never speak, W unsigned reports and a few
   oversized ones, while the fleet trains: every one counted in ``report_rejected``, steps go on.

Every step the fleet applied is recorded exactly once (checked). Growth laws are fitted as
log-log slopes over the Ws run. With ``--groups``, gloo group creation is timed with real
processes for W = 2, 4, 8 (and 16 without ``--quick``): what a generation of that size pays to
form, and the store calls and bytes of gloo's rendezvous (counted; not in the fleet).

Usage:
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.control_plane --quick --plot docs/images/control_plane.png
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.control_plane --workers 1024 --groups   # the largest W alone
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing as mp
import os
import random
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

from bench.harness import report as H
from bench.harness.fleet import HEARTBEAT_INTERVAL_S, FleetSpec, start_fleet
from bench.harness.fleet_plane import ControlPlane
from virtualflow.comm import protocol

NAME = "control_plane"
TARGET_KEYS = ("cpu_share", "step_path_ms", "first_generation_s", "resize_s", "storm_regroups", "storm_s")
HEARTBEAT_TIMEOUT_S = 3.0
RESIZES = 2
"""Grow-and-shrink pairs per W; the slowest of each is reported (a planned resize waits for the
step boundary: anywhere from nothing to one step)."""


def wait_for(cond: Any, timeout_s: float, plane: ControlPlane | None = None) -> float:
    """Seconds until ``cond()`` holds (NaN after ``timeout_s``); raises what the monitor raised."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if plane is not None and plane.error is not None:
            raise plane.error
        if cond():
            return time.monotonic() - t0
        time.sleep(0.005)
    return float("nan")


def fleet_counts(plane: ControlPlane, beaters: int) -> dict[str, float]:
    """The fleet's store calls and bytes so far (client + beaters), asked for and awaited."""
    plane.launcher.stats.clear()
    plane.inbox.put(("stats",))
    if math.isnan(wait_for(lambda: plane.call(plane.launcher.poll) is not None
                           and len(plane.launcher.stats) == beaters + 1, 300)):
        raise RuntimeError(f"the fleet did not answer (stats from {sorted(plane.launcher.stats)})")
    stats = plane.launcher.stats
    return {"ops": sum(s.get("ops", 0) for s in stats.values()), "bytes": sum(s.get("bytes", 0) for s in stats.values()),
            "beats": sum(s.get("beats", 0) for s in stats.values()),
            "member_ops": stats.get("client", {}).get("member_ops", 0),
            "applied": stats.get("client", {}).get("applied", []),
            "push_s": stats.get("client", {}).get("push_s", [])}


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def thread_cpu_s(native_id: int | None) -> float:
    """CPU seconds of one of this process's threads so far (0 once it is gone)."""
    try:
        with open(f"/proc/self/task/{native_id}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def harness_cpu_s() -> float:
    """CPU seconds so far of the threads here that are the benchmark's, not the coordinator's:
    the main thread (it waits for conditions, polling every 5 ms) and the feeder threads of the
    queues to the fleet's processes."""
    ids = {threading.main_thread().native_id}
    ids.update(t.native_id for t in threading.enumerate() if t.name == "QueueFeederThread")
    return sum(thread_cpu_s(i) for i in ids)


def formed_now(plane: ControlPlane) -> bool:
    return plane.ctl.formed == plane.ctl.generation >= 0


def next_step_after(plane: ControlPlane, generation: int) -> bool:
    """A step of a generation after ``generation`` is recorded."""
    last = plane.coord.progress.last_step
    return last is not None and last["generation"] > generation


def steady(plane: ControlPlane, args: Any, run_dir: str) -> dict[str, Any]:
    """Step 2 of the module docstring: ``args.steps`` steps of a formed generation."""
    p = plane.coord.progress
    wait_for(lambda: p.step >= 3, 60, plane)
    files = {n: os.path.join(run_dir, n) for n in ("events.jsonl", "metrics.jsonl")}
    size0 = {n: os.path.getsize(f) for n, f in files.items()}
    f0, c0, s0 = fleet_counts(plane, args.beaters), dict(plane.counts), p.step
    cpu0, h0, t0 = cpu_s(), harness_cpu_s(), time.monotonic()
    k0 = len(plane.tick_s)
    wait_for(lambda: p.step >= s0 + args.steps, 60 + args.steps * args.step_s * 4, plane)
    cpu1, h1, t1, s1 = cpu_s(), harness_cpu_s(), time.monotonic(), p.step
    f1, c1 = fleet_counts(plane, args.beaters), dict(plane.counts)
    n = max(1, s1 - s0)
    lat = [v for k, v in plane.latencies.items() if s0 <= k < s1]
    coord = (cpu1 - cpu0) - (h1 - h0)
    return {"steps": n, "cpu_ms_per_step": coord / n * 1e3, "cpu_share": coord / (t1 - t0),
            "process_cpu_share": (cpu1 - cpu0) / (t1 - t0),
            "coord_ops_per_step": (c1.get("ops", 0) - c0.get("ops", 0)) / n,
            "coord_bytes_per_step": (c1.get("bytes", 0) - c0.get("bytes", 0)) / n,
            "store_ops_per_s": (f1["ops"] - f0["ops"] + c1.get("ops", 0) - c0.get("ops", 0)) / (t1 - t0),
            "store_bytes_per_step": (f1["bytes"] - f0["bytes"] + c1.get("bytes", 0) - c0.get("bytes", 0)) / n,
            "beats_per_s": (f1["beats"] - f0["beats"]) / (t1 - t0),
            "read_latency_ms_p50": H.median(lat) * 1e3, "read_latency_ms_p99": H.quantile(lat, 0.99) * 1e3,
            "events_bytes_per_step": (os.path.getsize(files["events.jsonl"]) - size0["events.jsonl"]) / n,
            "metrics_bytes_per_step": (os.path.getsize(files["metrics.jsonl"]) - size0["metrics.jsonl"]) / n,
            "status_bytes": plane.status_bytes, "rss_mib": rss_mib(),
            "generation_record_bytes": len(plane.coord.store.get(protocol.generation_key(plane.ctl.generation))),
            "step_rate": n / (t1 - t0), "monitor_cpu_share": sum(plane.tick_s[k0:]) / (t1 - t0)}


def resize(plane: ControlPlane, workers: int, timeout_s: float) -> float:
    """Request to the generation of ``workers`` members formed."""
    plane.call(plane.ctl.request_resize, workers)
    return wait_for(lambda: formed_now(plane) and len(plane.ctl.members) == workers, timeout_s, plane)


def deaths(plane: ControlPlane, victims: list[int], spread_s: float, mode: str, timeout_s: float) -> dict[str, Any]:
    """``victims`` die (``mode``: exit or silent) within ``spread_s``; returns the time from the
    first death to the next step, and the generations published and formed meanwhile."""
    g0, formed0 = plane.ctl.generation, plane.ctl.formed
    times = sorted(random.uniform(0, spread_s) for _ in victims)
    t0 = time.monotonic()
    for w, t in zip(victims, times):
        time.sleep(max(0.0, t - (time.monotonic() - t0)))
        plane.inbox.put(("die", w, mode))
    fenced = float("nan")
    if mode == "silent":
        fenced = wait_for(lambda: set(victims) <= plane.ctl.liveness.fenced, timeout_s, plane) + spread_s
    back = wait_for(lambda: next_step_after(plane, formed0) and formed_now(plane), timeout_s, plane)
    elapsed = time.monotonic() - t0 if back == back else float("nan")
    published = [g for g in range(g0 + 1, plane.ctl.generation + 1)]
    return {"victims": len(victims), "to_next_step_s": elapsed, "published": len(published), "formed0": formed0,
            "fenced_s": fenced if mode == "silent" else None}


def hostile(plane: ControlPlane, workers: int, args: Any) -> dict[str, Any]:
    """Sockets that never speak, unsigned and oversized reports, while the fleet trains."""
    rej0 = plane.coord.rejects.logged + plane.coord.rejects.suppressed
    socks = []
    for _ in range(workers):
        try:
            socks.append(socket.create_connection(("127.0.0.1", plane.coord.port), timeout=5))
        except OSError:
            break
    store = plane.coord.store
    bad = 0
    for i in range(workers):
        store.queue_push(protocol.REPORTS_QUEUE, f"not signed {i}")
        bad += 1
    big = "x" * (protocol.MAX_REPORT_BYTES + 1)
    for _ in range(4):
        store.queue_push(protocol.REPORTS_QUEUE, big)
        bad += 1
    s0, t0 = plane.coord.progress.step, time.monotonic()
    wait_for(lambda: plane.coord.progress.step >= s0 + args.steps // 2, 60, plane)
    rate = (plane.coord.progress.step - s0) / (time.monotonic() - t0)
    for s in socks:
        s.close()
    rejected = plane.coord.rejects.logged + plane.coord.rejects.suppressed - rej0
    return {"silent_sockets": len(socks), "bad_reports": bad, "rejected": rejected, "step_rate": rate}


def measure(workers: int, args: Any) -> dict[str, Any]:
    """Every measurement of the module docstring for one fleet of ``workers``."""
    ctx = mp.get_context("spawn")
    run_dir = tempfile.mkdtemp(prefix=f"vf-cp-{workers}-")
    rss0 = rss_mib()
    plane = ControlPlane(workers, ctx.Queue(), ctx.Queue(), run_dir=run_dir, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    spec = FleetSpec(step_s=args.step_s, beaters=args.beaters, heartbeat_interval_s=args.heartbeat_interval_s,
                     **plane.spec_fields)
    procs, _boxes = start_fleet(spec, plane.inbox, plane.outbox, ctx)
    out: dict[str, Any] = {"workers": workers}
    try:
        fleet_counts(plane, args.beaters)  # the fleet's processes are up
        t0 = time.monotonic()
        plane.start()
        out["first_generation_s"] = wait_for(lambda: formed_now(plane), 120, plane)
        out["start_to_first_generation_s"] = time.monotonic() - t0
        out.update(steady(plane, args, run_dir))
        out["rss_growth_mib"] = out["rss_mib"] - rss0
        grows, shrinks = [], []
        for _ in range(RESIZES):
            before, cpu0 = fleet_counts(plane, args.beaters)["member_ops"], cpu_s()
            grows.append(resize(plane, workers + max(1, workers // 8), 60))
            # the coordinator's CPU (monitor and store threads) for the grow: the control plane's own part of it
            out["grow_cpu_s"] = max(out.get("grow_cpu_s", 0.0), cpu_s() - cpu0)
            # every store call the workers made for the grow but their heartbeats, per member of the new generation
            grown = fleet_counts(plane, args.beaters)["member_ops"] - before
            out["grow_calls_per_member"] = grown / len(plane.ctl.members)
            shrinks.append(resize(plane, workers, 60))
        out["grow_s"], out["shrink_s"] = max(grows), max(shrinks)  # the worst: a resize waits for a step boundary
        members = list(plane.ctl.members)
        one = deaths(plane, random.sample(members[1:], 1), 0.0, "exit", 60)
        out["death_to_step_s"] = one["to_next_step_s"]
        members = list(plane.ctl.members)
        storm = deaths(plane, random.sample(members[1:], max(1, len(members) // 10)), 1.0, "exit", 60)
        storm["formed"] = plane.ctl.formed - storm.pop("formed0")
        out.update({f"storm_{k}": v for k, v in storm.items()})
        members = list(plane.ctl.members)
        part = deaths(plane, random.sample(members[1:], max(1, len(members) // 100)), 0.0, "silent", 60)
        out["partition_fence_s"], out["partition_to_step_s"] = part["fenced_s"], part["to_next_step_s"]
        out.update({f"hostile_{k}": v for k, v in hostile(plane, workers, args).items()})
        recorded = [h["step"] for h in plane.coord.history]  # before the fleet's list: it has them all
        final = fleet_counts(plane, args.beaters)
        applied = final["applied"]
        out["steps_applied"], out["steps_recorded"] = len(applied), len(recorded)
        # the last applied steps may still be on their way to the coordinator (a step or two)
        out["steps_exactly_once"] = recorded == applied[:len(recorded)] and len(applied) - len(recorded) <= 2
        out["step_path_ms_p99"] = H.quantile(final["push_s"], 0.99) * 1e3
    finally:
        plane.inbox.put(("stop",))
        plane.stop()
        for proc in procs:
            proc.join(timeout=20)
            if proc.is_alive():
                proc.kill()
        shutil.rmtree(run_dir, ignore_errors=True)
    return out


def slope(ws: list[int], ys: list[float]) -> float:
    """The log-log least-squares slope of ``ys`` against ``ws`` (the exponent of the growth law)."""
    pts = [(math.log(w), math.log(y)) for w, y in zip(ws, ys) if y and y > 0 and y == y]
    if len(pts) < 2:
        return float("nan")
    mx, my = statistics.fmean(p[0] for p in pts), statistics.fmean(p[1] for p in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


LAWS = ("cpu_ms_per_step", "grow_calls_per_member", "store_ops_per_s", "store_bytes_per_step", "coord_ops_per_step",
        "events_bytes_per_step", "metrics_bytes_per_step", "status_bytes", "generation_record_bytes",
        "first_generation_s", "grow_s", "storm_to_next_step_s")


# -- group formation with real processes ----------------------------------------------------------
def counting_store(inner: Any) -> Any:
    """``inner`` behind a Python ``dist.Store`` that counts the calls gloo's rendezvous makes and
    the bytes of the values it reads and writes (``.calls``, ``.bytes``)."""
    import torch.distributed as dist

    class CountingStore(dist.Store):
        def __init__(self) -> None:
            super().__init__()
            self.calls, self.bytes = 0, 0

        def set(self, key: str, value: Any) -> None:
            self.calls, self.bytes = self.calls + 1, self.bytes + len(value)
            inner.set(key, value)

        def get(self, key: str) -> bytes:
            value = inner.get(key)
            self.calls, self.bytes = self.calls + 1, self.bytes + len(value)
            return value

        def add(self, key: str, n: int) -> int:
            self.calls += 1
            return inner.add(key, n)

        def wait(self, keys: list[str], *timeout: Any) -> None:
            self.calls += 1
            inner.wait(keys, *timeout)

        def check(self, keys: list[str]) -> bool:
            self.calls += 1
            return inner.check(keys)

    return CountingStore()


def group_rank(port: int, rank: int, world: int, out: Any) -> None:
    """One process of :func:`group_formation`: wait for the start, form a gloo group of ``world``
    on the store, all-reduce once, and send back when it was done (wall clock) and the store
    calls and bytes its rendezvous took."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    store.add("ready", 1)
    store.wait(["go"])
    counted = counting_store(dist.PrefixStore("gen/0", store))
    dist.init_process_group("gloo", store=counted, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    dist.all_reduce(torch.ones(1))
    out.put((rank, time.time(), counted.calls, counted.bytes))
    dist.destroy_process_group()


def group_formation(worlds: list[int]) -> dict[int, dict[str, float]]:
    """Per W: seconds from the start signal to the last rank done (group formed, one all-reduce),
    and the store calls and bytes of all ranks together."""
    import datetime

    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    out: dict[int, dict[str, float]] = {}
    for world in worlds:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=120))
        q = ctx.Queue()
        procs = [ctx.Process(target=group_rank, args=(store.port, r, world, q), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        while store.add("ready", 0) < world:
            time.sleep(0.01)
        time.sleep(0.2)
        t0 = time.time()
        store.set("go", "1")
        done = [q.get(timeout=120) for _ in range(world)]
        out[world] = {"s": max(d[1] for d in done) - t0, "store_calls": sum(d[2] for d in done),
                      "store_bytes": sum(d[3] for d in done)}
        for p in procs:
            p.join(timeout=30)
    return out


# -- the report ---------------------------------------------------------------------------------
HEADER = ["W", "first gen s", "CPU ms/step", "CPU share", "process share", "monitor share", "store ops/s", "store KB/step", "coord ops/step",
          "push p99 ms", "read p50 ms", "events B/step", "metrics B/step", "status KB", "grow s", "grow CPU s", "grow calls/member", "shrink s",
          "death->step s", "storm gens (formed)", "storm s", "fence 1% s", "rejected", "exactly once"]


def row(r: dict[str, Any]) -> list[str]:
    return [str(r["workers"]), H.num(r["first_generation_s"], ".2f"), H.num(r["cpu_ms_per_step"], ".1f"),
            H.num(r["cpu_share"], ".3f"), H.num(r.get("process_cpu_share"), ".3f"), H.num(r["monitor_cpu_share"], ".3f"), H.num(r["store_ops_per_s"], ".0f"), H.num(r["store_bytes_per_step"] / 1e3, ".1f"),
            H.num(r["coord_ops_per_step"], ".0f"), H.num(r["step_path_ms_p99"], ".2f"),
            H.num(r["read_latency_ms_p50"], ".1f"), H.num(r["events_bytes_per_step"], ".0f"),
            H.num(r["metrics_bytes_per_step"], ".0f"), H.num(r["status_bytes"] / 1e3, ".1f"), H.num(r["grow_s"], ".2f"),
            H.num(r["grow_cpu_s"], ".2f"), H.num(r["grow_calls_per_member"], ".1f"), H.num(r["shrink_s"], ".2f"), H.num(r["death_to_step_s"], ".2f"), f"{r['storm_published']} ({r['storm_formed']})",
            H.num(r["storm_to_next_step_s"], ".2f"), H.num(r["partition_fence_s"], ".2f"),
            f"{r['hostile_rejected']}/{r['hostile_bad_reports']}", H.yes_no(r["steps_exactly_once"])]


def check_targets(t: H.Targets, rows: list[dict[str, Any]], laws: dict[str, float], step_s: float) -> None:
    big = rows[-1]
    W = big["workers"]
    t.at_most("cpu_share", f"W={W}: coordinator CPU at steady state ({step_s:g} s steps), share of one core",
              big["cpu_share"], 0.05)
    t.at_most("step_path_ms", f"W={W}: control cost on the step path (rank 0's report push, p99), ms",
              big["step_path_ms_p99"], 20.0, " ms")
    for r in rows:
        w = r["workers"]
        t.at_most("first_generation_s", f"W={w}: first generation formed (s)", r["first_generation_s"], 5.0, " s")
        t.at_most("resize_s", f"W={w}: resize W -> W + W/8 (s)", r["grow_s"], 2.0, " s")
        t.at_most("resize_s", f"W={w}: resize back to W (s)", r["shrink_s"], 2.0, " s")
        t.at_most("storm_regroups", f"W={w}: generations published for a storm of {r['storm_victims']} deaths in 1 s",
                  r["storm_published"], 1)
        t.at_most("storm_s", f"W={w}: storm, first death to the next step (s)", r["storm_to_next_step_s"],
                  HEARTBEAT_TIMEOUT_S + 2.0 + 1.0, " s (heartbeat timeout + 2 s, + the 1 s the storm lasts)")
        t.holds(f"W={w}: every applied step recorded exactly once", r["steps_exactly_once"],
                f"{r['steps_recorded']} recorded of {r['steps_applied']} applied")
        t.holds(f"W={w}: every hostile report counted in report_rejected",
                r["hostile_rejected"] >= r["hostile_bad_reports"],
                f"{r['hostile_rejected']} of {r['hostile_bad_reports']}; steps went on at "
                f"{r['hostile_step_rate']:.2f}/s (steady {r['step_rate']:.2f}/s)")
        t.holds(f"W={w}: steps go on under hostile input (>= 80 % of the steady rate)",
                r["hostile_step_rate"] >= 0.8 * r["step_rate"])
    t.holds("a member's store calls for a resize do not grow with W (log-log slope < 0.5: nobody polls)",
            not laws["grow_calls_per_member"] >= 0.5, f"slope {laws['grow_calls_per_member']:.2f}")
    for key in ("cpu_ms_per_step", "coord_ops_per_step", "store_bytes_per_step", "events_bytes_per_step",
                "metrics_bytes_per_step", "status_bytes", "generation_record_bytes"):
        t.holds(f"{key} grows at most linearly in W (log-log slope < 1.5, nothing O(W^2))",
                not laws[key] >= 1.5, f"slope {laws[key]:.2f}")


def plot(path: str, rows: list[dict[str, Any]], groups: dict[int, dict[str, float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ws = [r["workers"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for key, label in (("cpu_ms_per_step", "coordinator CPU ms / step"), ("store_bytes_per_step", "store bytes / step (/1e3)"),
                       ("metrics_bytes_per_step", "metrics.jsonl bytes / step"), ("status_bytes", "status.json bytes")):
        scale = 1e3 if key == "store_bytes_per_step" else 1
        axes[0].loglog(ws, [r[key] / scale for r in rows], "o-", label=label)
    axes[0].set_xlabel("workers W")
    axes[0].legend(fontsize=7)
    axes[0].set_title("per-step costs")
    for key, label in (("first_generation_s", "first generation"), ("grow_s", "grow W -> 9W/8"),
                       ("shrink_s", "shrink back"), ("death_to_step_s", "death -> next step"),
                       ("storm_to_next_step_s", "10 % storm -> next step")):
        axes[1].semilogx(ws, [r[key] for r in rows], "o-", label=label)
    axes[1].set_xlabel("workers W")
    axes[1].set_ylabel("seconds")
    axes[1].legend(fontsize=7)
    axes[1].set_title("membership changes")
    for ax in axes[:2]:
        ax.set_xticks(ws, [str(w) for w in ws])
        ax.minorticks_off()
    if groups:
        axes[2].plot(list(groups), [g["s"] for g in groups.values()], "o-")
        axes[2].set_xlabel("gloo group size (processes)")
        axes[2].set_ylabel("seconds to form + 1 all-reduce")
        axes[2].set_title("group formation (real processes)")
    else:
        axes[2].axis("off")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = H.parser(__doc__, prog="python -m bench.control_plane")
    p.add_argument("--workers", type=int, nargs="+", default=None, help="fleet sizes (default 16 64 256 1024; "
                   "--quick: 16 64 256)")
    p.add_argument("--step-s", type=float, default=None, help="seconds per step (default 1.0; --quick: 0.25)")
    p.add_argument("--steps", type=int, default=None, help="steady-state steps measured (default 20; --quick: 8)")
    p.add_argument("--beaters", type=int, default=None, help="heartbeat processes of the fleet (default 4; --quick: 2)")
    p.add_argument("--groups", type=int, nargs="*", default=None, help="gloo group sizes timed with real processes "
                   "(default 2 4 8 16; --quick: 2 4 8; none: --groups with no value)")
    p.add_argument("--heartbeat-interval-s", type=float, default=HEARTBEAT_INTERVAL_S,
                   help="the base of the simulated workers' heartbeat law (default: the real worker's, 0.05 s; "
                        "the interval grows with W as virtualflow.runtime.channel.heartbeat_interval_s says)")
    p.add_argument("--plot", default=None, help="write the curves to this PNG")
    args = p.parse_args(argv)
    args.workers = args.workers or ([16, 64, 256] if args.quick else [16, 64, 256, 1024])
    args.step_s = args.step_s or (0.25 if args.quick else 1.0)
    args.steps = args.steps or (8 if args.quick else 20)
    args.beaters = args.beaters or (2 if args.quick else 4)
    groups_w = ([2, 4, 8] if args.quick else [2, 4, 8, 16]) if args.groups is None else args.groups
    run = H.Run(NAME, args, TARGET_KEYS)
    # The store's server looks up the name of every peer that connects (reverse DNS, in its one
    # thread): with a resolver that drops queries (this machine's drops about one in 25) each
    # dropped one freezes the store for the resolver's timeout, 5 s by default. Bounded to 1 s
    # here (the fleet's processes inherit it); docs/multi-node.md says what it means at scale.
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    logging.basicConfig(level=logging.ERROR)
    random.seed(0)
    print(H.banner(f"control plane at scale: W = {args.workers}, {args.step_s:g} s steps, heartbeat base "
                   f"{args.heartbeat_interval_s * 1e3:g} ms (the worker's law), heartbeat timeout {HEARTBEAT_TIMEOUT_S:g} s"))
    rows = []
    for w in args.workers:
        t0 = time.monotonic()
        rows.append(measure(w, args))
        print(f"  W={w}: measured in {time.monotonic() - t0:.0f} s", flush=True)
    ws = [r["workers"] for r in rows]
    laws = {k: slope(ws, [r[k] for r in rows]) for k in LAWS}
    groups = group_formation(groups_w) if groups_w else {}
    print()
    print(H.text_table(HEADER, [row(r) for r in rows]))
    print("\ngrowth laws (log-log slope over W: 0 constant, 1 linear, 2 quadratic):")
    for k, v in laws.items():
        print(f"  {k:28s} W^{v:.2f}")
    if groups:
        gws = list(groups)
        print("gloo group formation (real processes): " + ", ".join(
            f"W={w}: {g['s']:.3f} s, {g['store_calls']:.0f} store calls, {g['store_bytes'] / 1e3:.1f} KB"
            for w, g in groups.items()))
        print("  growth: " + ", ".join(f"{k} W^{slope(gws, [g[k] for g in groups.values()]):.2f}"
                                        for k in ("s", "store_calls", "store_bytes")))
    check_targets(run.targets, rows, laws, args.step_s)
    if args.plot:
        plot(args.plot, rows, groups)
        print(f"wrote {args.plot}")
    payload = {"benchmark": run.name, "environment": H.environment(),
               "config": {"workers": args.workers, "step_s": args.step_s, "steps": args.steps, "beaters": args.beaters,
                          "heartbeat_interval_s": args.heartbeat_interval_s,
                          "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S},
               "results": rows, "laws": laws, "groups": {str(k): v for k, v in groups.items()}}
    md = (f"# {NAME}\n\n{H.env_markdown()}\n\nCommand: `{run.command(NAME)}`\n\n"
          + H.md_table(HEADER, [row(r) for r in rows])
          + "\n\nGrowth laws (log-log slope): " + ", ".join(f"{k} W^{v:.2f}" for k, v in laws.items()) + "\n")
    return run.finish(payload, md, dump=lambda x: json.dumps(x, indent=2, default=str))


if __name__ == "__main__":
    sys.exit(main())
