"""Bamboo's redundant stages (issue 16): what ``Pipeline(redundancy=True)`` costs a pipelined job
trained through ``virtualflow.train``, the restart/checkpoint times, and the constants the spot
simulator (``virtualflow simulate-spot``) reads from ``bench/results/bamboo.json``.

What exists in the engine (and so what this measures): every worker keeps a replica of its
successor's stage, refreshed every step from the successor's reduced gradients (one extra
point-to-point message of the stage's gradient size per worker per step, sent after the
reduction and before the step commits, and a duplicate optimizer step on the replica); a lost
middle worker is covered by its predecessor, which runs the lost stage from its replica
(failover, the interrupted step redone). **Eager redundant forward computation does not exist**
(the overhead is the replica refresh's alone); the reconfiguration pause is not measured here
yet: it stays the simulator's documented default and is listed as such.

1. **Redundancy overhead.** The same job with and without ``redundancy=True``, ``virtualflow.train``
   (local backend, one worker process per stage, 1 thread each), 1F1B, interleaved pairs (the
   order swapped every pair), per run the median step time after warm-up; overhead = median over
   pairs of (step with / step without); target <= 1.15 (key ``redundancy_overhead``). The layers
   are SLEEP-EMULATED Linear(H, H) layers: each holds a real H x H weight and bias (so the
   gradient message, the optimizer and the replica's duplicate optimizer step are real costs of
   real sizes) but sleeps instead of multiplying: forward and backward sleep the time the real
   ``nn.Linear`` forward / backward took on this machine at the same micro-batch (calibrated at
   start, 1 thread), so compute and parameters keep a real layer's proportion while the worker
   processes overlap on 2 cores as they would on their own devices. The weight gradient a
   backward returns is a fixed tensor of the weight's size (accumulated by autograd as a real one
   would be). Default 2 stages (one process per core: the replica's extra CPU work does not
   compete with another stage for a core); ``--stages 4`` runs 4 processes on 2 cores.
   Replica bytes: ``StageReplica.nbytes()`` after a step, in-process (``build_engine`` +
   ``LocalDriver``), checked against the successor's parameters + buffers + optimizer state;
   extra bytes per step: the replica message's tensors (gradients + BatchNorm statistics +
   buffers) per worker, summed over the workers. Diagnostic: the replica's duplicate optimizer
   step (``StageReplica.apply``) timed in-process.
2. **Failover**: ``--failover-stages`` stages (4), one pipeline, a middle worker SIGKILLs itself
   (``FaultPlan``) at the start of a step: failover = end of the step before -> end of the redone
   step (target <= 1 s, key ``failover_s``); slowdown = step after / before (target <= 1.5x, key
   ``failover_slowdown``); every step once.
3. **Restart and checkpoint.** A redundant run with ``checkpoint_every`` (the ``checkpoint``
   reports' ``save_s`` when the run's events have them, and the pause the checkpoint leaves
   between two steps in metrics.jsonl), then ``virtualflow.train(..., resume=RUN_DIR)`` on fresh
   processes: restart = launch call -> end of the first resumed step, minus a normal step.
4. **Constants** for ``SpotConstants`` (``constants`` object; ``constants_sources`` beside it
   names each constant's source, measured or default) and, when ``virtualflow.cluster.spot`` is
   importable, the simulator's replay of the shipped p2 trace with them (the simulator's output,
   not a measurement).

From the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.bamboo            # about 5 minutes
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.bamboo --quick    # under 2 minutes
"""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from torch import nn
from torch.utils.data import TensorDataset

from bench import harness as H

NAME = "bamboo"
TARGET_KEYS = ("redundancy_overhead", "failover_slowdown", "failover_s")
TARGET_OVERHEAD = 1.15
TARGET_FAILOVER_SLOWDOWN = 1.5
TARGET_FAILOVER_S = 1.0
SEED = H.SEED
P2_TRACE = "p2-xlarge-2020-11-20-hours"
NOT_MEASURED = "default, not measured"


# --------------------------------------------------------------------------------------------
# The workload: sleep-emulated Linear layers with real parameters (imported by the workers).


class _EmulatedLinear(torch.autograd.Function):
    """Identity on the activations that sleeps ``f_s`` forward and ``b_s`` backward and gives the
    weight and bias the fixed gradients ``gw``, ``gb`` (autograd accumulates them as real ones)."""

    @staticmethod
    def forward(ctx, x, weight, bias, f_s: float, b_s: float, gw, gb):
        ctx.b_s, ctx.gw, ctx.gb = b_s, gw, gb
        time.sleep(f_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.b_s)
        return grad, ctx.gw, ctx.gb, None, None, None, None


