"""Bamboo failover inside one of several pipeline replicas (issue 16): what a job of 2 replicas x
3 stages keeps when it loses one worker.

The job: 2 pipeline replicas of ``--stages`` (3) stages (``--workers`` = 6), 1F1B, ``--m`` (8)
micro-batches per step (4 per replica: equal shares, no speed weighting), default mode, trained
through ``virtualflow.launch`` on the local backend (one process per worker, 1 thread each). Each
stage is one SLEEP-EMULATED layer: a real ``--width`` x ``--width`` weight and bias (so the replica
refresh, the re-layout and the optimizer are real costs of real sizes) whose forward sleeps
``--f-ms`` and backward ``--b-ms`` per micro-batch (12 / 24 ms by default, the stage
``bench.bamboo_failover`` uses, from ``bench/harness/sleep_stages.py``), so that 6 processes overlap on 2 cores as on their own devices.

Two runs, the same kill in each (SIGKILL of replica 1's middle worker, from ``handle.status()``,
after ``--before-steps`` steps):

* **bamboo** - ``Pipeline(redundancy=True)``: the lost worker's predecessor in replica 1 takes its
  stage over (replica 1 runs on 2 workers, replica 0 stays at 3): 5 workers go on.
* **plain** - the same job without redundancy (the plain way: a pipelined job keeps whole
  replicas): replica 1 leaves whole and replica 0 runs every micro-batch: 3 workers go on.

Measured per run: the full-depth step before the kill (median, warm-up left out), the step after
it (median, the first two after the new generation left out), and the stop (kill -> end of the
first step completed after it, the interrupted step redone). Targets (the issue's): bamboo's step
after the kill / its full-depth step (key ``slowdown``, <= 1.5x, Bamboo's constant) and its stop
(key ``failover_s``, <= 1 s). Reported, not a target: bamboo's step after the kill / plain's.
Nominal (1F1B, equal stages): failed over ``(2 m_r + p - 2) / (m_r + p - 1)``, replica dropped
``(2 m_r + p - 1) / (m_r + p - 1)`` with ``m_r`` = m / 2 micro-batches per replica: with equal
shares the synchronous step waits for the failed-over replica, so keeping it buys little over
dropping it (the plain run also pays no redundancy overhead). This run keeps equal shares (no
``--balance``); shares weighted by the replicas' speeds are measured by ``bench.weighted_replicas``.

From the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.bamboo_replicas            # about 2 minutes
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.bamboo_replicas --quick    # about 1 minute
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from bench import harness as H
from bench.harness.sleep_stages import adamw, configure_stages, data, model, output_loss

NAME = "bamboo_replicas"
TARGET_KEYS = ("slowdown", "failover_s")
TARGET_SLOWDOWN = 1.5
TARGET_FAILOVER_S = 1.0
REPLICAS = 2


# --------------------------------------------------------------------------------------------
# The workload: bench/harness/sleep_stages.py's sleep-emulated stages (shape from its VF_BF_*
# variables); the job around them from VF_BR_* (module level: the worker processes import it).


def replicas_job():
    import virtualflow as vf

    env = os.environ
    m = int(env.get("VF_BR_M", "8"))
    return vf.Job(model=model, optimizer=adamw, output_loss=output_loss, dataset=data,
                  global_batch_size=m * int(env.get("VF_BR_MB", "4")), virtual_nodes=m, seed=H.SEED, name=NAME,
                  pipeline=vf.Pipeline(stages=int(env.get("VF_BR_STAGES", "3")), schedule="1f1b",
                                       redundancy=env.get("VF_BR_REDUNDANCY", "1") == "1"))


def configure(args) -> None:
    os.environ.update(configure_stages(width=args.width, stages=args.stages, f_ms=args.f_ms, b_ms=args.b_ms),
                      VF_BR_STAGES=str(args.stages), VF_BR_M=str(args.m), VF_BR_MB=str(args.mb))


def nominal(args) -> dict:
    p, mr, fb = args.stages, args.m // REPLICAS, (args.f_ms + args.b_ms) / 1e3
    full = (mr + p - 1) * fb
    return {"full_step_s": full, "failed_over_step_s": (2 * mr + p - 2) * fb, "dropped_step_s": (2 * mr + p - 1) * fb,
            "slowdown_failed_over": (2 * mr + p - 2) / (mr + p - 1), "slowdown_dropped": (2 * mr + p - 1) / (mr + p - 1)}


# --------------------------------------------------------------------------------------------


def one_run(args, redundancy: bool) -> dict:
    import virtualflow as vf

    workers = REPLICAS * args.stages
    victim_rank = args.stages + args.stages // 2  # replica 1's middle worker
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = os.path.join(tmp, "run")
        os.environ["VF_BR_REDUNDANCY"] = "1" if redundancy else "0"  # the workers inherit it at launch
        try:
            handle = vf.launch(replicas_job, workers=workers, steps=10 ** 6, threads_per_worker=1, run_dir=run_dir)
        finally:
            os.environ["VF_BR_REDUNDANCY"] = "1"
        try:
            H.wait_steps(handle, run_dir, args.before_steps, timeout_s=180)
            with H.LoadMeter() as meter:
                st = handle.status()
                w = next(w for w in st["workers"] if w["rank"] == victim_rank)
                t_kill = time.time()
                os.kill(w["pid"], signal.SIGKILL)
                n0 = len(H.run_metrics(run_dir))
                H.wait_steps(handle, run_dir, n0 + args.after_steps, timeout_s=args.stuck_s)
            result = handle.stop()
        finally:
            if not handle.done:
                try:
                    handle.stop(timeout_s=30)
                except Exception:  # noqa: BLE001 - the run's own error is what is reported
                    pass
        metrics, events = H.run_metrics(run_dir), H.run_events(run_dir)
    gen_kill = max(m["generation"] for m in metrics if m["time"] < t_kill)
    before = [m["step_time_s"] for m in metrics if m["generation"] == gen_kill and m["time"] < t_kill]
    after = [m for m in metrics if m["generation"] > gen_kill]
    steps = [h["step"] for h in result.history]
    return {
        "redundancy": redundancy, "victim_worker": w["id"], "victim_rank": victim_rank,
        "full_step_s": H.median(before[args.warmup:]), "after_step_s": H.median([m["step_time_s"] for m in after][2:]),
        "workers_after": after[-1]["workers"], "stop_s": after[0]["time"] - t_kill,
        "every_step_once": steps == list(range(len(steps))),
        "failover_events": [{k: e.get(k) for k in ("replica", "layout", "taken_over")}
                            for e in events if e["event"] == "failover"],
        "other_load_cores": meter.other_cores, "steps": len(steps),
    }


def parse_args(argv=None):
    p = H.parser(__doc__, quiet_wait=20.0)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--m", type=int, default=8, help="micro-batches per step (split equally over the 2 replicas)")
    p.add_argument("--mb", type=int, default=4, help="samples per micro-batch")
    p.add_argument("--width", type=int, default=1024, help="each stage's weight is width x width")
    p.add_argument("--f-ms", type=float, default=12.0, help="emulated forward per stage and micro-batch")
    p.add_argument("--b-ms", type=float, default=24.0, help="emulated backward per stage and micro-batch")
    p.add_argument("--before-steps", type=int, default=12, help="steps before the kill")
    p.add_argument("--after-steps", type=int, default=14, help="steps after the kill")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--stuck-s", type=float, default=90.0)
    args = p.parse_args(argv)
    if args.quick:
        args.before_steps, args.after_steps = 8, 8
    return args


def markdown(run, args, runs: dict, nom: dict, env: dict) -> str:
    b, q = runs["bamboo"], runs["plain"]
    rows = [[name, f"{r['full_step_s'] * 1e3:.1f}", f"{r['after_step_s'] * 1e3:.1f}",
             f"{r['after_step_s'] / r['full_step_s']:.3f}x", r["workers_after"], f"{r['stop_s']:.2f}",
             r["every_step_once"], f"{r['other_load_cores']:.2f}"]
            for name, r in (("bamboo (replica 1 fails over)", b), ("plain (replica 1 leaves whole)", q))]
    return "\n".join([
        f"# {run.name}: failover inside one of {REPLICAS} pipeline replicas",
        "",
        f"{REPLICAS} replicas x {args.stages} sleep-emulated stages (f={args.f_ms:g} ms, b={args.b_ms:g} ms per "
        f"micro-batch, {args.width}x{args.width} weights), 1F1B, m={args.m} ({args.m // REPLICAS} per replica), "
        f"replica 1's middle worker SIGKILLed after {args.before_steps} steps. Reproduce: `{run.command(NAME)}`.",
        "",
        H.md_table(["run", "full-depth step ms", "step after the kill ms", "after / full", "workers after",
                    "kill -> next step s", "every step once", "other load (cores)"], rows),
        "",
        f"Nominal 1F1B: failed over {nom['slowdown_failed_over']:.3f}x, replica dropped "
        f"{nom['slowdown_dropped']:.3f}x. Bamboo's step after the kill / plain's: "
        f"{b['after_step_s'] / q['after_step_s']:.3f} (with equal micro-batch shares the synchronous step waits "
        f"for the failed-over replica; dropping the replica doubles the other replica's micro-batches; the plain "
        f"run pays no redundancy overhead: its full-depth step is {b['full_step_s'] / q['full_step_s']:.3f}x "
        f"shorter). This run keeps equal shares; with --balance the failed-over replica gets a smaller share "
        f"(bench.weighted_replicas).",
        f"Failover events: {b['failover_events']}.",
        "",
        H.env_markdown(env),
    ])


def main(argv=None) -> int:
    args = parse_args(argv)
    run = H.Run(NAME, args, TARGET_KEYS)
    torch.set_num_threads(1)
    configure(args)
    env = H.environment()
    print(H.banner(f"bamboo_replicas: {REPLICAS} replicas x {args.stages} stages, 1f1b, m={args.m}; emulated "
                   f"stages f={args.f_ms:g} ms b={args.b_ms:g} ms; kill replica 1's middle worker"))
    runs = {}
    for name, redundancy in (("bamboo", True), ("plain", False)):
        H.wait_for_quiet(args.quiet_wait)
        runs[name] = one_run(args, redundancy)
        r = runs[name]
        print(f"  {name}: full {r['full_step_s'] * 1e3:.1f} ms, after the kill {r['after_step_s'] * 1e3:.1f} ms on "
              f"{r['workers_after']} workers ({r['after_step_s'] / r['full_step_s']:.3f}x), kill -> next step "
              f"{r['stop_s']:.2f} s, every step once {r['every_step_once']}", flush=True)
    nom = nominal(args)
    b, q = runs["bamboo"], runs["plain"]
    t = run.targets
    t.at_most("slowdown", f"bamboo: step after the kill / full-depth step (nominal {nom['slowdown_failed_over']:.3f})",
              b["after_step_s"] / b["full_step_s"], TARGET_SLOWDOWN, "x")
    t.at_most("failover_s", "bamboo: SIGKILL -> end of the first step completed after it", b["stop_s"],
              TARGET_FAILOVER_S, " s")
    t.holds("every step exactly once in both runs", b["every_step_once"] and q["every_step_once"])
    t.holds("bamboo: replica 1 failed over, 5 workers went on",
            b["workers_after"] == REPLICAS * args.stages - 1 and [e["replica"] for e in b["failover_events"]] == [1])
    print(f"  bamboo's step after the kill / plain's: {b['after_step_s'] / q['after_step_s']:.3f} (not a target)")
    payload = {"benchmark": run.name, "environment": env, "config": vars(args), "nominal": nom, "runs": runs,
               "bamboo_vs_plain_after_kill": b["after_step_s"] / q["after_step_s"]}
    return run.finish(payload, markdown(run, args, runs, nom, env))


if __name__ == "__main__":
    sys.exit(main())
