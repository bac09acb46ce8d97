"""The measurements: the real layer's calibration, (1) the redundancy overhead in interleaved
triples (without / lazy / eager), the replica's bytes and duplicate optimizer step, (2) checkpoint
write and restart, (2b) failover after a worker kills itself.

Each returns a plain dict (the JSON payload's part); none prints targets.
"""

from __future__ import annotations

import copy
import os
import tempfile
import time

import torch
from torch import nn

from bench import harness as H
from bench.bamboo.workload import MODES, bamboo_job, configure


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
    from virtualflow.plan.pipeline.geometry import layers_of, resolve_bounds
    from virtualflow.plan.vnmap import contiguous_assignment
    from virtualflow.backends.inprocess import LocalDriver, build_engine

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