class EmulatedLinear(nn.Module):
    """An ``nn.Linear(width, width)``'s parameters; compute replaced by sleeps (``VF_BAMBOO_F_S`` /
    ``VF_BAMBOO_B_S`` seconds per micro-batch, set by the launcher from its calibration)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width ** 0.5)
        self.bias = nn.Parameter(torch.zeros(width))
        # Plain attributes, not buffers: buffers travel in the replica message.
        self._gw = torch.full((width, width), 1e-4)
        self._gb = torch.full((width,), 1e-4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _EmulatedLinear.apply(x, self.weight, self.bias, float(os.environ.get("VF_BAMBOO_F_S", "0.002")),
                                     float(os.environ.get("VF_BAMBOO_B_S", "0.004")), self._gw, self._gb)


def _width() -> int:
    return int(os.environ.get("VF_BAMBOO_WIDTH", "1024"))


def _layers() -> int:
    return int(os.environ.get("VF_BAMBOO_LAYERS", "8"))


def model() -> nn.Sequential:
    return nn.Sequential(*[EmulatedLinear(_width()) for _ in range(_layers())])


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    n = int(os.environ.get("VF_BAMBOO_SAMPLES", "2048"))
    return TensorDataset(torch.randn(n, _width(), generator=g), torch.zeros(n, 1))


def output_loss(out: torch.Tensor, batch) -> torch.Tensor:
    return (out - batch[1]).pow(2).mean()


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def bamboo_job():
    """The measured job; stages, schedule, batch and redundancy from ``VF_BAMBOO_*`` (the launcher
    sets them; worker processes inherit the environment)."""
    import virtualflow as vf

    env = os.environ
    return vf.Job(model=model, optimizer=adamw, output_loss=output_loss, dataset=data,
                  global_batch_size=int(env.get("VF_BAMBOO_B", "256")), virtual_nodes=int(env.get("VF_BAMBOO_M", "8")),
                  seed=SEED, name=NAME,
                  pipeline=vf.Pipeline(stages=int(env.get("VF_BAMBOO_STAGES", "2")), schedule="1f1b",
                                       redundancy=env.get("VF_BAMBOO_REDUNDANCY", "0") == "1"))


def configure(args, redundancy: bool | None = None) -> None:
    """Put the job's shape into the environment (read by ``bamboo_job`` here and in the workers)."""
    os.environ.update(VF_BAMBOO_WIDTH=str(args.width), VF_BAMBOO_LAYERS=str(args.layers_per_stage * args.stages),
                      VF_BAMBOO_STAGES=str(args.stages), VF_BAMBOO_M=str(args.m), VF_BAMBOO_B=str(args.m * args.mb),
                      VF_BAMBOO_SAMPLES=str(max(2048, 4 * args.m * args.mb)),
                      VF_BAMBOO_F_S=str(args.f_s), VF_BAMBOO_B_S=str(args.b_s))
    if redundancy is not None:
        os.environ["VF_BAMBOO_REDUNDANCY"] = "1" if redundancy else "0"


# --------------------------------------------------------------------------------------------
# Calibration: the real nn.Linear's forward and backward time at this micro-batch, 1 thread.


def calibrate(width: int, mb: int, reps: int) -> dict:
    """The real layer's times: the fastest of ``reps`` timings after a quarter of them as warm-up
    (other processes on this shared machine only ever make a timing longer)."""
    torch.manual_seed(0)
    layer = nn.Linear(width, width)
    x = torch.randn(mb, width, requires_grad=True)
    fwd, bwd = [], []
    with H.LoadMeter() as meter:
        for _ in range(reps):
            t0 = time.perf_counter()
            y = layer(x)
            t1 = time.perf_counter()
            y.sum().backward()
            t2 = time.perf_counter()
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    warm = reps // 4
    return {"mb": mb, "forward_s": min(fwd[warm:]), "backward_s": min(bwd[warm:]),
            "forward_median_s": H.median(fwd[warm:]), "backward_median_s": H.median(bwd[warm:]), "reps": reps,
            "other_load_cores": meter.other_cores}


# --------------------------------------------------------------------------------------------
# (1) Overhead: interleaved pairs through virtualflow.train.


def one_run(args, redundancy: bool, steps: int) -> dict:
    import virtualflow as vf

    configure(args, redundancy)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        result = vf.train(bamboo_job, workers=args.stages, steps=steps, threads_per_worker=1,
                          run_dir=os.path.join(tmp, "run"))
        wall = time.perf_counter() - t0
    times = [h["step_time_s"] for h in result.history]
    return {"redundancy": redundancy, "step_times": times, "step_s": H.median(times[args.warmup:]),
            "wall_s": wall, "peak_rss_mib": [result.peak_rss_mib.get(w) for w in range(args.stages)]}


def measure_overhead(args, n_pairs: int, label: str = "pair", retry_budget_s: float = 0.0) -> dict:
    """``n_pairs`` interleaved pairs; a pair with more other load than ``--max-other-cores`` is
    repeated (``--retries`` times) while less than ``retry_budget_s`` has passed, so that a busy
    machine cannot stretch the run without bound."""
    runners = {"without": lambda: one_run(args, False, args.steps), "with": lambda: one_run(args, True, args.steps)}
    pairs = []
    t0 = time.perf_counter()
    for i in range(n_pairs):
        order = H.pair_order(i, "without", "with")
        retries = args.retries if time.perf_counter() - t0 < retry_budget_s else 0
        runs = H.run_pair(runners, order, max_other_cores=args.max_other_cores, retries=retries,
                          quiet_wait_s=args.quiet_wait, label=f"{label} {i}")
        ratio = runs["with"]["step_s"] / runs["without"]["step_s"]
        pairs.append({"order": list(order), "ratio": ratio, **{k: runs[k] for k in ("without", "with")}})
        print(f"  {label} {i} ({' then '.join(order)}): step without {1e3 * runs['without']['step_s']:.1f} ms, with "
              f"{1e3 * runs['with']['step_s']:.1f} ms -> {ratio:.3f}x (other load "
              f"{max(runs[k]['other_load_cores'] for k in runs):.2f} cores)", flush=True)
    ratios = [p["ratio"] for p in pairs]
    quiet = [p["ratio"] for p in pairs
             if max(p[k]["other_load_cores"] for k in ("without", "with")) <= args.max_other_cores]
    return {"quiet_ratios": quiet, "quiet_overhead": H.median(quiet) if quiet else None,"mb": args.mb, "f_s": args.f_s, "b_s": args.b_s, "steps": args.steps, "warmup": args.warmup,
            "pairs": pairs, "ratios": ratios, "overhead": H.median(ratios),
            "step_without_s": H.median([p["without"]["step_s"] for p in pairs]),
            "step_with_s": H.median([p["with"]["step_s"] for p in pairs])}


