"""Checkpoint stall and resume time: sharded asynchronous checkpoints (``checkpoint_format="dcp"``,
``async_checkpoint=True``) against the PyTorch way, a synchronous ``torch.save`` of the whole
state from rank 0.

The state: a model of 25 M and 100 M parameters (square 2048 x 2048 layers with biases, float32)
with Adam's state (two moments and a step per parameter): 12 bytes per parameter, 0.3 GB and
1.2 GB.

* **Stall per save.** The PyTorch way: rank 0 holds the whole state and calls ``torch.save`` on
  it (to the page cache, no ``fsync``: what a training script does), while the other workers wait;
  the stall is that call. virtualflow: ``--workers`` worker processes (2; 4 with ``--workers 4``)
  each hold the whole state (the all-reduce reduction) and run what a worker runs at a checkpoint
  boundary: pick its share (:func:`~virtualflow.runtime.dcp.model_pieces`,
  :func:`~virtualflow.runtime.dcp.optimizer_pieces`) and hand it to its
  :class:`~virtualflow.runtime.dcp.DcpSaver`, which copies it to host memory and returns; the
  write (DCP files, ``fsync``, digests, the manifest of the worker that completes the set) runs
  on a thread. The stall is the longest of the workers' (the next step's collective waits for
  the slowest). The background write time is reported too: a checkpoint interval shorter than
  it makes the next save wait (one save in flight), and that wait would be stall. Between saves
  each worker waits for its write, so that saves do not overlap each other. Target: virtualflow's
  stall <= 0.2 x the PyTorch way's (medians over ``--reps`` saves), at each size.
  The first save of a worker allocates its host buffers (page faults): its stall is reported
  apart ("first dcp save"); later saves reuse them.
* **Resume.** From the single file (plain ``torch.load(weights_only=True)`` of the whole state,
  and virtualflow's :func:`~virtualflow.runtime.checkpoint.load_state`, which also checks the
  SHA-256 of the contents) vs from the sharded checkpoint written by ``--workers`` workers, read
  in a process that plays a worker of another count: the whole state reassembled (every file's
  SHA-256 checked against the manifest, then DCP reads), as a resuming worker does today, and one
  third of the optimizer state read by range, hashing only the files it reads (what a worker of
  3 under the sharded reduction holds). No target: reported.

Timing needs a quiet machine: each measurement waits up to ``--quiet-wait`` seconds for one, and
the other processes' CPU use during it is recorded.

From the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.checkpoint            # 25 M and 100 M, 5 saves each
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.checkpoint --quick    # 25 M only, 3 saves, same target
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from bench import harness as H

NAME = "checkpoint"
TARGET_KEYS = ("stall_ratio",)
TARGET_STALL_RATIO = 0.2
WIDTH = 2048


def build_state(params_m: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A model of about ``params_m`` million parameters and an Adam state for it (random values)."""
    g = torch.Generator().manual_seed(seed)
    layers = max(1, round(params_m * 1e6 / (WIDTH * WIDTH + WIDTH)))
    model: dict[str, torch.Tensor] = {}
    for i in range(layers):
        model[f"layers.{i}.weight"] = torch.randn(WIDTH, WIDTH, generator=g)
        model[f"layers.{i}.bias"] = torch.randn(WIDTH, generator=g)
    state = {pos: {"step": torch.tensor(10.0), "exp_avg": torch.randn(v.shape, generator=g),
                   "exp_avg_sq": torch.rand(v.shape, generator=g)} for pos, v in enumerate(model.values())}
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
               "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
               "params": list(range(len(model)))}]
    return model, {"state": state, "param_groups": groups}


def params_of(model: dict[str, torch.Tensor]) -> int:
    return sum(v.numel() for v in model.values())


