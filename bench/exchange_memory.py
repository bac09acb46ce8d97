"""Workers' memory over 500 steps of each exchange: no worker's RSS may grow (issue 44).

Each way of bringing gradients together runs on 2 worker processes (gloo, 1 thread per worker):
the default mode's all-reduce, deterministic mode's ``owners`` and ``slots`` exchanges, each with
``reduction="allreduce"`` and ``"sharded"``, for the warm-up steps and then 500 more, with the
allocator's defaults (no ``MALLOC_*`` settings) and Python's cyclic collector on, as any job
runs. Every worker reads its own resident memory (VmRSS) at every step boundary
(:class:`RssProbe`, a ``ranks="all"`` callback); a worker's growth is the median of its last
``WINDOW`` readings minus the median of its first ``WINDOW`` after the warm-up (medians: a reading
may fall while a step's transient buffer is still mapped).

Target: every worker's growth at most ``TOLERANCE_MIB`` (32 MiB). Without a leak a worker still
settles by 10-19 MiB over its first few hundred steps (allocator and interpreter heaps; measured
on the 1 M MLP: flat from step 500 to 1,000 for every exchange), hence the tolerance. The
``slots`` exchange's leak, before it was fixed, grew each worker by about 490-590 MiB over these
500 steps of the 1 M MLP (the ``--quick`` workload), and to 3.4-7 GB on the 25 M MLP.

The full run uses the 25 M MLP (Adam, B = 48 in V = 6), where the leak was seen; ``--quick`` the
1 M MLP of the same workload. From the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.exchange_memory            # 6 x 550 steps of the 25 M MLP
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.exchange_memory --quick    # about 3-6 minutes
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
import sys
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from bench import harness as H

NAME = "exchange_memory"
TARGET_KEYS = ("rss_growth",)
TOLERANCE_MIB = 32.0
WORKERS = 2
STEPS = 500
WARMUP = 50
WINDOW = 25
EXCHANGES = (("default", "allreduce"), ("owners", "allreduce"), ("slots", "allreduce"),
             ("default", "sharded"), ("owners", "sharded"), ("slots", "sharded"))
HEADER = ["exchange", "reduction", "W", "RSS after warm-up (MiB)", "RSS at the end (MiB)",
          "growth, worst worker (MiB)", "tolerance (MiB)", "met"]


class RssProbe:
    """Every worker's VmRSS at every step boundary, written to ``folder/rss-RANK.json`` at the end."""

    ranks = "all"

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.samples: list[tuple[int, float]] = []
        self.rank = 0

    def on_step_end(self, info) -> None:
        self.rank = info.rank
        self.samples.append((info.step, H.rss_mib()))

    def on_train_end(self, step: int) -> None:
        with open(os.path.join(self.folder, f"rss-{self.rank}.json"), "w") as f:
            json.dump(self.samples, f)


def measure(model: str, exchange: str, reduction: str, steps: int, warmup: int) -> dict:
    """One run of ``warmup + steps`` steps; each worker's RSS after the warm-up and at the end."""
    import virtualflow as vf

    folder = tempfile.mkdtemp(prefix="exchange-memory-")
    job = dataclasses.replace(H.RESIZE_JOBS[model](), callbacks=[RssProbe(folder)])
    det = exchange != "default"
    extra = {"deterministic_exchange": exchange} if det else {}
    result = vf.train(job, workers=WORKERS, steps=warmup + steps, deterministic=det, reduction=reduction,
                      threads_per_worker=1, **extra)
    if result.failures:
        raise RuntimeError(f"{exchange}/{reduction}: workers lost: {[f['cause'] for f in result.failures]}")
    start, end = {}, {}
    for rank in range(WORKERS):
        with open(os.path.join(folder, f"rss-{rank}.json")) as f:
            rss = [v for s, v in json.load(f) if s >= warmup]
        start[rank], end[rank] = statistics.median(rss[:WINDOW]), statistics.median(rss[-WINDOW:])
    growth = {r: end[r] - start[r] for r in start}
    print(f"  {exchange}/{reduction}: RSS per worker {start} -> {end} MiB", flush=True)
    return {"exchange": exchange, "reduction": reduction, "workers": WORKERS, "start_mib": start, "end_mib": end,
            "growth_mib": growth, "worst_growth_mib": max(growth.values())}


def main(argv: list[str] | None = None) -> int:
    p = H.parser(__doc__)
    p.add_argument("--steps", type=int, default=STEPS, help="steps measured after the warm-up")
    p.add_argument("--warmup", type=int, default=WARMUP, help="steps before the first reading counted")
    args = p.parse_args(argv)
    if args.steps < 2 * WINDOW:
        p.error(f"--steps={args.steps} must be at least {2 * WINDOW} (two windows of {WINDOW} readings)")
    model = "mlp-1m" if args.quick else "mlp-25m"
    H.apply_malloc_mode("default")
    run = H.Run(NAME, args, TARGET_KEYS)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    print(H.banner(f"workers' RSS over {args.steps} steps of each exchange ({model}, W = {WORKERS})"))
    limit = run.targets.limit("rss_growth", TOLERANCE_MIB)
    rows, table = [], []
    for exchange, reduction in EXCHANGES:
        r = measure(model, exchange, reduction, args.steps, args.warmup)
        rows.append(r)
        met = run.targets.at_most("rss_growth", f"{exchange}/{reduction}: RSS growth of the worst worker over "
                                  f"{args.steps} steps (MiB)", r["worst_growth_mib"], TOLERANCE_MIB)
        table.append([exchange, reduction, WORKERS, f"{max(r['start_mib'].values()):.0f}",
                      f"{max(r['end_mib'].values()):.0f}", f"{r['worst_growth_mib']:+.1f}", f"{limit:.0f}",
                      H.yes_no(met)])
    print()
    print(H.text_table(HEADER, table))
    config = {"model": model, "params": H.resize_params(model), "workers": WORKERS, "steps": args.steps,
              "warmup": args.warmup, "window": WINDOW, "threads_per_worker": 1, "malloc": "glibc defaults",
              "measure": f"per worker: median VmRSS of the last {WINDOW} step boundaries minus the first {WINDOW} "
                         f"after the warm-up"}
    payload = {"benchmark": run.name, "environment": H.environment(), "config": config, "results": rows,
               "table": table}
    md = "\n".join([f"# {run.name}: workers' memory over {args.steps} steps of each exchange", "",
                    f"{model} ({H.resize_params(model):,} parameters), W = {WORKERS}, 1 thread per worker, "
                    f"glibc's default allocator settings; growth = median VmRSS of a worker's last {WINDOW} step "
                    f"boundaries minus its first {WINDOW} after {args.warmup} warm-up steps.", "",
                    H.md_table(HEADER, table)])
    return run.finish(payload, md)


if __name__ == "__main__":
    sys.exit(main())