# --------------------------------------------------------------------------------------------
# Replica bytes, message bytes and the duplicate optimizer step, in-process.


def measure_replica(args) -> dict:
    from virtualflow.pipeline import layers_of, resolve_bounds
    from virtualflow.plan.vnmap import contiguous_assignment
    from virtualflow.runtime.pipeline_local import LocalDriver, build_engine

    configure(args, True)
    job = bamboo_job()
    torch.manual_seed(job.seed)
    bounds = resolve_bounds(job.pipeline, len(layers_of(job.model())))
    dataset = job.build_dataset()
    engines = [build_engine(job, job.pipeline, bounds, r, dataset=dataset, deterministic=False,
                            device=torch.device("cpu")) for r in range(args.stages)]
    driver = LocalDriver(engines)
    driver.set_layout(contiguous_assignment(job.virtual_nodes, 1))
    driver.run(0, 1)  # the optimizers' state exists after a step
    rows = []
    for r, e in enumerate(engines):
        rep = e.replica_of_successor
        succ = engines[rep.stage_rank]
        expect = sum(t.numel() * t.element_size() for t in list(succ.model.parameters()) + list(succ.model.buffers()))
        expect += sum(v.numel() * v.element_size() for st in succ.optimizer.state.values() for v in st.values()
                      if isinstance(v, torch.Tensor))
        params = [q for q in succ.model.parameters() if q.requires_grad]
        # The message the successor sends: [reduced gradients (flat) | BatchNorm statistics | buffers].
        grads = torch.cat([torch.full((q.numel(),), 1e-4) for q in params])
        bn = torch.zeros(succ.bn_numel)
        buffers = [b.detach().clone() for b in succ.model.buffers()]
        message_bytes = sum(t.numel() * t.element_size() for t in [grads, bn, *buffers])
        own = [q for q in e.model.parameters() if q.requires_grad]
        own_grads = [torch.full_like(q, 1e-4) for q in own]
        apply_s, cat_s, step_s = [], [], []
        for _ in range(args.apply_reps):
            t0 = time.perf_counter()
            rep.apply([grads, bn, *buffers])
            apply_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            torch.cat([g.reshape(-1) for g in own_grads])
            cat_s.append(time.perf_counter() - t0)
            for q, g in zip(own, own_grads):
                q.grad = g.clone()
            t0 = time.perf_counter()
            e.optimizer.step()
            step_s.append(time.perf_counter() - t0)
            e.optimizer.zero_grad(set_to_none=True)
        rows.append({"worker": r, "stage": e.stage_rank, "replica_of": rep.stage_rank, "replica_bytes": rep.nbytes(),
                     "expected_bytes": expect, "message_bytes": message_bytes,
                     "successor_params": sum(q.numel() for q in params),
                     "replica_apply_s": H.median(apply_s[1:] or apply_s),
                     "own_optimizer_step_s": H.median(step_s[1:] or step_s),
                     "message_cat_s": H.median(cat_s[1:] or cat_s)})
    return {"workers": rows, "message_bytes_per_step": sum(r["message_bytes"] for r in rows)}


# --------------------------------------------------------------------------------------------
# (2) Checkpoint write and restart from a checkpoint.