# -- a worker process (virtualflow's side) ------------------------------------------------------
def child(args: list[str]) -> None:
    from virtualflow.runtime.dcp import DcpSaver, model_pieces, optimizer_pieces, write_rank

    cfg = json.loads(args[0])
    rank, world, folder, reps = cfg["rank"], cfg["world"], cfg["folder"], cfg["reps"]
    model, optim = build_state(cfg["params_m"])
    saver = DcpSaver(asynchronous=True)
    stalls, writes = [], []
    for k in range(1, reps + 1):
        final = os.path.join(folder, f"step-{k:08d}.dcp")
        meta = {"model": {}, "model_keys": list(model), "step": k, "job": {}} if rank == 0 else None
        t0 = time.perf_counter()
        pieces = model_pieces(model, rank, world)
        more, rest = optimizer_pieces(optim, rank, world)
        if meta is not None:
            meta["optimizer"] = rest
        saver.save(lambda staged, final=final, meta=meta, k=k: write_rank(final, rank, world, "bench", k, staged,
                                                                          meta, keep=1), pieces + more)
        stalls.append(time.perf_counter() - t0)
        saver.drain()  # saves never overlap (the write's time is reported, not counted as stall)
        writes.append(saver.last_write_s)
    print(json.dumps({"rank": rank, "stalls_s": stalls, "writes_s": writes}))


def dcp_saves(params_m: int, world: int, reps: int, folder: str) -> dict[str, Any]:
    procs = [H.spawn_child("bench.checkpoint", ["--child", json.dumps(
        {"rank": r, "world": world, "folder": folder, "reps": reps, "params_m": params_m})], threads=1)
        for r in range(world)]
    out = H.collect_children(procs, "a checkpointing worker", timeout_s=900)
    per_save = [max(o["stalls_s"][k] for o in out) for k in range(reps)]
    return {"stall_s": per_save, "write_s": [max(o["writes_s"][k] for o in out) for k in range(reps)]}


def torch_saves(model: dict[str, torch.Tensor], optim: dict[str, Any], reps: int, folder: str) -> list[float]:
    path = os.path.join(folder, "state.pt")
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.save({"model": model, "optimizer": optim}, path)
        out.append(time.perf_counter() - t0)
    return out


