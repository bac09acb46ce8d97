"""The loopback link between local worker processes, measured with gloo: a ping-pong of two
processes and the steps of a ring of ``world`` processes.

Fresh processes (``python -m bench.harness.loopback --rank R --port P ...``, one thread each)
form a gloo group over 127.0.0.1.

* :func:`measure_loopback`: rank 0 sends a float32 tensor of each size and rank 1 sends it back;
  the one-way time of a size is half the median round trip.
* :func:`measure_ring`: every rank posts a receive from its left neighbour, sends to its right one
  and waits (one step of a ring collective); per size the slowest rank's median step. (The mean
  was tried: a loaded machine's tail of slow steps made it over-predict the collectives of the
  runs that followed, by up to 30 %.)

:func:`fit_link` fits ``alpha + bytes / bandwidth`` to either (least squares): the planner's
:class:`~virtualflow.plan.pipeline.partition.Link`. On a loaded machine the two differ: a
ping-pong's receiver sleeps and must be woken for every message, a ring step of ``world``
processes waits for the slowest of its transfers, and with more processes than cores someone is
always waiting for a core.

Invariants: nothing here imports ``bench`` beyond the harness's machine helpers (the children run
this module on its own); each child prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time
from typing import Sequence

SIZES_BYTES = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22)
"""Message sizes of the ping-pong: 1 KiB to 4 MiB."""
RING_SIZES_BYTES = (1 << 12, 1 << 18)
"""Message sizes of the ring: 4 KiB (an activation of the emulated chain) and 256 KiB."""
MIN_BANDWIDTH, MAX_BANDWIDTH = 0.05e9, 20e9
"""Bounds on a fitted bandwidth (bytes per second)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ring(rank: int, world: int, reps: int, nbytes: int) -> float:
    """Median seconds of one ring step: every rank sends ``nbytes`` to its right neighbour and
    receives from its left one (a step of a ring collective), with a barrier-free chain of steps."""
    import torch
    import torch.distributed as dist

    send, recv = torch.zeros(nbytes // 4), torch.zeros(nbytes // 4)
    right, left = (rank + 1) % world, (rank - 1) % world
    times = []
    for i in range(reps + 3):
        t0 = time.perf_counter()
        r = dist.irecv(recv, left)
        dist.send(send, right)
        r.wait()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _collectives_step(store, rank: int, world: int, reps: int, nbytes: int) -> float:
    """Median seconds per ring step of virtualflow's own ring collectives
    (:class:`virtualflow.comm.ring.Collectives`, what a tensor-parallel block issues): an
    all-gather of ``world`` chunks of ``nbytes`` each, divided by its ``world - 1`` steps."""
    import torch

    from virtualflow.comm.groups import make_group
    from virtualflow.comm.ring import Collectives

    group = make_group(store, 7 + nbytes % 1000, rank, world, 60.0, torch.device("cpu"))
    comm = Collectives(group)
    n = nbytes // 4
    flat = torch.zeros(world * n)
    bounds = [(r * n, (r + 1) * n) for r in range(world)]
    times = []
    for i in range(reps + 3):
        t0 = time.perf_counter()
        comm.all_gather(flat, bounds)
        if i >= 3:
            times.append((time.perf_counter() - t0) / (world - 1))
    comm.close()
    group.close()
    return statistics.median(times)


def _child(rank: int, port: int, reps: int, sizes: Sequence[int], world: int = 2, ring: bool = False,
           collectives: bool = False) -> dict:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
    if collectives:
        return {"rank": rank, "ring_step_s": {str(n): _collectives_step(store, rank, world, reps, n) for n in sizes}}
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    if ring:
        steps = {str(n): _ring(rank, world, reps, n) for n in sizes}
        dist.destroy_process_group()
        return {"rank": rank, "ring_step_s": steps}
    out = {}
    for nbytes in sizes:
        buf = torch.zeros(nbytes // 4)
        times = []
        for i in range(reps + 3):  # 3 warm-up round trips
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            if i >= 3:
                times.append(time.perf_counter() - t0)
        out[str(nbytes)] = statistics.median(times) / 2
    dist.destroy_process_group()
    return {"rank": rank, "one_way_s": out}


def fit_link(one_way_s: dict[int, float]) -> tuple[float, float]:
    """``(alpha_s, bandwidth_bytes_per_s)`` of ``t = alpha + n / bandwidth``, least squares over
    the sizes; the bandwidth kept within ``MIN_BANDWIDTH..MAX_BANDWIDTH`` (noise can make the
    slope flat or negative) and alpha then the smallest size's time less its bytes' share."""
    xs, ys = list(one_way_s), [one_way_s[n] for n in one_way_s]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    bw = min(max(1.0 / slope if slope > 0 else MAX_BANDWIDTH, MIN_BANDWIDTH), MAX_BANDWIDTH)
    small = min(xs)
    return max(one_way_s[small] - small / bw, 0.0), bw


def measure_loopback(reps: int = 20, sizes: Sequence[int] = SIZES_BYTES, timeout_s: float = 120.0) -> dict:
    """Run the ping-pong in two fresh processes; the one-way seconds per size and the fitted link."""
    from bench.harness.machine import collect_children, spawn_child

    port = _free_port()
    args = ["--port", str(port), "--reps", str(reps), "--sizes", ",".join(map(str, sizes))]
    procs = [spawn_child("bench.harness.loopback", ["--rank", str(r), *args], threads=1) for r in (0, 1)]
    res = collect_children(procs, "the loopback ping-pong", timeout_s)
    one_way = {int(k): v for k, v in res[0]["one_way_s"].items()}
    alpha, bw = fit_link(one_way)
    return {"one_way_s": one_way, "alpha_s": alpha, "bandwidth_bytes_per_s": bw, "reps": reps,
            "method": "gloo send/recv ping-pong between two local processes, one way = median round trip / 2, "
                      "alpha + bytes / bandwidth fitted by least squares"}


def measure_ring(world: int = 4, sizes: Sequence[int] = RING_SIZES_BYTES, reps: int = 30,
                 timeout_s: float = 120.0) -> dict:
    """One step of a ring of ``world`` fresh processes (every rank sends a message of each size to
    its right neighbour and receives one from its left): per size the slowest rank's median step
    (a ring step waits for the slowest of its transfers), and ``alpha + bytes / bandwidth`` fitted
    to them (:func:`fit_link`)."""
    from bench.harness.machine import collect_children, spawn_child

    port = _free_port()
    args = ["--port", str(port), "--reps", str(reps), "--sizes", ",".join(map(str, sizes)), "--world", str(world),
            "--ring"]
    procs = [spawn_child("bench.harness.loopback", ["--rank", str(r), *args], threads=1) for r in range(world)]
    ranks = collect_children(procs, "the loopback ring", timeout_s)
    step = {n: max(r["ring_step_s"][str(n)] for r in ranks) for n in sizes}
    alpha, bw = fit_link(step)
    return {"world": world, "step_s": step, "alpha_s": alpha, "bandwidth_bytes_per_s": bw, "reps": reps,
            "method": f"gloo ring steps among {world} local processes (irecv from the left, send to the right, "
                      "wait), the slowest rank's median per size; alpha + bytes / bandwidth fitted"}


def measure_collectives(world: int = 4, sizes: Sequence[int] = RING_SIZES_BYTES, reps: int = 30,
                        timeout_s: float = 120.0) -> dict:
    """Ring steps of virtualflow's own ring collectives among ``world`` fresh processes (an
    all-gather divided by its steps: what a tensor-parallel block pays per message, its
    background thread and queue included), the slowest rank's median per size, and the fitted
    ``alpha + bytes / bandwidth``."""
    from bench.harness.machine import collect_children, spawn_child

    port = _free_port()
    args = ["--port", str(port), "--reps", str(reps), "--sizes", ",".join(map(str, sizes)), "--world", str(world),
            "--collectives"]
    procs = [spawn_child("bench.harness.loopback", ["--rank", str(r), *args], threads=1) for r in range(world)]
    ranks = collect_children(procs, "the ring collectives", timeout_s)
    step = {n: max(r["ring_step_s"][str(n)] for r in ranks) for n in sizes}
    alpha, bw = fit_link(step)
    return {"world": world, "step_s": step, "alpha_s": alpha, "bandwidth_bytes_per_s": bw, "reps": reps,
            "method": f"all-gathers of virtualflow.comm.ring.Collectives among {world} local processes, per ring "
                      "step (the collective's time / (world - 1)), the slowest rank's median per size; alpha + "
                      "bytes / bandwidth fitted"}


def main() -> None:
    p = argparse.ArgumentParser(description="one side of the loopback ping-pong (started by measure_loopback)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--sizes", default=",".join(map(str, SIZES_BYTES)))
    p.add_argument("--world", type=int, default=2, help="processes (the ping-pong: 2)")
    p.add_argument("--ring", action="store_true", help="time ring steps of the first size instead of the ping-pong")
    p.add_argument("--collectives", action="store_true", help="time virtualflow's ring collectives' steps")
    a = p.parse_args()
    print(json.dumps(_child(a.rank, a.port, a.reps, [int(x) for x in a.sizes.split(",")], a.world, a.ring,
                            a.collectives)), flush=True)


if __name__ == "__main__":
    main()