def measure_restart(args) -> dict:
    import virtualflow as vf

    configure(args, True)
    out: dict = {"runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.restart_reps):
            first = os.path.join(tmp, f"first{i}")
            second = os.path.join(tmp, f"second{i}")
            ck_every = args.checkpoint_every
            res = vf.train(bamboo_job, workers=args.stages, steps=3 * ck_every, threads_per_worker=1, run_dir=first,
                           checkpoint_every=ck_every)
            events = H.run_events(first)
            metrics = H.run_metrics(first)
            saves = [e["save_s"] for e in events if e.get("event") == "checkpoint" and "save_s" in e]
            # The pause a checkpoint leaves: gap between the checkpoint step's end and the next
            # step's end, minus the next step's own time.
            by_step = {m["step"]: m for m in metrics}
            gaps = [by_step[s]["time"] - by_step[s - 1]["time"] - by_step[s]["step_time_s"]
                    for s in (ck_every * k for k in (1, 2)) if s in by_step and s - 1 in by_step]
            normal = H.median([h["step_time_s"] for h in res.history[2:]])
            t_launch = time.time()
            handle = vf.launch(bamboo_job, workers=args.stages, steps=3 * ck_every + 4, threads_per_worker=1,
                               run_dir=second, resume=first)
            lines = H.wait_steps(handle, second, 1, timeout_s=300)
            handle.wait(timeout_s=300)
            first_step = lines[0]
            row = {"checkpoint_save_s_reported": saves, "checkpoint_pause_s": gaps,
                   "launch_to_first_step_s": first_step["time"] - t_launch, "normal_step_s": normal,
                   "resumed_at_step": first_step["step"],
                   "restart_s": first_step["time"] - t_launch - normal}
            out["runs"].append(row)
            print(f"  restart {i}: launch -> first resumed step (step {row['resumed_at_step']}) "
                  f"{row['launch_to_first_step_s']:.2f} s (normal step {1e3 * normal:.0f} ms); checkpoint pause "
                  f"{', '.join(f'{1e3 * g:.0f}' for g in gaps)} ms; save_s reported "
                  f"{', '.join(f'{1e3 * s:.0f}' for s in saves) or 'none'} ms", flush=True)
    out["restart_s"] = H.median([r["restart_s"] for r in out["runs"]])
    pauses = [g for r in out["runs"] for g in r["checkpoint_pause_s"]]
    saves = [s for r in out["runs"] for s in r["checkpoint_save_s_reported"]]
    out["checkpoint_pause_s"] = H.median(pauses)
    out["checkpoint_save_s_reported"] = H.median(saves) if saves else None
    out["checkpoint_s"] = out["checkpoint_save_s_reported"] if saves else out["checkpoint_pause_s"]
    out["checkpoint_from"] = ("checkpoint reports' save_s (gather + write)" if saves else
                              "the pause between steps in metrics.jsonl (no checkpoint events with save_s)")
    return out


# --------------------------------------------------------------------------------------------
# (2b) Failover: a worker SIGKILLs itself (FaultPlan) and its predecessor takes its stage over.


def measure_failover(args) -> dict:
    """``--failover-stages`` stages, one pipeline, redundancy; worker ``stages - 2`` (a middle one:
    the first worker's loss cannot fail over) SIGKILLs itself at the start of step
    ``--failover-step`` (``before_forward``, so the loss is at that step's start). failover =
    end of the last step before the loss -> end of the redone step; slowdown = median step after
    the failover / median step before it (the warm-up left out)."""
    import virtualflow as vf

    fargs = copy.copy(args)
    fargs.stages = args.failover_stages
    configure(fargs, True)
    k, victim = args.failover_step, args.failover_stages - 2
    out: dict = {"stages": fargs.stages, "victim_worker": victim, "loss_step": k, "phase": "before_forward",
                 "runs": []}
    for i in range(args.failover_reps):
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = os.path.join(tmp, "run")
            plan = vf.FaultPlan([vf.Fault(worker=victim, step=k, phase="before_forward")])
            try:
                res = vf.train(bamboo_job, workers=fargs.stages, steps=k + args.failover_after, threads_per_worker=1,
                               run_dir=run_dir, fault_plan=plan)
            except Exception as exc:  # noqa: BLE001 - recorded; the constants then stay defaults
                out["runs"].append({"error": f"{type(exc).__name__}: {str(exc)[-1500:]}"})
                print(f"  failover {i}: the job failed: {type(exc).__name__}: {str(exc)[-300:]}", flush=True)
                continue
            events = H.run_events(run_dir)
            hist = H.run_metrics(run_dir)
        by_step = {h["step"]: h for h in hist}
        before = [h["step_time_s"] for h in hist if args.warmup <= h["step"] < k]
        after = [h["step_time_s"] for h in hist if h["step"] > k + 1]
        fo = [e for e in events if e.get("event") == "failover"]
        row = {"failures": [f.get("worker") for f in res.failures], "steps": [h["step"] for h in hist],
               "workers_by_step": [h["workers"] for h in hist],
               "failover_events": [{kk: e.get(kk) for kk in ("layout", "time", "generation", "step")} for e in fo],
               "fallback": [e for e in events if e.get("event") == "fallback_restart"],
               "step_before_s": H.median(before), "step_after_s": H.median(after),
               "failover_s": by_step[k]["time"] - by_step[k - 1]["time"] if k in by_step and k - 1 in by_step else None,
               "no_step_lost": [h["step"] for h in hist] == list(range(k + args.failover_after))}
        row["slowdown"] = row["step_after_s"] / row["step_before_s"]
        out["runs"].append(row)
        print(f"  failover {i}: worker {victim} lost at step {k}; layout after {fo[0].get('layout') if fo else '?'}; "
              f"end of step {k - 1} -> end of redone step {k}: {row['failover_s']:.2f} s; steps "
              f"{1e3 * row['step_before_s']:.0f} -> {1e3 * row['step_after_s']:.0f} ms ({row['slowdown']:.2f}x); "
              f"no step lost or doubled: {row['no_step_lost']}", flush=True)
    good = [r for r in out["runs"] if "error" not in r and r["failover_s"] is not None and r["failover_events"]]
    out["failover_s"] = H.median([r["failover_s"] for r in good]) if good else None
    out["slowdown"] = H.median([r["slowdown"] for r in good]) if good else None
    return out


# --------------------------------------------------------------------------------------------
# (3) Constants and the simulator.


def constants_of(args, ov: dict, rs: dict, fo: dict | None, env: dict) -> tuple[dict, dict]:
    source = (f"bench/bamboo.py, repository at {env['git_commit']}"
              f"{' + uncommitted edits' if env['virtualflow_source'].get('uncommitted_changes') else ''}, "
              f"{env['date']}, {env['cpu_count']}-core {env['cpu_model']}; emulated stage compute")
    constants = {"step_s": ov["step_without_s"], "samples_per_step": float(args.m * args.mb),
                 "redundancy_overhead": max(0.0, ov["overhead"] - 1.0),
                 "restart_s": max(0.0, rs["restart_s"]), "checkpoint_s": max(0.0, rs["checkpoint_s"]),
                 "source": source}
    sources = {
        "step_s": f"measured: median step of the job without redundancy ({args.stages} stages, 1f1b, m={args.m})",
        "samples_per_step": "the measured job's global batch (one pipeline)",
        "redundancy_overhead": "measured: median over interleaved pairs of step(with)/step(without) - 1 "
                               "(replica refresh only; no eager redundant forward exists yet)",
        "restart_s": "measured: virtualflow.launch(resume=RUN_DIR) on this machine, launch -> first resumed step, "
                     "minus a normal step (no instance to acquire or boot, a small model on a local disk)",
        "checkpoint_s": f"measured: {rs['checkpoint_from']}",
        "failover_slowdown": NOT_MEASURED,
        "failover_s": NOT_MEASURED,
        "reconfigure_s": "default, not measured: reconfiguration exists (replace_failed) but this benchmark does not "
                         "measure it yet",
    }
    if fo is not None and fo.get("failover_s") is not None:
        constants["failover_s"] = max(0.0, fo["failover_s"])
        constants["failover_slowdown"] = max(1.0, fo["slowdown"])
        sources["failover_s"] = (f"measured: {fo['stages']} stages, worker {fo['victim_worker']} SIGKILLed at the "
                                 f"start of step {fo['loss_step']} (FaultPlan), end of the step before -> end of the "
                                 f"redone step")
        sources["failover_slowdown"] = (f"measured: {fo['stages']} stages, median step after the failover / before "
                                        f"(one worker running two stages)")
    elif fo is not None:
        sources["failover_s"] = sources["failover_slowdown"] = "default, not measured: the failover run failed"
    return constants, sources


def simulator_source() -> str:
    """The simulator's last commit, and whether the tree measured has uncommitted edits to it."""
    spot = "src/virtualflow/cluster/spot.py"

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=H.REPO_ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:  # noqa: BLE001 - no git, or not a checkout
            return ""

    return (git("log", "-1", "--format=%h", "--", spot) or "never committed") + (
        " + uncommitted edits" if git("status", "--porcelain", "--", spot) else "")


def simulate(const_path: str, stages: int) -> dict:
    """``virtualflow simulate-spot`` on the shipped p2 trace with our constants file (JSON)."""
    cmd = [sys.executable, "-m", "virtualflow.cli.main", "simulate-spot", "--trace", P2_TRACE,
           "--stages", str(stages), "--constants", const_path, "--json"]
    try:
        import virtualflow.cluster.spot  # noqa: F401
    except ImportError as exc:
        return {"available": False, "why": f"virtualflow.cluster.spot not importable: {exc}"}
    proc = subprocess.run(cmd, cwd=H.REPO_ROOT, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        return {"available": False, "why": f"exit {proc.returncode}: {proc.stderr[-1500:]}", "command": cmd}
    return {"available": True, "command": cmd, "summary": json.loads(proc.stdout)}


# --------------------------------------------------------------------------------------------
# Report.


def _mib(b: float) -> str:
    return f"{b / 2 ** 20:.1f} MiB"


def _pairs_table(ov: dict) -> str:
    return H.md_table(["pair", "order", "step without (ms)", "step with (ms)", "with / without", "other load (cores)"],
                      [[str(i), " then ".join(p["order"]), f"{1e3 * p['without']['step_s']:.1f}",
                        f"{1e3 * p['with']['step_s']:.1f}", f"{p['ratio']:.3f}",
                        f"{p['without']['other_load_cores']:.2f} / {p['with']['other_load_cores']:.2f}"]
                       for i, p in enumerate(ov["pairs"])])


def where_time_goes(ov: dict, rep: dict) -> dict:
    """The added step time against what the replica refresh does on the slowest worker, timed
    in-process: building the message (a cat of the gradients) and the replica's step."""
    added = ov["step_with_s"] - ov["step_without_s"]
    cpu = max(r["replica_apply_s"] + r["message_cat_s"] for r in rep["workers"])
    return {"added_step_s": added, "cat_plus_apply_s": cpu, "rest_s": added - cpu}


def _failover_md(fo: dict | None) -> list[str]:
    if fo is None:
        return ["## (2b) Failover", "", "Not run (`--failover-reps 0`).", ""]
    rows = []
    for i, r in enumerate(fo["runs"]):
        if "error" in r:
            rows.append([str(i), f"failed: {r['error'][:200]}", "", "", "", "", ""])
            continue
        rows.append([str(i), str(r["failover_events"][0]["layout"] if r["failover_events"] else "none"),
                     f"{r['failover_s']:.2f}" if r["failover_s"] is not None else "",
                     f"{1e3 * r['step_before_s']:.0f}", f"{1e3 * r['step_after_s']:.0f}", f"{r['slowdown']:.2f}",
                     H.yes_no(r["no_step_lost"])])
    return [
        "## (2b) Failover (a worker SIGKILLed, its predecessor runs its stage from the replica)", "",
        f"The same layers, {fo['stages']} stages, one pipeline, redundancy on ({fo['stages']} processes on 2 cores: "
        f"sleep-emulated compute overlaps, but the optimizer and replica steps of the workers share the 2 cores). "
        f"Worker {fo['victim_worker']} SIGKILLs itself at the start of step {fo['loss_step']} "
        f"(`FaultPlan(Fault(worker={fo['victim_worker']}, step={fo['loss_step']}, phase='before_forward'))`). "
        f"Failover = end of step {fo['loss_step'] - 1} -> end of the redone step {fo['loss_step']} (loss -> first "
        f"completed step, the redone step included); slowdown = median step after the failover / median step "
        f"before it.", "",
        H.md_table(["run", "layout after", "failover (s)", "step before (ms)", "step after (ms)", "slowdown",
                    "every step once"], rows), ""]


def markdown(run: H.Run, args, cal: dict, ov: dict, small: dict | None, rep: dict, rs: dict, fo: dict | None,
             constants: dict, sources: dict, sim: dict) -> str:
    params_stage = args.layers_per_stage * (args.width * args.width + args.width)
    lines: list[str] = [f"# {run.name}: Bamboo's redundant stages (replica refresh) - overhead, restart, simulator constants",
             "", H.env_markdown(), ""]
    lines += [
        "**Not measured yet, and why**: **eager redundant forward computation** does not exist in the engine, so "
        "the overhead below is that of the replica refresh alone (no redundant forwards), and a failover recomputes "
        "the interrupted step. The **reconfiguration pause** (a replacement taking its stage back, "
        "`replace_failed`) exists in the engine but is not measured here yet (the simulator's default is used), "
        "and neither is the time-compressed replay of a real trace (0 lost steps, within 10 % of the simulator). "
        "Failover (section 2b) is measured: it landed in the engine while this benchmark was written.", "",
        "## (1) Redundancy overhead through `virtualflow.train`", "",
        f"Job: {args.stages} stages (one worker process each, 1 thread), 1F1B, m = {args.m} micro-batches of "
        f"{args.mb}, AdamW; each stage {args.layers_per_stage} SLEEP-EMULATED Linear({args.width}, {args.width}) "
        f"layers ({params_stage / 1e6:.2f} M real parameters per stage, {args.stages * params_stage / 1e6:.2f} M "
        f"in all). Each layer sleeps forward {1e3 * args.f_s:.2f} ms and backward {1e3 * args.b_s:.2f} ms per "
        f"micro-batch: "
        + (f"the real `nn.Linear`'s times at micro-batch {args.mb} on this machine (calibrated, 1 thread, "
           f"fastest of {cal['reps']}: {1e3 * cal['forward_s']:.2f} / {1e3 * cal['backward_s']:.2f} ms)"
           if cal else "given on the command line")
        + ". Parameters, gradients, the optimizer, the replica message and the replica's optimizer step are real; "
        f"the matrix multiplications are not. {len(ov['pairs'])} interleaved pairs, {args.steps} steps per run "
        f"({args.warmup} warm-up), per run the median step time (rank 0's time between step ends).", "",
        _pairs_table(ov), "",
        f"**Overhead: {ov['overhead']:.3f}x** (median of per-pair ratios, every pair kept; target <= "
        f"{TARGET_OVERHEAD}); pairs with at most {args.max_other_cores} cores of other load: "
        + (f"{ov['quiet_overhead']:.3f}x ({len(ov['quiet_ratios'])} pairs)" if ov["quiet_ratios"] else "none")
        + f" (a diagnostic). Median "
        f"steps {1e3 * ov['step_without_s']:.1f} ms without, {1e3 * ov['step_with_s']:.1f} ms with; throughput "
        f"{args.m * args.mb / ov['step_without_s']:.0f} vs {args.m * args.mb / ov['step_with_s']:.0f} samples/s.", ""]
    if small is not None:
        w = where_time_goes(small, rep)
        lines += [
            f"**Diagnostic, not a target**: the same pairs at micro-batch {small['mb']} ({args.m * small['mb']} samples "
            f"per step instead of {args.m * args.mb}: 1/{args.mb // small['mb']} of the compute per parameter and step; "
            f"emulated layer forward {1e3 * small['f_s']:.2f} ms, backward {1e3 * small['b_s']:.2f} ms), "
            f"{small['steps']} steps per run ({small['warmup']} warm-up):", "",
            _pairs_table(small), "",
            f"Overhead at micro-batch {small['mb']}: **{small['overhead']:.3f}x** (steps {1e3 * small['step_without_s']:.1f} "
            f"-> {1e3 * small['step_with_s']:.1f} ms: +{1e3 * w['added_step_s']:.1f} ms). The refresh costs about a "
            f"fixed time per step (message + duplicate optimizer step, proportional to the stage's parameters), so "
            f"its share falls as the compute per parameter and step grows.", ""]
    w = where_time_goes(ov, rep)
    lines += [
        f"Where the added time goes (micro-batch {args.mb}): +{1e3 * w['added_step_s']:.1f} ms per step; the slowest "
        f"worker's message build (cat of the gradients) + replica step (`StageReplica.apply`), timed in-process, "
        f"are {1e3 * w['cat_plus_apply_s']:.1f} ms; the rest ({1e3 * w['rest_s']:.1f} ms) is the message's transfer "
        f"and waiting (the exchange sits between the reduction and the step's commit, on the critical path) plus "
        f"noise.", "",
        "### Replica memory, extra bytes per step, the duplicate optimizer step", "",
        H.md_table(["worker (stage)", "replica of stage", "replica bytes (`StageReplica.nbytes()`)",
                    "successor's params + buffers + optimizer state", "message bytes per step",
                    "replica apply (ms)", "own optimizer step (ms)", "cat of the gradients (ms)"],
                   [[str(r["worker"]), str(r["replica_of"]), f"{r['replica_bytes']:,} ({_mib(r['replica_bytes'])})",
                     f"{r['expected_bytes']:,}", f"{r['message_bytes']:,} ({_mib(r['message_bytes'])})",
                     f"{1e3 * r['replica_apply_s']:.1f}", f"{1e3 * r['own_optimizer_step_s']:.1f}",
                     f"{1e3 * r['message_cat_s']:.1f}"] for r in rep["workers"]]), "",
        f"Extra bytes sent per step (all workers): {rep['message_bytes_per_step']:,} "
        f"({_mib(rep['message_bytes_per_step'])}): one message per worker of its stage's reduced gradients "
        f"(+ BatchNorm statistics and buffers; none here). The replica holds parameters + buffers + AdamW state "
        f"(exp_avg, exp_avg_sq, step) = about 3x the successor's parameter bytes. Timed in-process after a step "
        f"(1 thread): `StageReplica.apply` (clone of the gradients + AdamW step) and, for comparison, the stage's "
        f"own optimizer step.", "",
        "## (2) Checkpoint write and restart from a checkpoint", "",
        f"The redundant job with `checkpoint_every={args.checkpoint_every}`, {3 * args.checkpoint_every} steps, then "
        f"`virtualflow.launch(..., resume=RUN_DIR)` on fresh processes ({len(rs['runs'])} repetition(s)). Restart = "
        f"launch call -> end of the first resumed step, minus a normal step (process start, imports, model build, "
        f"checkpoint load, group formation). Checkpoint = {rs['checkpoint_from']}.", "",
        H.md_table(["rep", "launch -> first resumed step (s)", "normal step (ms)", "restart (s)",
                    "checkpoint pause between steps (ms)", "save_s reported (ms)"],
                   [[str(i), f"{r['launch_to_first_step_s']:.2f}", f"{1e3 * r['normal_step_s']:.0f}",
                     f"{r['restart_s']:.2f}", ", ".join(f"{1e3 * g:.0f}" for g in r["checkpoint_pause_s"]),
                     ", ".join(f"{1e3 * s:.0f}" for s in r["checkpoint_save_s_reported"]) or "none"]
                    for i, r in enumerate(rs["runs"])]), "",
        *_failover_md(fo),
        "## (3) Constants for the spot simulator (`constants` in bamboo.json)", "",
        H.md_table(["constant", "value", "source"],
                   [[k, f"{constants[k]:.4g}" if k in constants else "(left out: the simulator's default)", sources[k]]
                    for k in sources]), ""]
    lines += ["### The simulator on the shipped p2 trace (its output, not a measurement)", ""]
    if sim.get("available"):
        s = sim["summary"]
        rows = []
        for k, r in s["strategies"].items():
            rows.append([k, f"{r.get('samples_per_s', float('nan')):.2f}", f"{r.get('cost_usd', float('nan')):.2f}",
                         f"{r.get('samples_per_usd', float('nan')):.1f}",
                         f"{r['value_vs_on_demand']:.2f}x" if r.get("value_vs_on_demand") is not None else "-",
                         str(r.get("failovers", "-")), str(r.get("restarts", "-"))])
        lines += [f"`virtualflow simulate-spot --trace {P2_TRACE} --stages {args.sim_stages} --constants "
                  f"bench/results/{run.name}.json` (simulator at {sim.get('simulator_source', '?')}):", "",
                  H.md_table(["strategy", "samples/s", "cost $", "samples/$", "value vs on-demand", "failovers",
                              "restarts"], rows), ""]
        if "bamboo_vs_checkpoint" in s:
            lines += [f"Bamboo vs checkpoint-restart (samples/$): **{s['bamboo_vs_checkpoint']:.2f}x** (issue: >= 1.5x); "
                      f"Bamboo vs on-demand: **{s['strategies']['bamboo']['value_vs_on_demand']:.2f}x** (issue: >= 2x). "
                      f"Constants measured here: {', '.join(k for k in sources if k in constants)}; defaults (not "
                      f"measured): {', '.join(k for k in sources if k not in constants) or 'none'}. These value "
                      f"ratios are the simulator's, reported and not checked as targets here.", ""]
        alt = sim.get("restart_default")
        if alt is not None:
            a = alt["summary"]
            lines += [f"Sensitivity (simulator): the measured restart ({constants['restart_s']:.1f} s) reuses this "
                      f"machine, already up, with a small model on a local disk; a cloud restart also gets and boots "
                      f"an instance. With `restart_s` left at the simulator's default "
                      f"({a['constants']['restart_s']:g} s, Bamboo's figure) and the other measured constants: Bamboo "
                      f"{a['strategies']['bamboo']['value_vs_on_demand']:.2f}x on-demand, "
                      f"{a.get('bamboo_vs_checkpoint', float('nan')):.2f}x checkpoint-restart.", ""]
    else:
        lines += [f"Not run: {sim.get('why')}", ""]
    lines += [f"Reproduce: `{run.command(NAME)}`"]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Entry point.


def parse_args(argv):
    p = H.parser(__doc__, quiet_wait=8.0)
    p.add_argument("--stages", type=int, default=2, help="pipeline stages = worker processes")
    p.add_argument("--m", type=int, default=8, help="micro-batches per step")
    p.add_argument("--mb", type=int, default=256, help="samples (rows) per micro-batch")
    p.add_argument("--width", type=int, default=1024, help="Linear width H")
    p.add_argument("--layers-per-stage", type=int, default=4)
    p.add_argument("--small-mb", type=int, default=32,
                   help="diagnostic pairs at this micro-batch (less compute per parameter; 0: skip)")
    p.add_argument("--small-pairs", type=int, default=3)
    p.add_argument("--small-steps", type=int, default=30)
    p.add_argument("--f-ms", type=float, default=None, help="emulated forward per layer and micro-batch (default: "
                   "calibrated from the real nn.Linear)")
    p.add_argument("--b-ms", type=float, default=None, help="emulated backward per layer and micro-batch")
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--steps", type=int, default=14, help="steps per run")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--max-other-cores", type=float, default=0.3, help="repeat a pair with more other load")
    p.add_argument("--retries", type=int, default=2, help="repeat a pair with more other load up to this many times "
                   "(while --retry-budget seconds have not passed)")
    p.add_argument("--retry-budget", type=float, default=150.0,
                   help="seconds of the overhead measurement after which loaded pairs are no longer repeated")
    p.add_argument("--apply-reps", type=int, default=6)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--restart-reps", type=int, default=3)
    p.add_argument("--sim-stages", type=int, default=4, help="pipeline stages of the simulated spot job")
    p.add_argument("--failover-stages", type=int, default=4, help="stages of the failover run (>= 3)")
    p.add_argument("--failover-step", type=int, default=6, help="the step at whose start a middle worker dies")
    p.add_argument("--failover-after", type=int, default=8, help="steps from the loss to the end")
    p.add_argument("--failover-reps", type=int, default=2, help="failover runs (0: skip)")
    args = p.parse_args(argv)
    if args.quick:
        args.pairs, args.steps, args.warmup, args.restart_reps, args.apply_reps, args.small_pairs = 2, 8, 2, 1, 3, 0
        args.checkpoint_every, args.quiet_wait, args.retry_budget = 3, min(args.quiet_wait, 3.0), 0.0
        args.failover_reps, args.failover_step, args.failover_after = 1, 4, 5
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    run = H.Run(NAME, args, TARGET_KEYS)
    torch.set_num_threads(1)
    logging.getLogger("virtualflow").setLevel(logging.ERROR)
    print(H.banner(f"bamboo: Pipeline(redundancy=True) overhead ({args.stages} stages, 1f1b, m={args.m}, "
                   f"mb={args.mb}), restart/checkpoint, simulator constants"))
    print("  COMPUTE IS SLEEP-EMULATED (real parameters, optimizer and messages; sleeps instead of matmuls).",
          flush=True)
    cal = None
    if args.f_ms is None or args.b_ms is None:
        cal = calibrate(args.width, args.mb, 40)
    args.f_s = args.f_ms / 1e3 if args.f_ms is not None else cal["forward_s"]
    args.b_s = args.b_ms / 1e3 if args.b_ms is not None else cal["backward_s"]
    print(f"  emulated layer: forward {1e3 * args.f_s:.2f} ms, backward {1e3 * args.b_s:.2f} ms per micro-batch "
          f"({'calibrated' if cal else 'given'})", flush=True)
    print("(1) overhead: interleaved pairs, without / with redundancy", flush=True)
    ov = measure_overhead(args, args.pairs, retry_budget_s=args.retry_budget)
    small = None
    if args.small_mb and args.small_pairs:
        sargs = copy.copy(args)
        sargs.mb, sargs.steps, sargs.warmup = args.small_mb, args.small_steps, 5
        small_cal = calibrate(args.width, args.small_mb, 60) if cal is not None else None
        if small_cal is not None:
            sargs.f_s, sargs.b_s = small_cal["forward_s"], small_cal["backward_s"]
        print(f"    diagnostic: micro-batch {sargs.mb} (emulated forward {1e3 * sargs.f_s:.2f} ms, backward "
              f"{1e3 * sargs.b_s:.2f} ms per layer)", flush=True)
        small = measure_overhead(sargs, args.small_pairs, "small-batch pair")
        small["calibration"] = small_cal
    print("    replica bytes and the duplicate optimizer step (in-process)", flush=True)
    rep = measure_replica(args)
    print("(2) checkpoint and restart", flush=True)
    rs = measure_restart(args)
    fo = None
    if args.failover_reps:
        print(f"(2b) failover ({args.failover_stages} stages, a middle worker SIGKILLed)", flush=True)
        fo = measure_failover(args)
    env = H.environment()
    constants, sources = constants_of(args, ov, rs, fo, env)
    t = run.targets
    t.at_most("redundancy_overhead", f"step time with / without redundancy ({args.stages} stages, 1f1b, emulated "
              "compute, median of per-pair ratios)", ov["overhead"], TARGET_OVERHEAD, "x")
    if fo is not None:
        t.at_most("failover_slowdown", f"failed-over pipeline: step after / before ({fo['stages']} stages, a worker "
                  "running two stages)", fo["slowdown"] if fo["slowdown"] is not None else float("nan"),
                  TARGET_FAILOVER_SLOWDOWN, "x")
        t.at_most("failover_s", "failover: loss -> first completed step (the redone step included)",
                  fo["failover_s"] if fo["failover_s"] is not None else float("nan"), TARGET_FAILOVER_S, " s")
        t.holds("failover: every step once (none lost, none doubled), in every failover run",
                bool(fo["runs"]) and all(r.get("no_step_lost") for r in fo["runs"]))
    t.holds("replica bytes == the successor's parameters + buffers + optimizer state (every worker)",
            all(r["replica_bytes"] == r["expected_bytes"] for r in rep["workers"]),
            ", ".join(f"{r['replica_bytes']:,}" for r in rep["workers"]))
    payload = {"benchmark": run.name, "environment": env,
               "config": {k: v for k, v in vars(args).items()},
               "constants": constants, "constants_sources": sources,
               "not_measured": {k: v for k, v in sources.items() if v.startswith("default")}
               | {"eager_redundant_forward": "not implemented in the engine",
                  "trace_replay": "time-compressed replay of a real trace: not written yet"},
               "calibration": cal, "overhead": ov, "overhead_small_batch": small, "replica": rep,
               "where_time_goes": where_time_goes(ov, rep), "restart": rs, "failover": fo}
    # The simulator reads the constants from the file: write it first, then run it.
    os.makedirs(run.out_dir, exist_ok=True)
    with open(run.path(".json"), "w") as f:
        json.dump(payload, f, indent=2)
    print("(3) simulator on the p2 trace with these constants", flush=True)
    sim = simulate(run.path(".json"), args.sim_stages)
    if sim.get("available"):
        sim["simulator_source"] = simulator_source()
        s = sim["summary"]
        print(f"  simulator: bamboo {s['strategies']['bamboo']['value_vs_on_demand']:.2f}x on-demand, "
              f"{s.get('bamboo_vs_checkpoint', float('nan')):.2f}x checkpoint-restart (samples/$)", flush=True)
        # Sensitivity: the same constants but a cloud restart (Bamboo's 45 s node start, the
        # simulator's default): a restart here reuses this machine, with no instance to get.
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "constants.json")
            with open(path, "w") as f:
                json.dump({"constants": {k: v for k, v in constants.items() if k != "restart_s"}}, f)
            alt = simulate(path, args.sim_stages)
        if alt.get("available"):
            a = alt["summary"]
            sim["restart_default"] = {"summary": a, "note": "restart_s left out (the simulator's default)"}
            print(f"  with the default restart_s instead: bamboo {a['strategies']['bamboo']['value_vs_on_demand']:.2f}x "
                  f"on-demand, {a.get('bamboo_vs_checkpoint', float('nan')):.2f}x checkpoint-restart", flush=True)
    else:
        print(f"  simulator not run: {sim['why']}", flush=True)
    payload["simulation"] = sim
    return run.finish(payload, markdown(run, args, cal, ov, small, rep, rs, fo, constants, sources, sim))


if __name__ == "__main__":
    sys.exit(main())
