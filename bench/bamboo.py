"""Bamboo's redundant stages (issue 16): what ``Pipeline(redundancy=True)`` costs a pipelined job
trained through ``virtualflow.train``, the restart/checkpoint times, and the constants the spot
simulator (``virtualflow simulate-spot``) reads from ``bench/results/bamboo.json``.

What exists in the engine (and so what this measures): every worker keeps a replica of its
successor's stage, refreshed every step from the successor's reduced gradients (one extra
point-to-point message of the stage's gradient size per worker per step, sent after the
reduction and before the step commits, and a duplicate optimizer step on the replica); by
default (``redundant_compute="eager"``) each worker also runs its successor stage's forward of
the micro-batches it sent on the replica, only in the schedule's bubbles (the others skipped,
counted), and keeps them until the step commits (``redundant_compute="lazy"``: none). A lost middle worker is
covered by its predecessor, which runs the lost stage from its replica (failover, the
interrupted step redone, splicing in the eager forwards it holds). The reconfiguration pause and
the trace replay are measured by ``bench/bamboo_failover.py``, not here.

1. **Redundancy overhead.** The same job without redundancy, with lazy redundancy
   (``Pipeline(redundancy=True, redundant_compute="lazy")``: the refresh alone) and with eager
   redundancy (``Pipeline(redundancy=True)``, the default), ``virtualflow.train`` (local
   backend, one worker process per stage, 1 thread each), 1F1B, interleaved triples (the order
   rotated over the 6 permutations), per run the median step time after warm-up; overhead =
   median over triples of (step eager / step without): target <= 1.15 (key
   ``redundancy_overhead``); lazy beside it (key ``redundancy_overhead_lazy``); the eager
   coverage (forwards run / skipped per worker, seconds) from ``Result.redundant_forwards``. The layers
   are SLEEP-EMULATED Linear(H, H) layers: each holds a real H x H weight and bias (so the
   gradient message, the optimizer and the replica's duplicate optimizer step are real costs of
   real sizes) but sleeps instead of multiplying: forward and backward sleep the time the real
   ``nn.Linear`` forward / backward took on this machine at the same micro-batch (calibrated at
   start, 1 thread), so compute and parameters keep a real layer's proportion while the worker
   processes overlap on 2 cores as they would on their own devices. The weight gradient a
   backward returns is a fixed tensor of the weight's size (accumulated by autograd as a real one
   would be); eager forwards sleep the same forward time (a device's idle slot, no CPU). Default 2 stages (one process per core: the replica's extra CPU work does not
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
4. **Constants** for ``SpotConstants`` (``constants`` object, ``redundancy_overhead`` the eager one; ``constants_sources`` beside it
   names each constant's source, measured or default) and, when ``virtualflow.cluster.spot`` is
   importable, the simulator's replay of the shipped p2 trace with them (the simulator's output,
   not a measurement).

From the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.bamboo            # about 8 minutes
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
from bench.harness import emulated as harness_emulated
from bench.harness.emulated import EnvSeconds

NAME = "bamboo"
TARGET_KEYS = ("redundancy_overhead", "redundancy_overhead_lazy", "failover_slowdown", "failover_s")
TARGET_OVERHEAD = 1.15
TARGET_FAILOVER_SLOWDOWN = 1.5
TARGET_FAILOVER_S = 1.0
SEED = H.SEED
P2_TRACE = "p2-xlarge-2020-11-20-hours"
NOT_MEASURED = "default, not measured"


# --------------------------------------------------------------------------------------------
# The workload: sleep-emulated Linear layers with real parameters (imported by the workers).


class EmulatedLinear(harness_emulated.EmulatedLinear):
    """An ``nn.Linear(width, width)``'s parameters; compute replaced by sleeps (``VF_BAMBOO_F_S`` /
    ``VF_BAMBOO_B_S`` seconds per micro-batch, set by the launcher from its calibration); the fixed
    gradients are made once."""

    def __init__(self, width: int) -> None:
        super().__init__(width, EnvSeconds("VF_BAMBOO_F_S", 0.002), EnvSeconds("VF_BAMBOO_B_S", 0.004))


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
    mode = env.get("VF_BAMBOO_REDUNDANCY", "without")
    return vf.Job(model=model, optimizer=adamw, output_loss=output_loss, dataset=data,
                  global_batch_size=int(env.get("VF_BAMBOO_B", "256")), virtual_nodes=int(env.get("VF_BAMBOO_M", "8")),
                  seed=SEED, name=NAME,
                  pipeline=vf.Pipeline(stages=int(env.get("VF_BAMBOO_STAGES", "2")), schedule="1f1b",
                                       redundancy=mode != "without",
                                       redundant_compute="lazy" if mode == "lazy" else "eager"))


MODES = ("without", "lazy", "eager")
"""No redundancy; ``redundancy=True, redundant_compute="lazy"`` (replica refresh only);
``redundancy=True`` with the default ``redundant_compute="eager"`` (refresh + eager forwards)."""


def configure(args, redundancy: bool | str | None = None) -> None:
    """Put the job's shape into the environment (read by ``bamboo_job`` here and in the workers);
    ``redundancy``: one of :data:`MODES`, or ``True`` (the default mode, eager) / ``False``."""
    os.environ.update(VF_BAMBOO_WIDTH=str(args.width), VF_BAMBOO_LAYERS=str(args.layers_per_stage * args.stages),
                      VF_BAMBOO_STAGES=str(args.stages), VF_BAMBOO_M=str(args.m), VF_BAMBOO_B=str(args.m * args.mb),
                      VF_BAMBOO_SAMPLES=str(max(2048, 4 * args.m * args.mb)),
                      VF_BAMBOO_F_S=str(args.f_s), VF_BAMBOO_B_S=str(args.b_s))
    if redundancy is not None:
        mode = {True: "eager", False: "without"}.get(redundancy, redundancy)
        if mode not in MODES:
            raise ValueError(f"redundancy mode {redundancy!r} must be one of {MODES}")
        os.environ["VF_BAMBOO_REDUNDANCY"] = mode


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
# (1) Overhead: interleaved triples (without / lazy / eager) through virtualflow.train.

ORDERS = (("without", "lazy", "eager"), ("eager", "without", "lazy"), ("lazy", "eager", "without"),
          ("without", "eager", "lazy"), ("lazy", "without", "eager"), ("eager", "lazy", "without"))
"""The triples' orders in turn: every mode first, second and third equally often in 6 triples,
and each ordered pair of modes as often as its reverse."""


def one_run(args, mode: str, steps: int) -> dict:
    import virtualflow as vf

    configure(args, mode)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        result = vf.train(bamboo_job, workers=args.stages, steps=steps, threads_per_worker=1,
                          run_dir=os.path.join(tmp, "run"))
        wall = time.perf_counter() - t0
    times = [h["step_time_s"] for h in result.history]
    return {"mode": mode, "step_times": times, "step_s": H.median(times[args.warmup:]),
            "wall_s": wall, "steps": len(times), "peak_rss_mib": [result.peak_rss_mib.get(w) for w in range(args.stages)],
            "redundant_forwards": {str(w): dict(v) for w, v in sorted(result.redundant_forwards.items())},
            "replica_refresh_s": {str(w): v for w, v in sorted(result.replica_refresh_s.items())}}


def coverage(runs: list[dict]) -> dict:
    """The eager runs' redundant forwards per worker, summed over ``runs``: run, skipped (no idle
    slot left for them), seconds, and per step."""
    out: dict = {}
    for r in runs:
        for w, v in r.get("redundant_forwards", {}).items():
            c = out.setdefault(w, {"forwards": 0, "skipped": 0, "seconds": 0.0, "reused": 0, "steps": 0,
                                   "peak_bytes": 0})
            for k in ("forwards", "skipped", "reused"):
                c[k] += int(v.get(k, 0))
            c["peak_bytes"] = max(c["peak_bytes"], int(v.get("peak_bytes", 0)))
            c["seconds"] += float(v.get("seconds", 0.0))
            c["steps"] += r["steps"]
    for c in out.values():
        due = c["forwards"] + c["skipped"]
        c["covered"] = c["forwards"] / due if due else None
        c["seconds_per_step"] = c["seconds"] / c["steps"] if c["steps"] else None
        c["forwards_per_step"] = c["forwards"] / c["steps"] if c["steps"] else None
    return out


def measure_overhead(args, n_triples: int, label: str = "triple", retry_budget_s: float = 0.0) -> dict:
    """``n_triples`` interleaved triples (without / lazy / eager; orders in turn from
    :data:`ORDERS`); a triple with more other load than ``--max-other-cores`` is repeated
    (``--retries`` times) while less than ``retry_budget_s`` has passed, so that a busy machine
    cannot stretch the run without bound."""
    runners = {m: (lambda m=m: one_run(args, m, args.steps)) for m in MODES}
    triples = []
    t0 = time.perf_counter()
    for i in range(n_triples):
        order = ORDERS[i % len(ORDERS)]
        retries = args.retries if time.perf_counter() - t0 < retry_budget_s else 0
        runs = H.run_pair(runners, order, max_other_cores=args.max_other_cores, retries=retries,
                          quiet_wait_s=args.quiet_wait, label=f"{label} {i}")
        row = {"order": list(order), "ratio_eager": runs["eager"]["step_s"] / runs["without"]["step_s"],
               "ratio_lazy": runs["lazy"]["step_s"] / runs["without"]["step_s"],
               "eager_vs_lazy": runs["eager"]["step_s"] / runs["lazy"]["step_s"],
               "other_load_cores": max(runs[k]["other_load_cores"] for k in MODES), **{k: runs[k] for k in MODES}}
        triples.append(row)
        cov = coverage([runs["eager"]])
        print(f"  {label} {i} ({' then '.join(order)}): step without {1e3 * runs['without']['step_s']:.1f} ms, lazy "
              f"{1e3 * runs['lazy']['step_s']:.1f} ms, eager {1e3 * runs['eager']['step_s']:.1f} ms -> lazy "
              f"{row['ratio_lazy']:.3f}x, eager {row['ratio_eager']:.3f}x; eager forwards run/skipped "
              f"{', '.join('w%s %d/%d' % (w, c['forwards'], c['skipped']) for w, c in cov.items())} (other load "
              f"{row['other_load_cores']:.2f} cores)", flush=True)
    quiet = [t for t in triples if t["other_load_cores"] <= args.max_other_cores]
    return {"mb": args.mb, "f_s": args.f_s, "b_s": args.b_s, "steps": args.steps, "warmup": args.warmup,
            "triples": triples,
            "ratios": [t["ratio_eager"] for t in triples], "overhead": H.median([t["ratio_eager"] for t in triples]),
            "ratios_lazy": [t["ratio_lazy"] for t in triples],
            "overhead_lazy": H.median([t["ratio_lazy"] for t in triples]),
            "eager_vs_lazy": H.median([t["eager_vs_lazy"] for t in triples]),
            "quiet_ratios": [t["ratio_eager"] for t in quiet],
            "quiet_overhead": H.median([t["ratio_eager"] for t in quiet]) if quiet else None,
            "quiet_overhead_lazy": H.median([t["ratio_lazy"] for t in quiet]) if quiet else None,
            "step_without_s": H.median([t["without"]["step_s"] for t in triples]),
            "step_lazy_s": H.median([t["lazy"]["step_s"] for t in triples]),
            "step_eager_s": H.median([t["eager"]["step_s"] for t in triples]),
            "step_with_s": H.median([t["eager"]["step_s"] for t in triples]),
            "coverage": coverage([t["eager"] for t in triples])}


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
        row["redundant_forwards"] = {str(w): dict(v) for w, v in sorted(res.redundant_forwards.items())}
        row["reused"] = sum(int(v.get("reused", 0)) for v in res.redundant_forwards.values())
        out["runs"].append(row)
        print(f"  failover {i}: worker {victim} lost at step {k}; layout after {fo[0].get('layout') if fo else '?'}; "
              f"end of step {k - 1} -> end of redone step {k}: {row['failover_s']:.2f} s; steps "
              f"{1e3 * row['step_before_s']:.0f} -> {1e3 * row['step_after_s']:.0f} ms ({row['slowdown']:.2f}x); "
              f"no step lost or doubled: {row['no_step_lost']}; eager forwards reused by the redone step: "
              f"{row['reused']}", flush=True)
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
        "redundancy_overhead": f"measured: eager redundancy (Pipeline(redundancy=True), the default "
                               f"redundant_compute='eager': replica refresh + eager redundant forwards), median over "
                               f"interleaved triples of step(eager)/step(without) - 1 ({args.stages} stages, 1f1b, "
                               f"m={args.m}); lazy (refresh only) measured beside it: "
                               f"{max(0.0, ov['overhead_lazy'] - 1.0):.4f}",
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


def _triples_table(ov: dict) -> str:
    rows = []
    for i, t in enumerate(ov["triples"]):
        cov = coverage([t["eager"]])
        rows.append([str(i), " then ".join(t["order"]), *(f"{1e3 * t[k]['step_s']:.1f}" for k in MODES),
                     f"{t['ratio_lazy']:.3f}", f"**{t['ratio_eager']:.3f}**",
                     ", ".join(f"{c['forwards']}/{c['skipped']}" for c in cov.values()),
                     " / ".join(f"{t[k]['other_load_cores']:.2f}" for k in MODES)])
    return H.md_table(["triple", "order", "step without (ms)", "step lazy (ms)", "step eager (ms)", "lazy / without",
                       "eager / without", "eager forwards run / skipped (per worker)",
                       "other load (cores; without / lazy / eager)"], rows)


def _coverage_table(ov: dict) -> str:
    return H.md_table(["worker", "eager forwards run", "skipped (no idle slot)", "covered", "run per step",
                       "seconds in them per step (ms)", "memory kept (peak per step)"],
                      [[w, str(c["forwards"]), str(c["skipped"]), f"{100 * c['covered']:.1f} %" if c["covered"] is not None
                        else "-", f"{c['forwards_per_step']:.2f}", f"{1e3 * c['seconds_per_step']:.1f}",
                        H.mib(c["peak_bytes"])]
                       for w, c in ov["coverage"].items()])


def where_time_goes(ov: dict, rep: dict) -> dict:
    """The time lazy redundancy adds (the replica refresh) against what the refresh does on the
    slowest worker, timed in-process: building the message (a cat of the gradients) and the
    replica's step; and the time eager adds on top of lazy against the eager forwards' own
    seconds per step (run while a receive would wait: what they add is the wait they cause when
    the message arrives during one)."""
    added = ov["step_lazy_s"] - ov["step_without_s"]
    cpu = max(r["replica_apply_s"] + r["message_cat_s"] for r in rep["workers"])
    eager_s = [c["seconds_per_step"] for c in ov["coverage"].values() if c["seconds_per_step"] is not None]
    return {"added_step_s": added, "cat_plus_apply_s": cpu, "rest_s": added - cpu,
            "eager_added_step_s": ov["step_eager_s"] - ov["step_lazy_s"],
            "eager_forward_s_per_step_max": max(eager_s) if eager_s else None,
            "eager_total_added_step_s": ov["step_eager_s"] - ov["step_without_s"]}


def _failover_md(fo: dict | None) -> list[str]:
    if fo is None:
        return ["## (2b) Failover", "", "Not run (`--failover-reps 0`).", ""]
    rows = []
    for i, r in enumerate(fo["runs"]):
        if "error" in r:
            rows.append([str(i), f"failed: {r['error'][:200]}", "", "", "", "", "", ""])
            continue
        rows.append([str(i), str(r["failover_events"][0]["layout"] if r["failover_events"] else "none"),
                     f"{r['failover_s']:.2f}" if r["failover_s"] is not None else "",
                     f"{1e3 * r['step_before_s']:.0f}", f"{1e3 * r['step_after_s']:.0f}", f"{r['slowdown']:.2f}",
                     H.yes_no(r["no_step_lost"]), str(r.get("reused", "-"))])
    return [
        "## (2b) Failover (a worker SIGKILLed, its predecessor runs its stage from the replica)", "",
        f"The same layers, {fo['stages']} stages, one pipeline, redundancy on (eager, the default) ({fo['stages']} processes on 2 cores: "
        f"sleep-emulated compute overlaps, but the optimizer and replica steps of the workers share the 2 cores). "
        f"Worker {fo['victim_worker']} SIGKILLs itself at the start of step {fo['loss_step']} "
        f"(`FaultPlan(Fault(worker={fo['victim_worker']}, step={fo['loss_step']}, phase='before_forward'))`). "
        f"Failover = end of step {fo['loss_step'] - 1} -> end of the redone step {fo['loss_step']} (loss -> first "
        f"completed step, the redone step included); slowdown = median step after the failover / median step "
        f"before it. Reused: the lost stage's eager forwards the redone step spliced in (`Result.redundant_forwards`"
        f"[w]['reused'], summed: the victim dies at the start of its step, but its predecessor goes on with that "
        f"step's forwards and sends them, and may run the victim's forwards of them on its replica in its "
        f"bubbles before the failure is noticed; `bench/bamboo_failover.py` kills at random points of a step and "
        f"compares with lazy).", "",
        H.md_table(["run", "layout after", "failover (s)", "step before (ms)", "step after (ms)", "slowdown",
                    "every step once", "reused forwards"], rows), ""] + _stall_note(fo)


def _stall_note(fo: dict) -> list[str]:
    stalls = [(i, r["failover_s"]) for i, r in enumerate(fo["runs"])
              if "error" not in r and r.get("failover_s") is not None and r["failover_s"] > 30.0]
    if not stalls:
        return []
    return [f"**Stall**: run(s) {', '.join(f'{i} ({t:.1f} s)' for i, t in stalls)} went on only after more than "
            f"30 s: a stall, not a failover time (about the groups' 120 s timeout, `virtualflow/comm/groups.py`: a "
            f"receive waiting on a live peer that is not released), every step still done once. Left to the "
            f"engine's owner; the median above and the `failover_s` constant in this file include it "
            f"(`bench/results/bamboo_constants.json` takes failover_s from `bench/bamboo_failover.py` instead).", ""]


def markdown(run: H.Run, args, cal: dict, ov: dict, small: dict | None, rep: dict, rs: dict, fo: dict | None,
             constants: dict, sources: dict, sim: dict) -> str:
    params_stage = args.layers_per_stage * (args.width * args.width + args.width)
    lines: list[str] = [f"# {run.name}: Bamboo's redundant stages (replica refresh + eager redundant forwards) - "
                        f"overhead, restart, simulator constants", "", H.env_markdown(), ""]
    lines += [
        "**Not measured here, and why**: the **reconfiguration pause** (a replacement taking its stage back, "
        "`replace_failed`) and the **time-compressed replay** of a real trace are measured by "
        "`bench/bamboo_failover.py` (`bench/results/bamboo_failover.md`), not here; this file's constants leave "
        "`reconfigure_s` to the simulator's default and `bench/results/bamboo_constants.json` takes it from there. "
        "**Eager redundant forwards** (`Pipeline(redundancy=True)`'s default, `redundant_compute=\"eager\"`) are "
        "measured in (1) against lazy redundancy (`redundant_compute=\"lazy\"`: the replica refresh alone) and "
        "no redundancy; the eager forwards are SLEEP-EMULATED like every forward here (they take the emulated "
        "compute time but no CPU), so they stand for a device's idle slots, not for this CPU's cores.", "",
        "## (1) Redundancy overhead through `virtualflow.train`: without / lazy / eager", "",
        f"Job: {args.stages} stages (one worker process each, 1 thread), 1F1B, m = {args.m} micro-batches of "
        f"{args.mb}, AdamW; each stage {args.layers_per_stage} SLEEP-EMULATED Linear({args.width}, {args.width}) "
        f"layers ({params_stage / 1e6:.2f} M real parameters per stage, {args.stages * params_stage / 1e6:.2f} M "
        f"in all). Each layer sleeps forward {1e3 * args.f_s:.2f} ms and backward {1e3 * args.b_s:.2f} ms per "
        f"micro-batch: "
        + (f"the real `nn.Linear`'s times at micro-batch {args.mb} on this machine (calibrated, 1 thread, "
           f"fastest of {cal['reps']}: {1e3 * cal['forward_s']:.2f} / {1e3 * cal['backward_s']:.2f} ms)"
           if cal else "given on the command line (`--f-ms`, `--b-ms`)")
        + ". Parameters, gradients, the optimizer, the replica message and the replica's optimizer step are real; "
        f"the matrix multiplications are not. {len(ov['triples'])} interleaved triples (orders in turn, every "
        f"mode first, second and third equally often over 6 triples): **without** redundancy; **lazy** "
        f"(`Pipeline(redundancy=True, redundant_compute=\"lazy\")`: the replica refresh, no redundant forward); "
        f"**eager** (`Pipeline(redundancy=True)`, the default: the refresh + each worker runs its successor "
        f"stage's forward of the micro-batches it sent on its replica, in the schedule's bubbles). "
        f"{args.steps} steps per run ({args.warmup} warm-up), per run the median step time (rank 0's time between "
        f"step ends); a triple with more than {args.max_other_cores} cores of other load (`LoadMeter`) was "
        f"repeated up to {args.retries} times while the first {args.retry_budget:g} s lasted, then kept.", "",
        _triples_table(ov), "",
        f"**Overhead, eager (the default): {ov['overhead']:.3f}x** (median of per-triple eager / without, every "
        f"triple kept; target <= {TARGET_OVERHEAD}; key `redundancy_overhead`); **lazy: {ov['overhead_lazy']:.3f}x** "
        f"(key `redundancy_overhead_lazy`); eager / lazy {ov['eager_vs_lazy']:.3f}x. Per-triple spread: eager "
        f"{min(ov['ratios']):.3f}-{max(ov['ratios']):.3f}x, lazy {min(ov['ratios_lazy']):.3f}-"
        f"{max(ov['ratios_lazy']):.3f}x. Triples with at most {args.max_other_cores} cores of other load: "
        + (f"eager {ov['quiet_overhead']:.3f}x, lazy {ov['quiet_overhead_lazy']:.3f}x ({len(ov['quiet_ratios'])} "
           f"triples)" if ov["quiet_ratios"] else "none")
        + f" (a diagnostic). Eager was faster than lazy in {sum(t['eager_vs_lazy'] < 1 for t in ov['triples'])} of "
        f"{len(ov['triples'])} triples (eager / lazy {min(t['eager_vs_lazy'] for t in ov['triples']):.3f}-"
        f"{max(t['eager_vs_lazy'] for t in ov['triples']):.3f})"
        + (": a systematic difference this benchmark does not explain (both run the same refresh; eager's "
           "forwards sleep and use no CPU; one difference is that the engine hands the wait of a polled receive "
           "to a thread, which may take the message's transfer off the step's path under this load: not checked)"
           if all(t["eager_vs_lazy"] < 1 for t in ov["triples"]) else "")
        + f". Median steps {1e3 * ov['step_without_s']:.1f} ms without, "
        f"{1e3 * ov['step_lazy_s']:.1f} ms lazy, {1e3 * ov['step_eager_s']:.1f} ms eager; throughput "
        f"{args.m * args.mb / ov['step_without_s']:.0f} / {args.m * args.mb / ov['step_lazy_s']:.0f} / "
        f"{args.m * args.mb / ov['step_eager_s']:.0f} samples/s.", "",
        f"Eager coverage (`Result.redundant_forwards`, summed over the {len(ov['triples'])} eager runs, warm-up "
        f"steps included; a worker owes one forward per micro-batch and step, {args.m} per step here):", "",
        _coverage_table(ov), ""]
    if small is not None:
        w = where_time_goes(small, rep)
        if cal is None and getattr(args, "small_f_ms", None) is None:
            lines += ["**Caveat**: in this run the micro-batch diagnostic below used the main run's emulated layer "
                      "times (given on the command line, not calibrated for its micro-batch: a gap of the benchmark "
                      "then, fixed since with `--small-f-ms`/`--small-b-ms`), so it has the same compute per "
                      "micro-batch as the main triples, not 1/8 of it: it does not show what it was meant to and is "
                      "not interpreted.", ""]
        lines += [
            f"**Diagnostic, not a target**: the same triples at micro-batch {small['mb']} ({args.m * small['mb']} "
            f"samples per step instead of {args.m * args.mb}"
            + ("" if cal is None and getattr(args, "small_f_ms", None) is None else
               f": 1/{args.mb // small['mb']} of the compute per parameter and step")
            + f"; emulated layer forward {1e3 * small['f_s']:.2f} ms, backward {1e3 * small['b_s']:.2f} ms), "
            f"{small['steps']} steps per run ({small['warmup']} warm-up):", "",
            _triples_table(small), "",
            f"Overhead at micro-batch {small['mb']}: eager **{small['overhead']:.3f}x**, lazy "
            f"{small['overhead_lazy']:.3f}x (steps {1e3 * small['step_without_s']:.1f} -> lazy "
            f"{1e3 * small['step_lazy_s']:.1f} -> eager {1e3 * small['step_eager_s']:.1f} ms: the refresh "
            f"+{1e3 * w['added_step_s']:.1f} ms, the eager forwards {1e3 * w['eager_added_step_s']:+.1f} ms more). "
            f"The refresh costs about a fixed time per step (message + duplicate optimizer step, proportional to the "
            f"stage's parameters), so its share falls as the compute per parameter and step grows.", "",
            "Eager coverage at this micro-batch:", "", _coverage_table(small), ""]
    w = where_time_goes(ov, rep)
    eager_fw = w["eager_forward_s_per_step_max"]
    fst, bst = args.layers_per_stage * args.f_s, args.layers_per_stage * args.b_s
    lines += [
        f"Where the added time goes (micro-batch {args.mb}). **Lazy** (the refresh): +{1e3 * w['added_step_s']:.1f} "
        f"ms per step; the slowest worker's message build (cat of the gradients) + replica step "
        f"(`StageReplica.apply`), timed in-process, are {1e3 * w['cat_plus_apply_s']:.1f} ms; the rest "
        f"({1e3 * w['rest_s']:.1f} ms) is the message's transfer and waiting (the exchange sits between the "
        f"reduction and the step's commit, on the critical path) plus noise. **Eager on top of lazy**: "
        f"{1e3 * w['eager_added_step_s']:+.1f} ms per step (median eager step - median lazy step) while the "
        f"busiest worker spends "
        + (f"{1e3 * eager_fw:.1f} ms per step in eager forwards" if eager_fw is not None else "no time in eager forwards")
        + ". The engine starts an eager forward only in one of the schedule's bubbles (a receive whose predicted "
        "wait, from the schedule simulated with the worker's measured forward/backward times of its last step, "
        "still holds the forward within 1.1x, and while the message has not arrived; or the tail after its last "
        "action) and skips the rest (counted; a failover recomputes them; the first step, with no times "
        "measured yet, skips all). In a bubble they cost nothing; what they add is the wait when the awaited "
        "message arrives while a forward is running (at most one forward, here one stage's emulated forward "
        f"{1e3 * fst:.1f} ms, per receive that catches one), plus keeping their graphs until the commit. "
        f"**How many can fit**: a worker owes m = {args.m} forwards of its successor's stage per step, m x f = "
        f"{1e3 * args.m * fst:.0f} ms of emulated forward, while 1F1B leaves each worker (p - 1)(f + b) = "
        f"{1e3 * (args.stages - 1) * (fst + bst):.0f} ms idle per step (f = {1e3 * fst:.1f}, b = {1e3 * bst:.1f} "
        f"ms per stage and micro-batch: the fill and drain bubble): at most "
        f"{min(1.0, (args.stages - 1) * (fst + bst) / (args.m * fst)):.0%} of them fit in the nominal schedule; "
        "measured coverage above. More stages (a bigger bubble) cover more; more micro-batches fewer.", "",
        "### Replica memory, extra bytes per step, the duplicate optimizer step", "",
        H.md_table(["worker (stage)", "replica of stage", "replica bytes (`StageReplica.nbytes()`)",
                    "successor's params + buffers + optimizer state", "message bytes per step",
                    "replica apply (ms)", "own optimizer step (ms)", "cat of the gradients (ms)"],
                   [[str(r["worker"]), str(r["replica_of"]), f"{r['replica_bytes']:,} ({H.mib(r['replica_bytes'])})",
                     f"{r['expected_bytes']:,}", f"{r['message_bytes']:,} ({H.mib(r['message_bytes'])})",
                     f"{1e3 * r['replica_apply_s']:.1f}", f"{1e3 * r['own_optimizer_step_s']:.1f}",
                     f"{1e3 * r['message_cat_s']:.1f}"] for r in rep["workers"]]), "",
        f"Extra bytes sent per step (all workers): {rep['message_bytes_per_step']:,} "
        f"({H.mib(rep['message_bytes_per_step'])}): one message per worker of its stage's reduced gradients "
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
    given = "".join(f" --{k.replace('_', '-')} {getattr(args, k):g}" for k in ("f_ms", "b_ms")
                    if getattr(args, k) is not None)
    lines += [f"Reproduce: `{run.command(NAME, given)}`"
              + (" (the emulated layer times given: a calibration on this loaded machine would measure the other "
                 "load, not the layer)" if given else "")]
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
                   help="diagnostic triples at this micro-batch (less compute per parameter; 0: skip)")
    p.add_argument("--small-triples", type=int, default=3)
    p.add_argument("--small-f-ms", type=float, default=None, help="emulated forward per layer at --small-mb (with "
                   "--f-ms/--b-ms given; default: calibrated)")
    p.add_argument("--small-b-ms", type=float, default=None, help="emulated backward per layer at --small-mb")
    p.add_argument("--small-steps", type=int, default=30)
    p.add_argument("--f-ms", type=float, default=None, help="emulated forward per layer and micro-batch (default: "
                   "calibrated from the real nn.Linear)")
    p.add_argument("--b-ms", type=float, default=None, help="emulated backward per layer and micro-batch")
    p.add_argument("--triples", type=int, default=6, help="interleaved triples without / lazy / eager")
    p.add_argument("--steps", type=int, default=14, help="steps per run")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--max-other-cores", type=float, default=0.3, help="repeat a triple with more other load")
    p.add_argument("--retries", type=int, default=2, help="repeat a triple with more other load up to this many times "
                   "(while --retry-budget seconds have not passed)")
    p.add_argument("--retry-budget", type=float, default=150.0,
                   help="seconds of the overhead measurement after which loaded triples are no longer repeated")
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
        args.triples, args.steps, args.warmup, args.restart_reps, args.apply_reps, args.small_triples = 2, 8, 2, 1, 3, 0
        args.checkpoint_every, args.quiet_wait, args.retry_budget = 3, min(args.quiet_wait, 3.0), 0.0
        args.failover_reps, args.failover_step, args.failover_after = 1, 4, 5
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    run = H.Run(NAME, args, TARGET_KEYS)
    torch.set_num_threads(1)
    logging.getLogger("virtualflow").setLevel(logging.ERROR)
    print(H.banner(f"bamboo: Pipeline(redundancy=True) overhead, lazy and eager ({args.stages} stages, 1f1b, m={args.m}, "
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
    print("(1) overhead: interleaved triples, without / lazy / eager redundancy", flush=True)
    ov = measure_overhead(args, args.triples, retry_budget_s=args.retry_budget)
    small = None
    if args.small_mb and args.small_triples and cal is None and (args.small_f_ms is None or args.small_b_ms is None):
        print(f"    diagnostic at micro-batch {args.small_mb} skipped: the layer times were given (--f-ms/--b-ms) and "
              "--small-f-ms/--small-b-ms were not", flush=True)
    elif args.small_mb and args.small_triples:
        sargs = copy.copy(args)
        sargs.mb, sargs.steps, sargs.warmup = args.small_mb, args.small_steps, 5
        small_cal = calibrate(args.width, args.small_mb, 60) if cal is not None else None
        if small_cal is not None:
            sargs.f_s, sargs.b_s = small_cal["forward_s"], small_cal["backward_s"]
        else:
            sargs.f_s, sargs.b_s = args.small_f_ms / 1e3, args.small_b_ms / 1e3
        print(f"    diagnostic: micro-batch {sargs.mb} (emulated forward {1e3 * sargs.f_s:.2f} ms, backward "
              f"{1e3 * sargs.b_s:.2f} ms per layer)", flush=True)
        small = measure_overhead(sargs, args.small_triples, "small-batch triple")
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
    t.at_most("redundancy_overhead", f"step time eager redundancy (the default) / without ({args.stages} stages, "
              "1f1b, emulated compute, median of per-triple ratios)", ov["overhead"], TARGET_OVERHEAD, "x")
    t.at_most("redundancy_overhead_lazy", f"step time lazy redundancy (refresh only) / without ({args.stages} "
              "stages, 1f1b, emulated compute, median of per-triple ratios; the issue's bound applies to eager, "
              "shown for comparison)", ov["overhead_lazy"], TARGET_OVERHEAD, "x")
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
               | {"reconfigure_s": "measured by bench/bamboo_failover.py (bench/results/bamboo_constants.json), not here",
                  "trace_replay": "measured by bench/bamboo_failover.py, not here"},
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
