"""The loopback link between two local worker processes, measured: a gloo ping-pong.

Two fresh processes (``python -m bench.harness.loopback --rank R --port P``, one thread each) form
a gloo group over 127.0.0.1; rank 0 sends a float32 tensor of each size and rank 1 sends it back.
The one-way time of a size is half the median round trip; :func:`fit_link` fits ``alpha + bytes /
bandwidth`` to those (least squares), which is the planner's :class:`~virtualflow.plan.pipeline.
partition.Link`.

Invariants: nothing here imports ``bench`` beyond the harness's machine helpers (the children run
this module on its own); each child prints one JSON line (rank 0: the one-way seconds per size).
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, port: int, reps: int, sizes: Sequence[int]) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=__import__("datetime").timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
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
    the sizes (alpha clamped at 0)."""
    xs, ys = list(one_way_s), [one_way_s[n] for n in one_way_s]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    alpha = max(my - slope * mx, 0.0)
    return alpha, 1.0 / slope


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


def main() -> None:
    p = argparse.ArgumentParser(description="one side of the loopback ping-pong (started by measure_loopback)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--sizes", default=",".join(map(str, SIZES_BYTES)))
    a = p.parse_args()
    print(json.dumps(_child(a.rank, a.port, a.reps, [int(x) for x in a.sizes.split(",")])), flush=True)


if __name__ == "__main__":
    main()
