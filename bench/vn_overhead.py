"""Virtual-node overhead: one virtualflow worker against a hand-written accumulation loop.

For V in {1, 8, 32} virtual nodes over a global batch of B = 256, the same MLP, data, seed and
optimizer are trained (a) by ``virtualflow.train(make_job, workers=1, ...)`` and (b) by the loop
a PyTorch user would write, in a fresh process with the same thread count::

    for step in range(S):
        xb, yb = X[idx], Y[idx]                  # the step's shuffled global batch
        opt.zero_grad()
        for v in range(V):                       # micro-batches of B/V samples
            loss = loss_fn(model, (xb[v*n:(v+1)*n], yb[v*n:(v+1)*n])) * (1 / V)
            loss.backward()
        opt.step()

Per-step time: virtualflow's ``Result.history[i]["step_time_s"]`` (measured inside the worker,
end of step to end of step), the loop's measured the same way; medians after warm-up steps,
runs interleaved (A B, then B A) to cancel machine noise. Target (issue): virtualflow
<= 1.02x the hand loop (key ``time_ratio``). Both runs compute the same thing: their final
weights are compared (key ``weight_diff``).

Memory: a process's own peak RSS (VmHWM) for both; a separate probe at B = 4096 (where
activations are large enough to see) checks that peak memory does not grow with V.

From the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.vn_overhead            # about 4-6 minutes
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.vn_overhead --quick    # about 2 minutes
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from typing import Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from bench import harness as H

NAME = "vn_overhead"
TARGET_KEYS = ("time_ratio", "weight_diff", "mem_growth_mib", "alt_time_ratio", "overhead_share")
MODULE = "bench.vn_overhead"
TARGET_RATIO = 1.02
TARGET_WEIGHT_DIFF = 1e-5
TARGET_OVERHEAD_SHARE = 0.02
SYNTHETIC_JOB = "examples/synthetic.py"


def make_job():
    """The job virtualflow trains (imported by the worker process)."""
    return H.mlp_job(NAME, virtual_nodes=1)


# --------------------------------------------------------------------------------------------
# (b) the hand-written loop, run as a child process: ``-m bench.vn_overhead --child-hand JSON``.


def hand_step(model: torch.nn.Module, X: torch.Tensor, Y: torch.Tensor, B: int, V: int,
              loss_fn: Callable = H.cross_entropy, make_optimizer: Callable = H.sgd) -> Callable[..., float]:
    """The hand-written loop's step for ``model`` (its own optimizer): ``step_fn(step)`` trains global
    step ``step`` (V micro-batches of B/V samples in virtualflow's data order) and returns the
    step's loss, read back as virtualflow reads it."""
    opt = make_optimizer(model.parameters())
    n = B // V

    def step_fn(step: int, control: int = 0) -> float:
        idx = H.batch_indices(len(X), B, step)  # same sample order as virtualflow's DataPlan
        xb, yb = X[idx], Y[idx]
        opt.zero_grad(set_to_none=True)
        loss_sum = torch.zeros(())
        for v in range(V):
            loss = loss_fn(model, (xb[v * n : (v + 1) * n], yb[v * n : (v + 1) * n])) * (1.0 / V)
            loss.backward()
            loss_sum += loss.detach()
        opt.step()
        return float(loss_sum)

    return step_fn


def promises_step(model: torch.nn.Module, opt: torch.optim.Optimizer, X: torch.Tensor, Y: torch.Tensor, B: int,
                  V: int, loss_fn: Callable) -> Callable[..., float]:
    """The hand loop plus the bookkeeping the engine's step cannot leave out, each piece in the
    cheapest form found for a CPU worker: each VN's random stream seeded with ``vn_seed(seed,
    step, vn)`` (one ``manual_seed`` of the generator, so that dropout masks do not depend on the
    worker), each VN's weighted loss read once as a Python float (``item()``) and checked for
    inf/NaN there (a bad VN skips the step on every worker), the statistics vector (bad flags, the
    loss, control and the breakdown's timing slots) made one tensor through NumPy, as it rides in
    the reduction, and read back with one ``tolist()``, and the breakdown's clock reads. No
    reduction, hooks, failure handling, BatchNorm or metrics: the floor of ``overhead_s`` for this
    job, not an engine. (A plainer form, stacking the losses and flagging them with tensor
    operations, cost 37-39 us a step against this one's 21-26 us; docs/benchmarks.md.)"""
    import numpy as np

    from virtualflow.plan.data import vn_seed

    gen = torch.default_generator  # what vn_generators() seeds on a CPU worker
    n = B // V
    now = time.perf_counter
    slots = [0.0] * 16  # control, compute and the breakdown's intervals of one worker

    def step_fn(step: int, control: int = 0) -> float:
        marks = [now()]
        idx = H.batch_indices(len(X), B, step)
        xb, yb = X[idx], Y[idx]
        opt.zero_grad(set_to_none=True)
        bad, total = [0.0] * V, 0.0
        for v in range(V):
            gen.manual_seed(vn_seed(H.SEED, step, v))
            marks.append(now())
            loss = loss_fn(model, (xb[v * n : (v + 1) * n], yb[v * n : (v + 1) * n])) * (1.0 / V)
            marks.append(now())
            loss.backward()
            marks.append(now())
            x = loss.item()
            if x - x != 0.0:  # NaN exactly when x is inf or NaN
                bad[v] = 1.0
            total += x
        values = torch.from_numpy(np.array(bad + [total] + slots, dtype=np.float32)).tolist()
        if any(values[:V]):
            raise FloatingPointError(f"a non-finite loss at step {step}")
        opt.step()
        marks.append(now())
        return values[V]

    return step_fn


def bare_glue(model: torch.nn.Module, opt: torch.optim.Optimizer, X: torch.Tensor, Y: torch.Tensor, B: int,
              V: int, loss_fn: Callable, steps: int) -> list[float]:
    """The bare hand loop's own ``overhead_s``: per step, the time outside its timed intervals (the
    batch's gather, each VN's loss call and backward, ``opt.step()``), as the breakdown counts
    the engine's. The VN's weight ``1/V`` is folded into the backward's seed gradient, as the
    engine folds it, so no multiplication is counted here. What is left is what any loop pays
    (dropping the gradients, a view per VN, the loop, the clock reads): the floor under
    :func:`promises_step`'s extra."""
    now = time.perf_counter
    n = B // V
    seed_grad = torch.tensor(1.0 / V)
    out = []
    for step in range(steps):
        t0 = now()
        a = now()
        idx = H.batch_indices(len(X), B, step)
        xb, yb = X[idx], Y[idx]
        timed = now() - a
        opt.zero_grad(set_to_none=True)
        for v in range(V):
            a = now()
            loss = loss_fn(model, (xb[v * n : (v + 1) * n], yb[v * n : (v + 1) * n]))
            b = now()
            loss.backward(seed_grad)
            timed += now() - b + b - a
        a = now()
        opt.step()
        end = now()
        out.append(end - t0 - timed - (end - a))
    return out


def hand_loop(cfg: dict) -> dict:
    threads, V, B, steps = cfg["threads"], cfg["V"], cfg["B"], cfg["steps"]
    torch.set_num_threads(threads)
    X, Y = H.bench_data().tensors
    torch.manual_seed(H.SEED)
    model = H.mlp()
    model.train()
    step_fn = hand_step(model, X, Y, B, V)
    times, losses, ends = [], [], []
    setup_mib = H.vmhwm_mib()
    faults_at = {}
    stop_file = cfg.get("stop_file")  # concurrent mode: run until the launcher creates this file
    if stop_file:
        open(cfg["ready_file"], "w").close()
    t_prev = time.perf_counter()
    for step in range(steps):
        if stop_file and os.path.exists(stop_file):
            steps = step
            break
        if step == cfg.get("warmup", 0):
            faults_at[step] = H.minor_faults()
        losses.append(step_fn(step))  # logged, as virtualflow reports each step's loss
        now = time.perf_counter()
        times.append(now - t_prev)
        ends.append(time.time())
        t_prev = now
    faults_at[steps] = H.minor_faults()
    (s0, f0), (s1, f1) = min(faults_at.items()), max(faults_at.items())
    if cfg.get("save"):
        torch.save(model.state_dict(), cfg["save"])
    return {"step_times": times, "losses": losses, "vmhwm_mib": H.vmhwm_mib(), "ru_maxrss_mib": H.ru_maxrss_mib(),
            "vmhwm_after_setup_mib": setup_mib, "faults_per_step": (f1 - f0) / max(1, s1 - s0), "step_ends": ends}


def run_hand(V: int, B: int, threads: int, steps: int, save: str | None = None, warmup: int = 0) -> dict:
    cfg = {"V": V, "B": B, "threads": threads, "steps": steps, "save": save, "warmup": warmup}
    return H.run_child(MODULE, ["--child-hand", json.dumps(cfg)], threads)


# --------------------------------------------------------------------------------------------
# Diagnostic (off by default): virtualflow (1 worker, 1 thread) and the hand loop (1 thread)
# running at the same time, one per core, compared over the same time window. Meant to cancel
# host noise while keeping the worker loop's costs; on this VM each vCPU's speed drifts on its
# own, so it did not (kept for machines where it does). The launcher's polling (about 2% of a
# core) is shared between the two here instead of being charged to virtualflow.


def run_concurrent(V: int, B: int, steps: int, warmup: int, tmp: str) -> dict:
    import virtualflow as vf

    stop, ready = os.path.join(tmp, f"stop-{V}"), os.path.join(tmp, f"ready-{V}")
    for f in (stop, ready):
        if os.path.exists(f):
            os.remove(f)
    cfg = {"V": V, "B": B, "threads": 1, "steps": 100 * steps, "warmup": 0, "stop_file": stop, "ready_file": ready}
    hand = H.spawn_child(MODULE, ["--child-hand", json.dumps(cfg)], 1)
    try:
        deadline = time.time() + 60
        while not os.path.exists(ready) and time.time() < deadline and hand.poll() is None:
            time.sleep(0.05)
        run_dir = os.path.join(tmp, f"concurrent-{V}")
        os.environ["VF_BENCH_EVAL_EVERY"] = "0"
        vf.train(make_job, workers=1, steps=steps, virtual_nodes=V, global_batch_size=B, threads_per_worker=1,
                 run_dir=run_dir)
    finally:
        open(stop, "w").close()
        out, err = hand.communicate(timeout=120)
    if hand.returncode != 0:
        raise RuntimeError(f"hand loop exited {hand.returncode}: {err[-2000:]}")
    h = json.loads(out.strip().splitlines()[-1])
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    vf_recs = recs[warmup:]
    lo = vf_recs[0]["time"] - vf_recs[0]["step_time_s"]
    hi = vf_recs[-1]["time"]
    hand_in = [t for t, end in zip(h["step_times"], h["step_ends"]) if lo + t <= end <= hi]
    vf_times = [r["step_time_s"] for r in vf_recs]
    return {"vf_step_times": vf_times, "hand_step_times_in_window": hand_in,
            "vf_median_step_s": H.median(vf_times), "hand_median_step_s": H.median(hand_in),
            "time_ratio": H.median(vf_times) / H.median(hand_in)}


# --------------------------------------------------------------------------------------------
# Diagnostic: virtualflow's step engine (internal API) and the hand loop alternating step by step
# in one process (``--child-alternating JSON``). Both see the same machine state within
# milliseconds, so host noise cancels; what remains is the engine's own per-step and per-VN cost.


def alternating(cfg: dict) -> dict:
    """Alternating steps in this process: the engine against the hand loop, or (``cfg["aa"]``) the
    hand loop against a second hand loop on its own model: the A/A check, which measures how far
    two identical loops differ here (placement of their tensors in memory, the machine), or
    (``cfg["floor"]``) the hand loop doing what the engine promises (:func:`promises_step`)
    against the bare hand loop; or (``cfg["glue"]``) the bare loop's own untimed time per step
    (:func:`bare_glue`), alone."""
    from virtualflow.comm.groups import Group
    from virtualflow.plan.data import DataPlan
    from virtualflow.runtime.engine import BatchLoader, VNEngine

    threads, V, B, steps = cfg["threads"], cfg["V"], cfg["B"], cfg["steps"]
    torch.set_num_threads(threads)
    if cfg.get("workload") == "synthetic":  # examples/synthetic.py's model, data, loss and optimizer
        job = H.load_file(SYNTHETIC_JOB)
        ds, make_model, loss_fn, make_opt = job.make_dataset(), job.make_model, job.mse_loss, job.make_optimizer
    else:
        ds, make_model, loss_fn, make_opt = H.bench_data(), H.mlp, H.cross_entropy, H.sgd
    X, Y = ds.tensors

    torch.manual_seed(H.SEED)
    model = make_model()
    if cfg.get("glue"):
        return {"glue_s": bare_glue(model, make_opt(model.parameters()), X, Y, B, V, loss_fn, steps)}
    if cfg.get("aa"):
        engine_step = hand_step(model, X, Y, B, V, loss_fn, make_opt)
    elif cfg.get("floor"):
        engine_step = promises_step(model, make_opt(model.parameters()), X, Y, B, V, loss_fn)
    else:
        engine = VNEngine(model, make_opt(model.parameters()), None, loss_fn,
                          DataPlan(len(ds), B, V, H.SEED), BatchLoader(ds, None), seed=H.SEED, batchnorm="mean",
                          deterministic=False, device=torch.device("cpu"))
        engine.set_membership(Group(0, 0, 1, None), [list(range(V))])
        engine_step = engine.step
    torch.manual_seed(H.SEED)
    ref = make_model()
    ref_step = hand_step(ref, X, Y, B, V, loss_fn, make_opt)

    t_engine, t_hand = [], []
    for step in range(steps):
        first_engine = step % 2 == 0  # alternate which goes first, too
        for which in (("e", "h") if first_engine else ("h", "e")):
            t0 = time.perf_counter()
            engine_step(step, 0) if which == "e" else ref_step(step)
            (t_engine if which == "e" else t_hand).append(time.perf_counter() - t0)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    return {"engine_step_times": t_engine, "hand_step_times": t_hand, "bit_identical": same}


# --------------------------------------------------------------------------------------------
# (a) virtualflow.


def run_vf(V: int, B: int, threads: int, steps: int, warmup: int = 0) -> dict:
    import virtualflow as vf

    os.environ["VF_BENCH_EVAL_EVERY"] = str(warmup)  # the worker samples its page faults at `warmup`
    cpu0, t0 = time.process_time(), time.perf_counter()
    result = vf.train(make_job, workers=1, steps=steps, virtual_nodes=V, global_batch_size=B,
                      threads_per_worker=threads)
    evals = [e for e in result.eval_history if "minor_faults" in e]
    faults = ((evals[-1]["minor_faults"] - evals[0]["minor_faults"]) / max(1, evals[-1]["step"] - evals[0]["step"])
              if len(evals) >= 2 else float("nan"))
    return {
        "faults_per_step": faults,
        "step_times": [h["step_time_s"] for h in result.history],
        "losses": [h["loss"] for h in result.history],
        "vmhwm_mib": result.metrics.get("vmhwm_mib"),
        "peak_rss_mib": result.peak_rss_mib.get(0),  # what virtualflow itself reports
        "launcher_cpu_s": time.process_time() - cpu0,
        "wall_s": time.perf_counter() - t0,
        "state_dict": result.state_dict,
    }


# --------------------------------------------------------------------------------------------
# The phases of a run.


def parse_args(argv: list[str] | None):
    p = H.parser(__doc__, reps=3, reps_help="interleaved repetitions (pairs) of every configuration",
                 quiet_wait=120.0)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=6, help="steps excluded from the medians")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--vns", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--mem-batch", type=int, default=4096, help="global batch of the memory probe (0: skip)")
    p.add_argument("--mem-steps", type=int, default=3)
    p.add_argument("--max-other-load", type=float, default=0.10,
                   help="repeat a pair of runs when other processes used more CPU cores than this meanwhile")
    p.add_argument("--retries", type=int, default=2, help="repetitions of a disturbed pair")
    p.add_argument("--malloc", choices=["stable", "default"], default="stable",
                   help="glibc allocator settings of every training process (see bench/harness/machine.py); "
                        "'default' writes vn_overhead_default_malloc.*")
    p.add_argument("--alt-reps", type=int, default=3,
                   help="fresh child processes per V for the alternating check (and as many A/A children)")
    p.add_argument("--synthetic-steps", type=int, default=300,
                   help="steps of examples/synthetic.py for the overhead_s share (0: skip)")
    p.add_argument("--floor-steps", type=int, default=1000,
                   help="steps of the promises' floor beside overhead_s (a hand loop doing only what the "
                        "engine promises, against the bare loop, in one process; 0: skip)")
    p.add_argument("--alt-steps", type=int, default=60,
                   help="steps of the in-process alternating diagnostic, per V, 1 thread (0: skip)")
    p.add_argument("--concurrent-steps", type=int, default=0,
                   help="steps of the side-by-side diagnostic (virtualflow and hand loop at once, 1 thread "
                        "each, one per core; 0: skip). Off by default: on this VM each core's speed drifts "
                        "independently, so it cancelled little noise (ratios 0.80-1.26 for the same code)")
    p.add_argument("--concurrent-reps", type=int, default=2)
    p.add_argument("--child-hand", help=argparse.SUPPRESS)
    p.add_argument("--child-alternating", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.reps, args.threads, args.mem_steps, args.alt_steps = 16, 4, 2, [1], 2, 40
        args.synthetic_steps, args.alt_reps, args.floor_steps = 150, 2, 500
    if not (args.child_hand or args.child_alternating) and (args.steps <= args.warmup or args.warmup < 1):
        p.error(f"--steps={args.steps} must exceed --warmup={args.warmup} (at least 1)")
    return args


def measure_timing(args, tmp: str) -> dict[tuple[int, int], dict]:
    """Interleaved pairs (virtualflow, hand loop) of every (threads, V) configuration."""
    configs = [(t, V) for t in args.threads for V in args.vns]
    raw = {c: {"vf": [], "hand": [], "max_abs_weight_diff": [], "max_abs_loss_diff": []} for c in configs}
    w = args.warmup
    for rep in range(args.reps):
        for k, (t, V) in enumerate(configs):
            save = os.path.join(tmp, f"hand-{t}-{V}.pt")
            runs = H.run_pair(
                {"vf": lambda: run_vf(V, args.batch, t, args.steps, w),
                 "hand": lambda: run_hand(V, args.batch, t, args.steps, save, w)},
                H.pair_order(rep + k, "vf", "hand"), max_other_cores=args.max_other_load, retries=args.retries,
                quiet_wait_s=args.quiet_wait, label=f"rep {rep} threads={t} V={V}")
            a, b = runs["vf"], runs["hand"]
            d = raw[(t, V)]
            d["max_abs_weight_diff"].append(H.state_max_abs_diff(a.pop("state_dict"), torch.load(save)))
            d["max_abs_loss_diff"].append(max(abs(x - y) for x, y in zip(a["losses"], b["losses"])))
            d["vf"].append(a)
            d["hand"].append(b)
            ma, mb = H.median(a["step_times"][w:]), H.median(b["step_times"][w:])
            print(f"  rep {rep} threads={t} V={V:>2}: virtualflow {1e3 * ma:7.2f} ms, hand {1e3 * mb:7.2f} ms, "
                  f"ratio {ma / mb:.3f}", flush=True)
    return raw


def timing_row(t: int, V: int, d: dict, args, targets: H.Targets) -> dict:
    w = args.warmup
    vf_runs, hand_runs = d["vf"], d["hand"]
    vf_all = [x for r in vf_runs for x in r["step_times"][w:]]
    hand_all = [x for r in hand_runs for x in r["step_times"][w:]]
    vf_times, hand_times = [r["step_times"] for r in vf_runs], [r["step_times"] for r in hand_runs]
    per_rep = H.paired_ratios(vf_times, hand_times, w)
    ratio = H.median(per_rep)
    med = lambda key, runs: H.median([r[key] for r in runs])  # noqa: E731
    met = targets.at_most("time_ratio", f"threads={t} V={V}: virtualflow / hand loop step time (median of pairs)",
                          ratio, TARGET_RATIO)
    return {
        "threads": t, "virtual_nodes": V, "micro_batch": args.batch // V,
        "vf_median_step_s": H.median(vf_all), "hand_median_step_s": H.median(hand_all),
        "time_ratio": ratio,
        "time_ratio_per_rep": per_rep,
        "pooled_time_ratio": H.median(vf_all) / H.median(hand_all),
        "p25_time_ratio": H.median(H.paired_ratios(vf_times, hand_times, w, H.p25)),
        "target_time_ratio": targets.limit("time_ratio", TARGET_RATIO), "target_met": met,
        "vf_vmhwm_mib": med("vmhwm_mib", vf_runs),
        "hand_vmhwm_mib": med("vmhwm_mib", hand_runs),
        "mem_ratio": med("vmhwm_mib", vf_runs) / med("vmhwm_mib", hand_runs),
        "vf_reported_peak_rss_mib": med("peak_rss_mib", vf_runs),
        "hand_ru_maxrss_mib": med("ru_maxrss_mib", hand_runs),
        "vf_launcher_cpu_s_per_run": med("launcher_cpu_s", vf_runs),
        "vf_minor_faults_per_step": med("faults_per_step", vf_runs),
        "hand_minor_faults_per_step": med("faults_per_step", hand_runs),
        "max_abs_weight_diff": max(d["max_abs_weight_diff"]),
        "max_abs_loss_diff": max(d["max_abs_loss_diff"]),
        "raw": {"vf_step_times": vf_times, "hand_step_times": hand_times,
                "vf_vmhwm_mib": [r["vmhwm_mib"] for r in vf_runs],
                "hand_vmhwm_mib": [r["vmhwm_mib"] for r in hand_runs],
                "hand_vmhwm_after_setup_mib": [r["vmhwm_after_setup_mib"] for r in hand_runs],
                "vf_wall_s": [r["wall_s"] for r in vf_runs],
                "vf_other_load_cores": [r["other_load_cores"] for r in vf_runs],
                "hand_other_load_cores": [r["other_load_cores"] for r in hand_runs],
                "attempts": [r["attempt"] + 1 for r in vf_runs]},
    }


def memory_probe(args, targets: H.Targets) -> tuple[list[dict], dict | None]:
    """Peak memory at a large batch, V = 1 and 32: it must not grow with V."""
    mem_rows = []
    if not args.mem_batch:
        return mem_rows, None
    for k, V in enumerate(v for v in (1, 32) if args.mem_batch % v == 0):
        runs = H.run_pair(
            {"vf": lambda: run_vf(V, args.mem_batch, 1, args.mem_steps),
             "hand": lambda: run_hand(V, args.mem_batch, 1, args.mem_steps)},
            H.pair_order(k, "vf", "hand"), max_other_cores=args.max_other_load, retries=args.retries,
            quiet_wait_s=args.quiet_wait, label=f"memory probe V={V}")
        vf_run, hand = runs["vf"], runs["hand"]
        vf_run.pop("state_dict")
        mem_rows.append({
            "virtual_nodes": V, "global_batch": args.mem_batch, "micro_batch": args.mem_batch // V,
            "vf_vmhwm_mib": vf_run["vmhwm_mib"], "hand_vmhwm_mib": hand["vmhwm_mib"],
            "mem_ratio": vf_run["vmhwm_mib"] / hand["vmhwm_mib"],
            "hand_vmhwm_after_setup_mib": hand["vmhwm_after_setup_mib"],
            "vf_reported_peak_rss_mib": vf_run["peak_rss_mib"],
            "hand_ru_maxrss_mib": hand["ru_maxrss_mib"],
            "other_load_cores": max(vf_run["other_load_cores"], hand["other_load_cores"]),
        })
        print(f"  memory probe B={args.mem_batch} V={V:>2}: virtualflow VmHWM {vf_run['vmhwm_mib']:.1f} MiB, "
              f"hand {hand['vmhwm_mib']:.1f} MiB", flush=True)
    if len(mem_rows) != 2:
        return mem_rows, None
    lo, hi = mem_rows
    growth = hi["vf_vmhwm_mib"] - lo["vf_vmhwm_mib"]
    claim = {"vf_peak_V32_minus_V1_mib": growth,
             "hand_peak_V32_minus_V1_mib": hi["hand_vmhwm_mib"] - lo["hand_vmhwm_mib"],
             "vf_peak_does_not_grow_with_V": targets.at_most(
                 "mem_growth_mib", f"virtualflow peak memory V=32 minus V=1 at B={args.mem_batch} (MiB)", growth, 1.0)}
    return mem_rows, claim


def concurrent_diagnostic(args, tmp: str) -> list[dict]:
    """virtualflow and the hand loop side by side, 1 thread each (off by default)."""
    rows = []
    if args.concurrent_steps <= args.warmup:
        return rows
    for V in args.vns:
        runs = []
        for _ in range(args.concurrent_reps):
            H.wait_for_quiet(args.quiet_wait)
            runs.append(run_concurrent(V, args.batch, args.concurrent_steps, args.warmup, tmp))
        ratios = [r["time_ratio"] for r in runs]
        rows.append({"threads": 1, "virtual_nodes": V, "time_ratio": H.median(ratios), "time_ratio_per_rep": ratios,
                     "vf_median_step_s": H.median([r["vf_median_step_s"] for r in runs]),
                     "hand_median_step_s": H.median([r["hand_median_step_s"] for r in runs]), "raw": runs})
        print(f"  side by side V={V:>2}: virtualflow {1e3 * rows[-1]['vf_median_step_s']:7.2f} ms, hand "
              f"{1e3 * rows[-1]['hand_median_step_s']:7.2f} ms, ratios {' '.join(f'{x:.3f}' for x in ratios)}",
              flush=True)
    return rows


def alternating_diagnostic(args, targets: H.Targets) -> list[dict]:
    """VNEngine.step and the hand loop alternating step by step, in ``--alt-reps`` fresh child
    processes per V (each places its tensors anew), and the A/A check beside it (two hand loops,
    the same way). Target: the median over the children of the engine's median step / the hand
    loop's <= 1.02 at every V (key ``alt_time_ratio``); the A/A ratios say how finely this
    machine resolves it."""
    rows = []
    if args.alt_steps <= args.warmup:
        return rows
    # The bench MLP at every V (the targets), then examples/synthetic.py's model and batches (B = 64
    # in 8 VNs of 8 samples, a step of well under a millisecond on one worker): a diagnostic of the
    # engine's own cost where its per-VN work weighs most (the overhead_s share below is measured there).
    cases = [("mlp", V, args.batch) for V in args.vns] + ([("synthetic", 8, 64)] if args.synthetic_steps else [])
    for workload, V, B in cases:
        ratios: dict[str, list[float]] = {"engine": [], "aa": []}
        raws, same = [], True
        for rep in range(args.alt_reps):
            for kind in ("engine", "aa"):
                cfg = {"V": V, "B": B, "threads": 1, "steps": args.alt_steps, "aa": kind == "aa", "workload": workload}
                H.wait_for_quiet(args.quiet_wait)
                r = H.run_child(MODULE, ["--child-alternating", json.dumps(cfg)], 1)
                e, h = r["engine_step_times"][args.warmup:], r["hand_step_times"][args.warmup:]
                ratios[kind].append(H.median(e) / H.median(h))
                same = same and r["bit_identical"]
                if kind == "engine":
                    raws.append(r)
        e = [x for r in raws for x in r["engine_step_times"][args.warmup:]]
        h = [x for r in raws for x in r["hand_step_times"][args.warmup:]]
        ratio = H.median(ratios["engine"])
        rows.append({"workload": workload, "batch": B, "threads": 1, "virtual_nodes": V, "engine_median_step_s": H.median(e),
                     "hand_median_step_s": H.median(h), "time_ratio": ratio, "ratios": ratios["engine"],
                     "aa_ratios": ratios["aa"], "p25_time_ratio": H.p25(e) / H.p25(h),
                     "extra_per_vn_us": 1e6 * (H.median(e) - H.median(h)) / V, "bit_identical": same, "raw": raws})
        name = f"V={V:>2}" if workload == "mlp" else f"examples/synthetic.py (B={B}, V={V})"
        print(f"  alternating {name}: engine {1e3 * H.median(e):7.2f} ms, hand {1e3 * H.median(h):7.2f} ms, "
              f"ratios {' '.join(f'{x:.3f}' for x in ratios['engine'])} (A/A "
              f"{' '.join(f'{x:.3f}' for x in ratios['aa'])})", flush=True)
        if workload == "mlp":
            targets.at_most("alt_time_ratio", f"alternating in one process, V={V}: VNEngine.step / hand loop step "
                            f"(median of {args.alt_reps} processes)", ratio, TARGET_RATIO)
        targets.holds(f"alternating {name.strip()}: the engine's weights equal the hand loop's, bit for bit", same)
    return rows


def synthetic_overhead(args, targets: H.Targets) -> dict | None:
    """``examples/synthetic.py`` (2 workers, B = 64 in 8 VNs: a step of a few ms) through
    ``virtualflow.train``: the breakdown's ``overhead_s`` (the engine's own bookkeeping inside the
    step) as a share of ``step_s``, median over workers and post-warm-up steps. Target (key
    ``overhead_share``): <= 2 %."""
    if args.synthetic_steps <= args.warmup:
        return None
    import virtualflow as vf

    H.wait_for_quiet(args.quiet_wait)
    result = vf.train(H.repo_path(SYNTHETIC_JOB) + ":make_job", workers=2, steps=args.synthetic_steps,
                      threads_per_worker=1)
    rows = [b for h in result.history[args.warmup:] for b in (h.get("breakdown") or [])]
    if not rows:
        targets.holds("examples/synthetic.py: a step breakdown was reported", False, "no breakdown in the history")
        return None
    parts = {k: H.median([b[k] for b in rows]) for k in ("step_s", "forward_s", "backward_s", "optimizer_s",
                                                          "reduction_s", "straggler_s", "overhead_s", "control_s")}
    share = H.median([b["overhead_s"] / b["step_s"] for b in rows])
    print(f"  examples/synthetic.py, 2 workers: step {1e3 * parts['step_s']:.2f} ms, overhead_s "
          f"{1e3 * parts['overhead_s']:.3f} ms ({100 * share:.1f} %)", flush=True)
    targets.at_most("overhead_share", "examples/synthetic.py (2 workers): the breakdown's overhead_s / step_s "
                    "(median)", share, TARGET_OVERHEAD_SHARE)
    return {"steps": args.synthetic_steps, "median_ms": {k: 1e3 * v for k, v in parts.items()},
            "overhead_share": share, "floor": promises_floor(args, parts["step_s"])}


def promises_floor(args, step_s: float) -> dict | None:
    """Diagnostic beside ``overhead_share``: the least ``overhead_s`` a loop keeping the engine's
    promises can have on one worker's share of examples/synthetic.py at 2 workers (4 VNs of 8
    samples), in ``--alt-reps`` fresh processes: the bare hand loop's own untimed time
    (:func:`bare_glue`) plus what the promises add to it at the least (:func:`promises_step`
    against the bare loop, alternating in one process; with the A/A check beside it). ``step_s``:
    the 2-worker step measured by :func:`synthetic_overhead`, of which the target allows 2 %."""
    if args.floor_steps <= args.warmup:
        return None
    V, B = 4, 32
    out: dict[str, list[float]] = {"floor_us": [], "floor_share": [], "aa_share": [], "glue_us": []}
    for _ in range(args.alt_reps):
        for kind in ("floor", "aa", "glue"):
            cfg = {"V": V, "B": B, "threads": 1, "steps": args.floor_steps, "workload": "synthetic", kind: True}
            H.wait_for_quiet(args.quiet_wait)
            r = H.run_child(MODULE, ["--child-alternating", json.dumps(cfg)], 1)
            if kind == "glue":
                out["glue_us"].append(1e6 * H.median(r["glue_s"][args.warmup:]))
                continue
            e, h = H.median(r["engine_step_times"][args.warmup:]), H.median(r["hand_step_times"][args.warmup:])
            if kind == "floor":
                out["floor_us"].append(1e6 * (e - h))
                out["floor_share"].append(e / h - 1)
            else:
                out["aa_share"].append(e / h - 1)
    floor = {k: H.median(v) for k, v in out.items()} | {"runs": out, "steps": args.floor_steps, "V": V, "B": B}
    floor["of_step_share"] = 1e-6 * floor["floor_us"] / step_s
    floor["total_us"] = floor["glue_us"] + floor["floor_us"]
    floor["total_share"] = 1e-6 * floor["total_us"] / step_s
    print(f"  the floor of overhead_s (examples/synthetic.py, one worker's 4 VNs of 8 samples, in one process; the "
          f"target's 2 % of the step is {1e6 * TARGET_OVERHEAD_SHARE * step_s:.0f} us): the bare loop's own untimed "
          f"time {floor['glue_us']:.0f} us + the promises {floor['floor_us']:.0f} us "
          f"({100 * floor['floor_share']:.1f} % of the bare loop's step; A/A "
          f"{' '.join(f'{100 * x:+.1f}' for x in out['aa_share'])} %) = {floor['total_us']:.0f} us a step, "
          f"{100 * floor['total_share']:.1f} % of the 2-worker step", flush=True)
    return floor


# --------------------------------------------------------------------------------------------
# Report.

TIMING_HEADER = ["threads", "V", "B/V", "virtualflow ms", "hand ms", "time ratio", "per-pair ratios", "p25 ratio",
                 f"<= {TARGET_RATIO}", "vf VmHWM MiB", "hand VmHWM MiB", "mem ratio", "vf reported peak MiB",
                 "faults/step vf, hand"]
MEM_HEADER = ["B", "V", "B/V", "vf VmHWM MiB", "hand VmHWM MiB", "mem ratio", "vf reported peak MiB",
              "hand ru_maxrss MiB"]
ALT_HEADER = ["workload", "V", "engine ms", "hand ms", "ratio", "per-process ratios", "A/A ratios", "extra us/VN",
              "bit-identical"]
CONC_HEADER = ["V", "virtualflow ms", "hand ms", "ratio", "per-rep ratios"]


def tables(rows, mem_rows, alt_rows, conc_rows) -> dict[str, tuple[list, list]]:
    timing = [[r["threads"], r["virtual_nodes"], r["micro_batch"], f"{1e3 * r['vf_median_step_s']:.2f}",
               f"{1e3 * r['hand_median_step_s']:.2f}", f"{r['time_ratio']:.3f}",
               " ".join(f"{x:.3f}" for x in r["time_ratio_per_rep"]), f"{r['p25_time_ratio']:.3f}",
               H.yes_no(r["target_met"]), f"{r['vf_vmhwm_mib']:.1f}", f"{r['hand_vmhwm_mib']:.1f}",
               f"{r['mem_ratio']:.3f}", f"{r['vf_reported_peak_rss_mib']:.1f}",
               f"{r['vf_minor_faults_per_step']:.0f}, {r['hand_minor_faults_per_step']:.0f}"] for r in rows]
    mem = [[r["global_batch"], r["virtual_nodes"], r["micro_batch"], f"{r['vf_vmhwm_mib']:.1f}",
            f"{r['hand_vmhwm_mib']:.1f}", f"{r['mem_ratio']:.3f}", f"{r['vf_reported_peak_rss_mib']:.1f}",
            f"{r['hand_ru_maxrss_mib']:.1f}"] for r in mem_rows]
    alt = [[("examples/synthetic.py (B=64, diagnostic)" if r.get("workload") == "synthetic" else f"MLP (B={r.get('batch', '')})"),
            r["virtual_nodes"], f"{1e3 * r['engine_median_step_s']:.2f}", f"{1e3 * r['hand_median_step_s']:.2f}",
            f"{r['time_ratio']:.3f}", " ".join(f"{x:.3f}" for x in r["ratios"]),
            " ".join(f"{x:.3f}" for x in r["aa_ratios"]), f"{r['extra_per_vn_us']:.0f}",
            H.yes_no(r["bit_identical"])] for r in alt_rows]
    conc = [[r["virtual_nodes"], f"{1e3 * r['vf_median_step_s']:.2f}", f"{1e3 * r['hand_median_step_s']:.2f}",
             f"{r['time_ratio']:.3f}", " ".join(f"{x:.3f}" for x in r["time_ratio_per_rep"])] for r in conc_rows]
    return {"timing": (TIMING_HEADER, timing), "memory": (MEM_HEADER, mem), "alternating": (ALT_HEADER, alt),
            "side_by_side": (CONC_HEADER, conc)}


def markdown(run: H.Run, args, malloc_env: dict, t: dict, mem_claim: dict | None,
             synthetic: dict | None = None) -> str:
    md = [f"# {run.name}: one virtualflow worker vs a hand-written accumulation loop", "", H.env_markdown(), "",
          f"Workload: {H.MLP_DESCRIPTION} ({H.param_count() / 1e6:.2f} M params), SGD lr=0.01 momentum=0.9, "
          f"global batch {args.batch}, {args.steps} steps ({args.warmup} warm-up), {args.reps} interleaved "
          f"repetitions. Time ratio = median over interleaved pairs of virtualflow's median step time / the "
          f"hand loop's (target <= {TARGET_RATIO}); p25 ratio = the same with lower-quartile step times. "
          f"Memory = each training process's own peak RSS (VmHWM). Allocator: {args.malloc} "
          f"({malloc_env or 'glibc defaults'}, the same for both sides; see bench/harness/machine.py).", "",
          H.md_table(*t["timing"])]
    if t["memory"][1]:
        md += ["", f"Memory probe (B={args.mem_batch}, 1 thread, {args.mem_steps} steps): peak memory must not "
                   f"grow with V.", "", H.md_table(*t["memory"])]
        if mem_claim:
            md += ["", f"Peak V=32 minus V=1: virtualflow {mem_claim['vf_peak_V32_minus_V1_mib']:+.1f} MiB, "
                       f"hand loop {mem_claim['hand_peak_V32_minus_V1_mib']:+.1f} MiB."]
    if t["side_by_side"][1]:
        md += ["", f"Diagnostic (host noise cancelled, worker loop included): virtualflow (1 worker) and the hand "
                   f"loop running at the same time, 1 thread each (one per core), {args.concurrent_steps} virtualflow "
                   f"steps ({args.warmup} warm-up) against the hand-loop steps in the same time window, "
                   f"{args.concurrent_reps} repetitions. The launcher's polling is shared by both here.", "",
               H.md_table(*t["side_by_side"])]
    if t["alternating"][1]:
        md += ["", f"Alternating in one process (host noise cancelled; target <= {TARGET_RATIO} at every V): "
                   f"virtualflow's `VNEngine.step` and the hand loop alternating step by step, 1 thread, "
                   f"{args.alt_steps} steps each ({args.warmup} warm-up). This isolates the engine's own cost from "
                   f"worker-process effects. The hand loop reads the data order one epoch at a time (as a "
                   f"sampler does); the engine computes it a block of steps at a time.", "",
               H.md_table(*t["alternating"])]
    if synthetic:
        md += ["", f"`overhead_s` on examples/synthetic.py (2 workers, {synthetic['steps']} steps): "
                   f"{synthetic['median_ms']['overhead_s']:.3f} ms of a {synthetic['median_ms']['step_s']:.2f} ms step, "
                   f"{100 * synthetic['overhead_share']:.1f} % (target <= {100 * TARGET_OVERHEAD_SHARE:.0f} %)."]
        f = synthetic.get("floor")
        if f:
            md += ["", f"The floor of `overhead_s` (diagnostic), on one worker's share at 2 workers ({f['V']} VNs of "
                       f"{f['B'] // f['V']} samples), {f['steps']} steps, {len(f['runs']['floor_us'])} processes: the "
                       f"bare hand loop's own untimed time (dropping the gradients, a view per VN, the loop, the "
                       f"clock reads; the VN weight folded into the backward's seed gradient, as the engine does) "
                       f"{f['glue_us']:.0f} us, plus what a hand loop doing only what the step promises, each in "
                       f"the cheapest form found (each VN's random stream seeded, its weighted loss read once and "
                       f"checked for inf/NaN, the statistics vector packed through NumPy and read back, the "
                       f"breakdown's clock reads), adds to the bare loop alternating with it in one process: "
                       f"{f['floor_us']:.0f} us (per process "
                       f"{' '.join(f'{100 * x:.1f}' for x in f['runs']['floor_share'])} % of the bare loop's step; "
                       f"A/A {' '.join(f'{100 * x:+.1f}' for x in f['runs']['aa_share'])} %). Together "
                       f"{f['total_us']:.0f} us a step, **{100 * f['total_share']:.1f} %** of the 2-worker step above "
                       f"(the target allows {100 * TARGET_OVERHEAD_SHARE:.0f} %), before anything an engine adds "
                       f"(the reduction, failure handling, control, BatchNorm, metrics)."]
    md += ["", "`vf reported peak` is `Result.peak_rss_mib` as virtualflow reports it, read when the worker "
               "exits (after writing the final state). Up to commit e402a8c it was ru_maxrss, which on Linux "
               "carries the launching process's RSS across exec; from b277f06 on it is the worker's own VmHWM.",
           "", f"Reproduce: `{run.command(NAME, ' --malloc default' if args.malloc == 'default' else '')}`"]
    return "\n".join(md)


def print_tables(t: dict, rows: list[dict], mem_claim: dict | None, args) -> None:
    print()
    print(H.text_table(*t["timing"]))
    if t["memory"][1]:
        print()
        print(H.text_table(*t["memory"]))
        if mem_claim:
            print(f"  peak V=32 - V=1 at B={args.mem_batch}: virtualflow "
                  f"{mem_claim['vf_peak_V32_minus_V1_mib']:+.1f} MiB, hand {mem_claim['hand_peak_V32_minus_V1_mib']:+.1f} MiB")
    if t["side_by_side"][1]:
        print("\n  diagnostic: virtualflow (1 worker) and the hand loop side by side, 1 thread each, one per core")
        print(H.text_table(*t["side_by_side"]))
    if t["alternating"][1]:
        print("\n  diagnostic: VNEngine.step and the hand loop alternating step by step in one process (1 thread)")
        print(H.text_table(*t["alternating"]))
    print(f"  same computation: max |weight diff| {max(r['max_abs_weight_diff'] for r in rows):.2e}, "
          f"max |loss diff| {max(r['max_abs_loss_diff'] for r in rows):.2e}")


def run_config(args, malloc_env: dict) -> dict:
    """What was run and how it was measured (the JSON's ``config``)."""
    return {"steps": args.steps, "warmup": args.warmup, "reps": args.reps, "threads": args.threads,
            "virtual_nodes": args.vns, "global_batch": args.batch, "quick": args.quick,
            "model": H.MLP_DESCRIPTION, "params": H.param_count(), "optimizer": "SGD lr=0.01 momentum=0.9",
            "dataset": f"synthetic {H.DATASET_SIZE}x{H.IN_FEATURES}",
            "mem_batch": args.mem_batch, "mem_steps": args.mem_steps,
            "max_other_load_cores": args.max_other_load, "retries": args.retries,
            "malloc": args.malloc, "malloc_env": malloc_env,
            "virtualflow_source": H.vf_source(),
            "timing": "per-step: end of step to end of step inside the training process. 'time ratio' = "
                      "median over interleaved pairs of (virtualflow median step / hand median step), "
                      "post-warm-up steps; 'ms' columns = medians pooled over all pairs; 'p25 ratio' = the "
                      "same paired ratio of lower-quartile step times (less sensitive to host noise)",
            "memory": "VmHWM = the process's own peak RSS (virtualflow: read by the worker after the last "
                      "step, through Job.evaluate); 'vf reported peak' = Result.peak_rss_mib (ru_maxrss up to "
                      "e402a8c, which includes the launcher's RSS inherited across exec; VmHWM at worker exit "
                      "from b277f06)"}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child_hand:
        print(json.dumps(hand_loop(json.loads(args.child_hand))))
        return 0
    if args.child_alternating:
        print(json.dumps(alternating(json.loads(args.child_alternating))))
        return 0
    malloc_env = H.apply_malloc_mode(args.malloc)
    run = H.Run(NAME if args.malloc == "stable" else f"{NAME}_default_malloc", args, TARGET_KEYS)
    torch.set_num_threads(1)  # the launcher does no real compute; leave the cores to the worker
    logging.basicConfig(level=logging.WARNING)
    print(H.banner(f"virtualflow VN overhead: 1 worker vs hand-written accumulation loop "
                   f"(MLP {H.param_count() / 1e6:.2f} M params, B={args.batch}, SGD momentum)"))
    print(f"  allocator: {args.malloc} {malloc_env or '(glibc defaults)'}")
    tmp = tempfile.mkdtemp(prefix="vn_overhead-")

    raw = measure_timing(args, tmp)
    rows = [timing_row(t, V, d, args, run.targets) for (t, V), d in raw.items()]
    weight_diff = max(r["max_abs_weight_diff"] for r in rows)
    run.targets.at_most("weight_diff", "same computation: max |final weight difference|, virtualflow vs hand loop",
                        weight_diff, TARGET_WEIGHT_DIFF)
    mem_rows, mem_claim = memory_probe(args, run.targets)
    conc_rows = concurrent_diagnostic(args, tmp)
    alt_rows = alternating_diagnostic(args, run.targets)
    synthetic = synthetic_overhead(args, run.targets)

    t = tables(rows, mem_rows, alt_rows, conc_rows)
    config = run_config(args, malloc_env)
    payload = {"benchmark": run.name, "environment": H.environment(), "config": config, "results": rows,
               "alternating_diagnostic": alt_rows, "side_by_side_diagnostic": conc_rows,
               "synthetic_overhead": synthetic,
               "memory_probe": mem_rows, "memory_claim": mem_claim, "target_time_ratio": TARGET_RATIO}
    print_tables(t, rows, mem_claim, args)
    return run.finish(payload, markdown(run, args, malloc_env, t, mem_claim, synthetic))


if __name__ == "__main__":
    sys.exit(main())