def resume_times(folder_pt: str, folder_dcp: str, world: int) -> dict[str, Any]:
    from virtualflow.plan.shards import shard_bounds
    from virtualflow.runtime.dcp import load_dcp_state, load_ranges, read_manifest

    ckpts = sorted(n for n in os.listdir(folder_dcp) if n.endswith(".dcp"))
    final = os.path.join(folder_dcp, ckpts[-1])
    t0 = time.perf_counter()
    whole = torch.load(os.path.join(folder_pt, "state.pt"), weights_only=True)
    t_pt = time.perf_counter() - t0
    from virtualflow.runtime.checkpoint import load_state, save_state

    save_state(os.path.join(folder_pt, "vf.pt"), {**whole, "step": 1})  # virtualflow's file (checksum inside)
    t0 = time.perf_counter()
    load_state(os.path.join(folder_pt, "vf.pt"))
    t_vf_pt = time.perf_counter() - t0
    t0 = time.perf_counter()
    state = load_dcp_state(final)
    t_dcp = time.perf_counter() - t0
    same = all(torch.equal(state["model"][k], v) for k, v in whole["model"].items()) and all(
        torch.equal(state["optimizer"]["state"][p][n], v) for p, st in whole["optimizer"]["state"].items()
        for n, v in st.items())
    del state
    # one third of the optimizer state, by range: worker 1 of 3 under the sharded reduction
    t0 = time.perf_counter()
    manifest = read_manifest(final, verify_files=False)  # the files read are verified below
    sizes = [(p, v["exp_avg"].numel()) for p, v in sorted(whole["optimizer"]["state"].items())]
    lo, hi = shard_bounds(sum(n for _, n in sizes), 3)[1]
    ranges, start = {}, 0
    for p, n in sizes:
        a, b = max(lo, start), min(hi, start + n)
        if a < b:
            for key in ("exp_avg", "exp_avg_sq"):
                ranges[f"optimizer/state/{p}/{key}"] = (a - start, b - start)
        start += n
    load_ranges(final, manifest, ranges, verify=True)
    t_third = time.perf_counter() - t0
    return {"pt_load_s": t_pt, "vf_pt_load_s": t_vf_pt, "dcp_whole_s": t_dcp, "dcp_third_s": t_third,
            "identical": same, "written_by": world}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child(argv[1:])
        return 0
    p = H.parser(__doc__, reps=5, quiet_wait=60.0, prog="python -m bench.checkpoint")
    p.add_argument("--workers", type=int, default=2, help="worker processes writing the sharded checkpoint")
    p.add_argument("--sizes", default="25,100", help="model sizes in millions of parameters, comma-separated")
    args = p.parse_args(argv)
    if args.quick:
        args.reps, args.sizes, args.quiet_wait = 3, "25", min(args.quiet_wait, 10.0)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    run = H.Run(NAME, args, TARGET_KEYS)
    torch.set_num_threads(1)
    print(H.banner(f"checkpoint stall: async sharded (dcp, {args.workers} workers) vs torch.save from rank 0"))
    rows, results = [], {}
    for size in sizes:
        root = tempfile.mkdtemp(prefix="vf-bench-ckpt-")
        try:
            model, optim = build_state(size)
            n = params_of(model)
            waited, before = H.wait_for_quiet(args.quiet_wait)
            with H.LoadMeter() as load:
                base = torch_saves(model, optim, args.reps, root)
                del model, optim
                ours = dcp_saves(size, args.workers, args.reps, os.path.join(root, "checkpoints"))
                resume = resume_times(root, os.path.join(root, "checkpoints"), args.workers)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        t_base, t_ours = statistics.median(base), statistics.median(ours["stall_s"])
        ratio = t_ours / t_base
        res = {"params": n, "state_bytes": n * 12, "torch_save_s": base, "dcp_async": ours, "resume": resume,
               "stall_ratio": ratio, "other_load_cores": load.other_cores, "waited_for_quiet_s": waited}
        results[f"{size}M"] = res
        rows.append([f"{n / 1e6:.1f} M", H.mib(n * 12), H.ms(t_base), H.ms(t_ours), H.ms(ours["stall_s"][0]),
                     H.ms(statistics.median(ours["write_s"])), f"{ratio:.3f}", f"{resume['pt_load_s']:.2f}",
                     f"{resume['vf_pt_load_s']:.2f}", f"{resume['dcp_whole_s']:.2f}", f"{resume['dcp_third_s']:.2f}",
                     f"{load.other_cores:.2f}"])
        run.targets.at_most("stall_ratio", f"{size} M parameters: async dcp stall / torch.save stall", ratio,
                            TARGET_STALL_RATIO)
        run.targets.holds(f"{size} M parameters: the sharded checkpoint reads back bit-identical",
                          resume["identical"])
    header = ["params", "state", "torch.save stall ms", "dcp async stall ms", "first dcp save ms",
              "dcp write ms (background)", "stall ratio", "torch.load .pt s", "vf load .pt (verified) s",
              "resume dcp whole s", "dcp 1/3 optimizer s", "other load cores"]
    print(H.text_table(header, rows))
    md = [f"# {run.name}: checkpoint stall, async sharded (dcp) vs torch.save from rank 0", "", H.env_markdown(), "",
          f"{args.workers} worker processes write the sharded checkpoint; medians of {args.reps} saves. Stall = the "
          f"time the training thread is held (the longest worker's); the background write is reported apart. "
          f"Resume: read in one process (the whole state; then a third of the optimizer state by range). See the "
          f"module docstring of bench/checkpoint.py.", "", H.md_table(header, rows), "",
          f"Reproduce: `{run.command(NAME)}`"]
    payload = {"benchmark": run.name, "environment": H.environment(),
               "config": {"workers": args.workers, "reps": args.reps, "sizes_m": sizes, "quick": args.quick},
               "results": results}
    return run.finish(payload, "\n".join(md))


if __name__ == "__main__":
    sys.exit(main())
