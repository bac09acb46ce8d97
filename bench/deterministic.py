"""What deterministic mode costs: step time against the default mode and against DDP, and the
bytes its exchange moves, with the ``owners`` exchange beside today's first one (``slots``).

One run, one table, these parts:

* **step time** (processes, gloo, 1 thread per worker): the same job in the default mode and in
  deterministic mode with ``deterministic_exchange="owners"`` (the default) and ``"slots"``, at
  W = 2, 3, 4 workers, on the harness's 2.6 M MLP (B = 256 in V = 8 VNs, SGD) and its 25 M MLP
  (``model_25m``: B = 48 in V = 6 VNs, Adam). Per run: the median of the step times after the
  warm-up steps (``Result.history``'s ``step_time_s``); the modes run one after the other in a
  rotating order, and a ratio is the median over repetitions of (deterministic median / default
  median) of the same repetition. Target (issue 32): owners / default <= 1.15 at every W and
  model. ``slots`` is shown beside it, without a target.
* **CPU per step** (a diagnostic, W = 3): the CPU seconds all workers spend per step in each
  mode (a 14-step run minus a 4-step run, from the launcher's ``RUSAGE_CHILDREN``): on 2 cores
  with 3 workers the step time follows it, and host noise moves it much less than a step time.
* **CPU per exchange, the exchange alone** (a diagnostic, W = 3, :mod:`bench.harness.exchange_cpu`):
  three processes exchange a 2.6 M-element vector, ``--exchange-steps`` times per repetition,
  with gloo's ring all-reduce (the default mode) and with the ``owners`` exchange of the partial
  sums V = 8 VNs give on the map the planner publishes, (3, 3, 2), whose blocks straddle the
  tree (two partial sums on a worker: 1.33 x the all-reduce's bytes in all, 1.5 x on the busiest
  worker), and on one aligned to the tree, (4, 2, 2) (the all-reduce's bytes); the CPU all three
  spend per exchange; beside each map, its *point-to-point floor*: the same bytes and additions
  as plain gloo ``send``/``recv`` calls from one thread (no segments, threads or tree order),
  what any exchange of that map over gloo's point-to-point path costs at the least. Where the
  owners exchange's extra CPU goes (bytes, gloo's point-to-point path, its own threads):
  docs/benchmarks.md.
* **bytes per worker per step** (simulated, no processes): what one worker sends in one step's
  exchange, from the closed forms of :mod:`virtualflow.plan.exchange` (the ``owners`` exchange's,
  the ``slots`` exchange's ring all-reduce of one slot per partial sum, and the default mode's
  ring all-reduce of the gradient), the most any worker sends, W = 2..64 at V = 4 W (a fixed
  number of VNs per worker), gradient of the 25 M MLP. Targets: ``owners`` sends at most
  (own partials + 1) x the gradient at every W (the issue's bound), and does not grow with W: at
  most 2 x the default all-reduce at every W up to 64 (it is (k + 1) / 2 x, k the most partial
  sums a worker holds: 1 where the VN blocks align with the tree, 3 where they do not), where
  ``slots`` sends S x (S: the partial sums of all workers, 112 at W = 48).
* **deterministic mode vs DDP** at 2 workers: the 2.6 M MLP, B = 256 in V = 8 (4 micro-batches of
  32 per process), deterministic mode (``owners``) against PyTorch DDP with ``no_sync()`` on all
  but the last micro-batch (bench/harness/ddp.py), interleaved pairs. Target: the same 1.15 as
  against the default mode (the default mode is within 2 % of DDP: bench/results/vs_ddp.md). The
  final weights are compared too: the two sum gradients in different orders, so they agree
  within float tolerance, not bit for bit.

This is a 2-core machine: 2 workers fill it and 3 or 4 share it, so these are ratios at equal
worker counts, not scaling results. Each row records the CPU other processes used meanwhile
(``other load``, in cores). From the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.deterministic            # about 15 minutes
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.deterministic --quick    # about 4 minutes, same targets
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from bench import harness as H

NAME = "deterministic"
MODULE = "bench.deterministic"
TARGET_KEYS = ("time_ratio", "ddp_ratio", "bytes_bound", "bytes_growth")
TARGET_RATIO = 1.15
TARGET_BYTES_GROWTH = 2.0
MODES = ("default", "owners", "slots")
SLOTS_MAX_WORKERS: dict[str, int] = {}
"""Up to issue 44 the ``slots`` exchange of the 25 M MLP ran at 2 workers only: its workers'
memory grew over the steps (3.3 GB per worker after 18 steps at W = 2; two 7 GB workers were
OOM-killed at W = 4). The cause was a reference cycle holding each step's buffer until Python's
cyclic collector ran (fixed; ``bench.exchange_memory`` measures every exchange's growth), so it
runs at every W again."""
WORKERS = (2, 3, 4)
BYTES_WORKERS = (2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)
VNS_PER_WORKER = 4
ITEMSIZE = 4  # float32 gradients


# --------------------------------------------------------------------------------------------
# Workloads (module-level: the worker processes import the jobs by reference).


def job_2m6():
    return H.mlp_job(f"{NAME}-mlp-2.6m", virtual_nodes=8)


def job_25m():
    return H.resize_job_25m()


@dataclass(frozen=True)
class Model:
    name: str
    job: Callable[[], Any]
    params: int
    describe: str


def models() -> dict[str, Model]:
    return {
        "mlp-2.6m": Model("mlp-2.6m", job_2m6, H.param_count(),
                          f"{H.MLP_DESCRIPTION}, SGD + momentum, B=256 in V=8"),
        "mlp-25m": Model("mlp-25m", job_25m, H.resize_params("mlp-25m"),
                         f"MLP {'-'.join(map(str, H.RESIZE_MODELS['mlp-25m']))} ReLU, Adam, "
                         f"B={H.RESIZE_BATCH} in V={H.RESIZE_VNS}"),
    }


# --------------------------------------------------------------------------------------------
# Part 1: step time of the three modes.


def run_mode(model: Model, workers: int, mode: str, steps: int, warmup: int) -> dict:
    """One run of ``model`` on ``workers`` processes in ``mode``; its median step time."""
    import virtualflow as vf

    det = mode != "default"
    extra = {"deterministic_exchange": mode} if det else {}
    with H.LoadMeter() as meter:
        result = vf.train(model.job, workers=workers, steps=steps, deterministic=det, threads_per_worker=1, **extra)
    times = [h["step_time_s"] for h in result.history]
    median = H.median(times[warmup:])
    if result.failures:  # a worker lost (an OOM kill, a heartbeat timeout under load): not a clean measure
        print(f"  {model.name} W={workers} {mode}: lost {[f['cause'] for f in result.failures]}; not counted",
              flush=True)
        median = float("nan")
    reductions = [b["reduction_s"] for h in result.history[warmup:] for b in (h.get("breakdown") or [])
                  if b.get("worker") == 0]
    return {"mode": mode, "workers": workers, "step_times": times, "median_step_s": median,
            "failures": [f["cause"] for f in result.failures],
            "rank0_reduction_s": H.median(reductions), "other_load_cores": meter.other_cores,
            "final_loss": result.history[-1]["loss"]}


def measure_steps(args, model: Model, workers: int) -> dict:
    """``args.reps`` repetitions of the three modes (the order rotating), one row's figures."""
    modes = [m for m in MODES if m != "slots" or workers <= SLOTS_MAX_WORKERS.get(model.name, workers)]
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for rep in range(args.reps):
        H.wait_for_quiet(args.quiet_wait)
        order = modes[rep % len(modes):] + modes[:rep % len(modes)]
        for mode in order:
            runs[mode].append(run_mode(model, workers, mode, args.steps, args.warmup))
        line = ", ".join(f"{m} {1e3 * runs[m][-1]['median_step_s']:.1f} ms" for m in modes)
        print(f"  {model.name} W={workers} rep {rep}: {line}", flush=True)
    base = [r["median_step_s"] for r in runs["default"]]
    ratio = {m: H.median([r["median_step_s"] / b for r, b in zip(runs[m], base)]) if runs[m] else None
             for m in ("owners", "slots")}
    return {"part": "step time", "model": model.name, "workers": workers,
            "median_step_s": {m: H.median([r["median_step_s"] for r in runs[m]]) if runs[m] else None for m in MODES},
            "rank0_reduction_s": {m: H.median([r["rank0_reduction_s"] for r in runs[m]]) if runs[m] else None
                                  for m in MODES},
            "ratio": ratio, "other_load_cores": max(r["other_load_cores"] for rs in runs.values() for r in rs),
            "raw": runs}


# --------------------------------------------------------------------------------------------
# Part 1b: CPU per step (a diagnostic that host noise moves little).


def cpu_per_step(model: Model, workers: int, mode: str, short: int, long: int) -> float:
    """CPU seconds all ``workers`` processes spend per step in ``mode``: the difference between a
    run of ``long`` and one of ``short`` steps (start-up cancels), from the launcher's
    ``RUSAGE_CHILDREN`` (every worker process has exited when ``train`` returns)."""
    import resource

    import virtualflow as vf

    det = mode != "default"
    extra = {"deterministic_exchange": mode} if det else {}
    used = []
    for steps in (short, long):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        vf.train(model.job, workers=workers, steps=steps, deterministic=det, threads_per_worker=1, **extra)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        used.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return (used[1] - used[0]) / (long - short)


def measure_cpu(args, model: Model, workers: int) -> dict:
    """Part 1b's row: CPU seconds per step of every mode, and each deterministic mode's ratio to
    the default's. On a machine with fewer cores than workers this is what the step time follows."""
    cpu = {m: cpu_per_step(model, workers, m, args.cpu_steps[0], args.cpu_steps[1]) for m in MODES}
    print(f"  {model.name} W={workers} CPU per step (all workers): "
          + ", ".join(f"{m} {cpu[m]:.3f} s" for m in MODES), flush=True)
    return {"part": "cpu", "model": model.name, "workers": workers, "cpu_s": cpu,
            "ratio": {m: cpu[m] / cpu["default"] for m in ("owners", "slots")}}


# --------------------------------------------------------------------------------------------
# Part 2: bytes per worker per step, from the closed forms.


EXCHANGE_NUMEL = 2_600_000
EXCHANGE_MAPS = {"(3, 3, 2)": ((0, 1, 2), (3, 4, 5), (6, 7)), "(4, 2, 2)": ((0, 1, 2, 3), (4, 5), (6, 7))}
"""The ``exchange`` part's VN maps of V = 8 on 3 workers: the planner's (equal blocks,
straddling the tree) and one aligned to the tree."""


def measure_exchange(args) -> list[dict]:
    """Part 1c's rows: CPU per exchange alone, each map's owners exchange against the all-reduce."""
    from bench.harness.exchange_cpu import measure_exchange_cpu

    got = measure_exchange_cpu(3, EXCHANGE_NUMEL, {f"owners {k}": v for k, v in EXCHANGE_MAPS.items()},
                               steps=args.exchange_steps, reps=2)
    base = got.pop("gloo all-reduce")
    rows = []
    for name, r in [(n, r) for n, r in got.items() if not n.startswith("p2p floor ")]:
        floor = got[f"p2p floor {name}"]
        rows.append({"part": "exchange", "map": name.removeprefix("owners "), "allreduce": base, "owners": r,
                     "floor": floor, "cpu_ratio": r["cpu_s"] / base["cpu_s"],
                     "floor_ratio": floor["cpu_s"] / base["cpu_s"],
                     "bytes_ratio": r["total_bytes"] / base["total_bytes"],
                     "worker_bytes_ratio": r["bytes"] / base["bytes"]})
        print(f"  exchange alone, map {rows[-1]['map']}: owners {1e3 * r['cpu_s']:.1f} ms CPU, its point-to-point "
              f"floor {1e3 * floor['cpu_s']:.1f} ms, gloo all-reduce {1e3 * base['cpu_s']:.1f} ms (bytes: "
              f"{rows[-1]['bytes_ratio']:.2f} x in all, {rows[-1]['worker_bytes_ratio']:.2f} x the busiest "
              f"worker's)", flush=True)
    return rows


def bytes_row(workers: int, numel: int) -> dict:
    """The most any worker sends in one step's exchange at ``workers`` workers, V = 4 W."""
    from virtualflow.plan.exchange import owners_traffic_closed_form, ring_allreduce_bytes, slots_traffic
    from virtualflow.plan.vnmap import TreePlan, contiguous_assignment

    v = VNS_PER_WORKER * workers
    plan = TreePlan.build(contiguous_assignment(v, workers))
    ranks = range(workers)
    owners = max(owners_traffic_closed_form(plan, numel, r, ITEMSIZE)[0] for r in ranks)
    slots = max(slots_traffic(plan, numel, r, ITEMSIZE) for r in ranks)
    default = max(ring_allreduce_bytes(numel, workers, r, ITEMSIZE) for r in ranks)
    partials = max(len(nodes) for nodes in plan.per_worker)
    return {"part": "bytes", "workers": workers, "virtual_nodes": v, "slots_in_tree": len(plan.slots),
            "max_partials": partials, "bytes": {"default": default, "owners": owners, "slots": slots},
            "bound_bytes": (partials + 1) * numel * ITEMSIZE,
            "ratio": {"owners": owners / default, "slots": slots / default}}


# --------------------------------------------------------------------------------------------
# Part 3: deterministic mode against DDP + no_sync at 2 workers.


def measure_ddp(args, tmp: str) -> dict:
    import virtualflow as vf

    v, b, w = 8, 256, args.warmup
    save = os.path.join(tmp, "ddp.pt")
    pairs = []
    for rep in range(args.reps):
        def run_vf() -> dict:
            result = vf.train(job_2m6, workers=2, steps=args.steps, deterministic=True, threads_per_worker=1)
            return {"step_times": [h["step_time_s"] for h in result.history], "state_dict": result.state_dict}

        runs = H.run_pair({"vf": run_vf,
                           "ddp": lambda: {"ranks": H.run_ddp(MODULE, 2, v, b, args.steps, save, w)}},
                          H.pair_order(rep, "vf", "ddp"), max_other_cores=args.max_other_load,
                          retries=args.retries, quiet_wait_s=args.quiet_wait, label=f"DDP rep {rep}")
        a = H.median(runs["vf"]["step_times"][w:])
        d = H.median(runs["ddp"]["ranks"][0]["step_times"][w:])
        diff = H.state_max_abs_diff(runs["vf"].pop("state_dict"), torch.load(save))
        pairs.append({"vf_median_step_s": a, "ddp_median_step_s": d, "ratio": a / d, "max_abs_weight_diff": diff,
                      "other_load_cores": max(runs["vf"]["other_load_cores"], runs["ddp"]["other_load_cores"]),
                      "vf_step_times": runs["vf"]["step_times"],
                      "ddp_step_times_rank0": runs["ddp"]["ranks"][0]["step_times"]})
        print(f"  DDP rep {rep}: deterministic {1e3 * a:.1f} ms, DDP {1e3 * d:.1f} ms, ratio {a / d:.3f}, "
              f"max |weight diff| {diff:.1e}", flush=True)
    return {"part": "vs DDP", "model": "mlp-2.6m", "workers": 2,
            "vf_median_step_s": H.median([p["vf_median_step_s"] for p in pairs]),
            "ddp_median_step_s": H.median([p["ddp_median_step_s"] for p in pairs]),
            "ratio": H.median([p["ratio"] for p in pairs]),
            "max_abs_weight_diff": max(p["max_abs_weight_diff"] for p in pairs),
            "other_load_cores": max(p["other_load_cores"] for p in pairs), "raw": pairs}


# --------------------------------------------------------------------------------------------
# Targets and the one table.


HEADER = ["part", "model", "W", "V", "baseline", "baseline value", "owners", "slots", "owners / baseline",
          "slots / baseline", "target", "met", "other load"]


def mib(x: float) -> str:
    return f"{x / 2 ** 20:.1f} MiB"


def check(args, run: H.Run, steps_rows: list[dict], bytes_rows: list[dict], ddp: dict | None,
          numel: int, cpu_rows: list[dict] = (), exchange_rows: list[dict] = ()) -> list[list]:
    """Checks every target; the table's rows."""
    t = run.targets
    table = []
    for r in steps_rows:
        met = t.at_most("time_ratio", f"{r['model']} W={r['workers']}: deterministic (owners) / default step time",
                        r["ratio"]["owners"], TARGET_RATIO)
        ms = r["median_step_s"]
        v = 8 if r["model"] == "mlp-2.6m" else H.RESIZE_VNS
        table.append(["step time", r["model"], r["workers"], v, "default mode", f"{1e3 * ms['default']:.1f} ms",
                      f"{1e3 * ms['owners']:.1f} ms", H.ms(ms["slots"], 1, "not run") + (" ms" if ms["slots"] else ""),
                      f"{r['ratio']['owners']:.3f}", H.num(r["ratio"]["slots"], ".3f", "-"),
                      f"<= {t.limit('time_ratio', TARGET_RATIO):g}", H.yes_no(met),
                      f"{r['other_load_cores']:.2f}"])
    for r in cpu_rows:
        c = r["cpu_s"]
        v = 8 if r["model"] == "mlp-2.6m" else H.RESIZE_VNS
        table.append(["CPU / step, all workers", r["model"], r["workers"], v, "default mode",
                      f"{c['default']:.3f} s", f"{c['owners']:.3f} s", f"{c['slots']:.3f} s",
                      f"{r['ratio']['owners']:.3f}", f"{r['ratio']['slots']:.3f}", "- (diagnostic)", "-", "-"])
    for r in exchange_rows:
        a, o = r["allreduce"], r["owners"]
        table.append(["CPU / exchange alone, all workers", f"2.6 M floats, map {r['map']}", 3, 8, "gloo all-reduce",
                      f"{1e3 * a['cpu_s']:.1f} ms", f"{1e3 * o['cpu_s']:.1f} ms ({r['bytes_ratio']:.2f} x bytes in all)", "-",
                      f"{r['cpu_ratio']:.3f}", "-", "- (diagnostic)", "-", "-"])
        if "floor" in r:  # rows recorded before the floor was measured have none
            table.append(["CPU / exchange alone, all workers", f"2.6 M floats, map {r['map']}: point-to-point floor",
                          3, 8, "gloo all-reduce", f"{1e3 * a['cpu_s']:.1f} ms",
                          f"{1e3 * r['floor']['cpu_s']:.1f} ms (same bytes, plain send/recv)", "-",
                          f"{r['floor_ratio']:.3f}", "-", "- (diagnostic)", "-", "-"])
    if bytes_rows:
        t.at_most("bytes_bound", f"owners bytes per worker / ((own partials + 1) x gradient), worst of W = "
                  f"{BYTES_WORKERS[0]}..{BYTES_WORKERS[-1]}", max(r["bytes"]["owners"] / r["bound_bytes"]
                                                                 for r in bytes_rows), 1.0)
        # chunk sizes round to whole elements: the ratio is (partials + 1) / 2 within 1e-6, compared at 4 digits
        worst = round(max(r["ratio"]["owners"] for r in bytes_rows), 4)
        growth_met = t.at_most("bytes_growth", f"owners bytes per worker / the default all-reduce's, largest of "
                               f"W = {BYTES_WORKERS[0]}..{BYTES_WORKERS[-1]} at V = {VNS_PER_WORKER} W (slots: "
                               f"{max(r['ratio']['slots'] for r in bytes_rows):.0f})", worst, TARGET_BYTES_GROWTH)
    for r in bytes_rows:
        b = r["bytes"]
        met = b["owners"] <= r["bound_bytes"] and round(r["ratio"]["owners"], 4) <= TARGET_BYTES_GROWTH
        table.append(["bytes / worker / step", "mlp-25m", r["workers"], r["virtual_nodes"], "ring all-reduce",
                      mib(b["default"]), mib(b["owners"]), mib(b["slots"]), f"{r['ratio']['owners']:.2f}",
                      f"{r['ratio']['slots']:.2f}",
                      f"<= {r['max_partials'] + 1} x grad, <= {t.limit('bytes_growth', TARGET_BYTES_GROWTH):g} x "
                      f"all-reduce", H.yes_no(met and growth_met), "-"])
    if ddp is not None:
        met = t.at_most("ddp_ratio", "mlp-2.6m W=2: deterministic (owners) / DDP + no_sync step time",
                        ddp["ratio"], TARGET_RATIO)
        table.append(["vs DDP + no_sync", "mlp-2.6m", 2, 8, "DDP", f"{1e3 * ddp['ddp_median_step_s']:.1f} ms",
                      f"{1e3 * ddp['vf_median_step_s']:.1f} ms", "-", f"{ddp['ratio']:.3f}", "-",
                      f"<= {t.limit('ddp_ratio', TARGET_RATIO):g}", H.yes_no(met), f"{ddp['other_load_cores']:.2f}"])
    return table


def markdown(run: H.Run, args, table: list[list], ddp: dict | None, loaded: bool) -> str:
    mods = models()
    return "\n".join([
        f"# {run.name}: what deterministic mode costs (owners and slots exchanges)", "",
        H.env_markdown(), "",
        *(["**These figures are from a loaded machine** (other processes used the CPU while they were measured: "
           "the `other load` column, in cores); the step-time ratios are indicative only.", ""] if loaded else []),
        f"Step time: {args.steps} steps ({args.warmup} warm-up), {args.reps} repetitions per W and mode, 1 thread per "
        f"worker, gloo over loopback; the 2.6 M MLP is {mods['mlp-2.6m'].describe}, the 25 M MLP "
        f"{mods['mlp-25m'].describe}. `owners / baseline` = median over repetitions of the deterministic run's "
        f"median step time / the default run's. Bytes: simulated from the closed forms of "
        f"`virtualflow.plan.exchange` (the most any worker sends in one step's exchange; ring all-reduce = the "
        f"default mode's), V = {VNS_PER_WORKER} W, the 25 M MLP's gradient ({mods['mlp-25m'].params / 1e6:.1f} M "
        f"float32). vs DDP: interleaved pairs, B=256 in V=8 at 2 workers"
        + (f"; final weights differ by at most {ddp['max_abs_weight_diff']:.1e} (different summation orders: "
           f"within float tolerance, not bit-identical)." if ddp else "."), "",
        H.md_table(HEADER, table), "",
        f"Reproduce: `{run.command(NAME)}`"])


# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None):
    p = H.parser(__doc__, reps=3, reps_help="repetitions of each (model, W) and of the DDP pair", quiet_wait=60.0)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=8, help="steps excluded from the medians")
    p.add_argument("--models", default="mlp-2.6m,mlp-25m", help="models of the step-time part")
    p.add_argument("--workers", default=",".join(map(str, WORKERS)), help="worker counts of the step-time part")
    p.add_argument("--parts", default="steps,cpu,exchange,bytes,ddp",
                   help="which parts to run (steps, cpu, exchange, bytes, ddp)")
    p.add_argument("--exchange-steps", type=int, default=40, help="exchanges per repetition of the exchange part")
    p.add_argument("--cpu-workers", default="3", help="worker counts of the CPU-per-step part")
    p.add_argument("--cpu-steps", default="4,14", help="the short and the long run of the CPU-per-step part")
    p.add_argument("--max-other-load", type=float, default=0.10,
                   help="repeat a DDP pair when other processes used more CPU cores than this meanwhile")
    p.add_argument("--retries", type=int, default=1, help="repetitions of a disturbed DDP pair")
    p.add_argument("--child-ddp", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_ddp:
        return args
    if args.quick:
        args.steps, args.warmup, args.reps, args.quiet_wait = 14, 4, 1, min(args.quiet_wait, 10.0)
        args.exchange_steps = min(args.exchange_steps, 10)
    if args.steps <= args.warmup or args.warmup < 1:
        p.error(f"--steps={args.steps} must exceed --warmup={args.warmup} (at least 1)")
    known = models()
    args.model_list = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in args.model_list:
        if m not in known:
            p.error(f"--models: unknown model {m!r}; choose from {', '.join(known)}")
    args.worker_list = [int(x) for x in args.workers.split(",") if x.strip()]
    if any(w < 2 or w > 6 for w in args.worker_list):
        p.error(f"--workers {args.workers}: each must be 2..6 (V = 6 for the 25 M MLP)")
    args.part_list = [x.strip() for x in args.parts.split(",") if x.strip()]
    if not set(args.part_list) <= {"steps", "cpu", "exchange", "bytes", "ddp"} or not args.part_list:
        p.error(f"--parts {args.parts!r}: choose from steps, cpu, exchange, bytes, ddp")
    if args.exchange_steps < 1:
        p.error(f"--exchange-steps={args.exchange_steps} must be at least 1")
    args.cpu_worker_list = [int(x) for x in args.cpu_workers.split(",") if x.strip()]
    args.cpu_steps = [int(x) for x in args.cpu_steps.split(",")]
    if len(args.cpu_steps) != 2 or not 0 < args.cpu_steps[0] < args.cpu_steps[1]:
        p.error(f"--cpu-steps {args.cpu_steps}: two step counts, the short run's below the long run's")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child_ddp:
        print(json.dumps(H.ddp_rank(json.loads(args.child_ddp))))
        return 0
    H.apply_malloc_mode("stable")
    run = H.Run(NAME, args, TARGET_KEYS)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    print(H.banner("deterministic mode's cost: owners and slots exchanges against the default mode and DDP"))
    mods = models()
    numel = mods["mlp-25m"].params

    steps_rows = []
    if "steps" in args.part_list:
        for name in args.model_list:
            for w in args.worker_list:
                steps_rows.append(measure_steps(args, mods[name], w))
    cpu_rows = []
    if "cpu" in args.part_list:
        for name in args.model_list:
            for w in args.cpu_worker_list:
                H.wait_for_quiet(args.quiet_wait)
                cpu_rows.append(measure_cpu(args, mods[name], w))
    exchange_rows = []
    if "exchange" in args.part_list:
        H.wait_for_quiet(args.quiet_wait)
        exchange_rows = measure_exchange(args)
    bytes_rows = [bytes_row(w, numel) for w in BYTES_WORKERS] if "bytes" in args.part_list else []
    ddp = measure_ddp(args, tempfile.mkdtemp(prefix="deterministic-")) if "ddp" in args.part_list else None

    table = check(args, run, steps_rows, bytes_rows, ddp, numel, cpu_rows, exchange_rows)
    loads = [r["other_load_cores"] for r in steps_rows] + ([ddp["other_load_cores"]] if ddp else [])
    loaded = bool(loads) and max(loads) > args.max_other_load
    print()
    print(H.text_table(HEADER, table))
    config = {"steps": args.steps, "warmup": args.warmup, "reps": args.reps, "quick": args.quick,
              "models": {n: {"describe": mods[n].describe, "params": mods[n].params} for n in args.model_list},
              "workers": args.worker_list, "bytes_workers": list(BYTES_WORKERS), "vns_per_worker": VNS_PER_WORKER,
              "bytes_gradient_numel": numel, "itemsize": ITEMSIZE, "threads_per_worker": 1,
              "timing": "median of Result.history step_time_s after the warm-up steps; ratio = median over "
                        "repetitions of deterministic / default of the same repetition",
              "bytes": "virtualflow.plan.exchange closed forms: owners_traffic_closed_form (sent), slots_traffic, "
                       "ring_allreduce_bytes; the most any worker sends"}
    payload = {"benchmark": run.name, "environment": H.environment(), "config": config, "loaded_machine": loaded,
               "results": {"steps": steps_rows, "cpu": cpu_rows, "exchange": exchange_rows, "bytes": bytes_rows,
                           "ddp": ddp}, "table": table}
    return run.finish(payload, markdown(run, args, table, ddp, loaded))


if __name__ == "__main__":
    sys.exit(main())
