"""Run a function on p gloo ranks in spawned processes (tests of collectives).

``target(rank, size, store_port, *args, results)`` runs in each process; it puts
``(rank, payload)`` on ``results`` (a multiprocessing queue). :func:`launch_ranks` returns each
rank's payload, bounded by ``timeout_s``; ranks that never answer are missing from the result
(the caller asserts on that), and stragglers are killed.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import time
from typing import Any, Callable

import torch.distributed as dist


def launch_ranks(target: Callable[..., None], size: int, *args: Any, timeout_s: float = 60.0) -> dict[int, Any]:
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, size, store.port, *args, results), daemon=True) for r in range(size)]
    for proc in procs:
        proc.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < size and time.monotonic() < deadline:
            try:
                rank, payload = results.get(timeout=0.5)
            except Exception:  # noqa: BLE001 - queue.Empty
                if all(not proc.is_alive() for proc in procs) and results.empty():
                    break
                continue
            out[rank] = payload
    finally:
        for proc in procs:
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    return out
