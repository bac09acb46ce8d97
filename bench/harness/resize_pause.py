"""The pause a resize of sharded parameters costs, what it moves, and the bandwidth that moves it.

Purpose: the issue's target "resize pause <= 1 s + the time to move the shards at measured
bandwidth", measured on a launched job's own records.

* :func:`pauses`: from ``metrics.jsonl``'s step records (``time``: when a step's work ended,
  ``generation``, ``step_time_s``) and ``events.jsonl``'s ``formed`` events (each generation's
  ``members``, and the controller's own ``pause_s``: from the change's request, which may come
  mid-step, to the group formed), for each change of generation, the wall time
  between the old generation's last step and the new one's first, minus one ordinary step of
  the new generation (the median ``step_time_s`` of its :data:`ORDINARY_STEPS` steps after the
  first: the closest in time, before anything later, such as a newcomer of the next resize
  starting up on the same cores, slows the steps down): what the boundary's moves, the regroup
  and the first step's extra work cost.
* :func:`moved_bytes`: the bytes a resize moves, from the same plan the engine follows
  (:func:`virtualflow.plan.param_shards.moves` per unit, each element of a shard that changes
  holder, times the bytes per element of the parameter and its AdamW moments; a newcomer's shard
  crosses twice: to its deputy in the old group, then to the newcomer,
  :mod:`virtualflow.runtime.fsdp.reshard`).
* :func:`p2p_bandwidth`: bytes per second of a gloo point-to-point send of a large tensor
  between two processes on this machine.

Invariant: the pure parts (:func:`pauses`, :func:`moved_bytes`) read only numbers and member
lists, no processes, so a test checks them against sums written out by hand.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Sequence

import torch

__all__ = ["ORDINARY_STEPS", "moved_bytes", "p2p_bandwidth", "pauses", "read_jsonl", "resize_run"]

ORDINARY_STEPS = 2
"""A new generation's steps after its first whose median is its ordinary step time."""


def read_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def pauses(steps: Sequence[dict[str, Any]], formed: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per change of generation in ``steps`` (step records in step order; ``formed``:
    the generations' ``formed`` events): the old and new member lists, the gap between the two
    steps' ends, the new generation's ordinary step time, and ``pause_s`` = gap - ordinary step
    (None when the new generation ran no second step)."""
    members = {e["generation"]: list(e["members"]) for e in formed}
    out = []
    for i in range(1, len(steps)):
        old, new = steps[i - 1], steps[i]
        if old["generation"] == new["generation"]:
            continue
        later = [s["step_time_s"] for s in steps[i + 1:] if s["generation"] == new["generation"]][:ORDINARY_STEPS]
        ordinary = statistics.median(later) if later else None
        gap = new["time"] - old["time"]
        event = next((e for e in formed if e["generation"] == new["generation"]), {})
        out.append({"step": new["step"], "generation": new["generation"], "old_members": members[old["generation"]],
                    "new_members": members[new["generation"]], "gap_s": gap, "ordinary_step_s": ordinary,
                    "pause_s": None if ordinary is None else gap - ordinary,
                    "controller_pause_s": event.get("pause_s"), "group_s": event.get("group_s")})
    return out


def moved_bytes(unit_numels: Sequence[Sequence[int]], old_members: Sequence[Any], new_members: Sequence[Any],
                bytes_per_element: int) -> int:
    """Bytes a planned change from ``old_members`` to ``new_members`` sends between workers:
    every range of a unit whose holder changes (a survivor keeps what stays in its own shard), and
    each newcomer's whole new shard once more (its deputy hands it over)."""
    from virtualflow.plan.param_shards import moves, unit_bounds
    from virtualflow.runtime.fsdp.reshard import deputies

    new_of = {r: new_members.index(m) for r, m in enumerate(old_members) if m in new_members}
    old_of_new = {n: o for o, n in new_of.items()}
    newcomers = [d for d, m in enumerate(new_members) if m not in old_members]
    holder = {d: d for d in new_of.values()}
    holder.update(deputies(list(new_of.values()), newcomers))
    elements = 0
    for numels in unit_numels:
        old_b, new_b = unit_bounds(numels, len(old_members)), unit_bounds(numels, len(new_members))
        for m in moves(old_b, new_b):
            if m.src != old_of_new[holder[m.dst]]:
                elements += m.hi - m.lo
        elements += sum(new_b[d][1] - new_b[d][0] for d in newcomers)
    return elements * bytes_per_element


def _p2p_rank(rank: int, init: str, nbytes: int, reps: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(reps + 1):  # the first one warms the connection up
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
        else:
            dist.recv(buf, 0)
        dist.barrier()  # the receiver has it all
        times.append(time.perf_counter() - t0)
    if rank == 1:
        with open(out, "w") as f:
            json.dump(times[1:], f)
    dist.destroy_process_group()


def p2p_bandwidth(nbytes: int = 64 * 2 ** 20, reps: int = 3) -> float:
    """Bytes per second of one gloo send of ``nbytes`` between two processes on this machine (the
    median of ``reps``, the barrier that confirms its arrival included)."""
    import torch.multiprocessing as mp

    tmp = tempfile.mkdtemp(prefix="p2p-")
    out = os.path.join(tmp, "times.json")
    init = f"file://{os.path.join(tmp, 'store')}"
    mp.start_processes(_p2p_rank, args=(init, nbytes, reps, out), nprocs=2, start_method="spawn")
    with open(out) as f:
        return nbytes / statistics.median(json.load(f))


def _wait_for_step(handle: Any, step: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while handle.status()["step"] < step:
        if handle.done:
            handle.wait()
            raise RuntimeError(f"the job ended before step {step}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"step {step} not reached in {timeout_s} s")
        time.sleep(0.01)


def resize_run(job: Any, sizes: Sequence[int], steps_between: int = 3, timeout_s: float = 300.0,
               **knobs: Any) -> dict[str, Any]:
    """Launch ``job`` on ``sizes[0]`` workers (``knobs``: more ``LaunchOptions``), resize it to each
    later size after ``steps_between`` more steps (``resize(n, wait=True)``), stop it
    ``steps_between`` steps after the last; its step records and ``formed`` events (its run
    directory is removed)."""
    import virtualflow as vf

    run_dir = tempfile.mkdtemp(prefix="resize-pause-")
    handle = vf.launch(job, workers=sizes[0], steps=10 ** 6, run_dir=run_dir, **knobs)
    try:
        for n in (*sizes[1:], None):
            _wait_for_step(handle, handle.status()["step"] + steps_between, timeout_s)
            if n is not None:
                handle.resize(n, wait=True, timeout_s=timeout_s)
    finally:
        result = handle.stop()
    steps = sorted(read_jsonl(os.path.join(run_dir, "metrics.jsonl")), key=lambda r: r["step"])
    formed = [e for e in read_jsonl(os.path.join(run_dir, "events.jsonl")) if e.get("event") == "formed"]
    shutil.rmtree(run_dir, ignore_errors=True)  # its final state and logs: hundreds of MiB, not needed
    return {"steps": steps, "formed": formed, "failures": [f["cause"] for f in result.failures]}
