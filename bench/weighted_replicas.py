"""Speed-weighted micro-batch shares of pipeline replicas (issue 31): 2 replicas, one slower, step
time with shares weighted by speed against equal shares.

The job: 2 pipeline replicas of ``--stages`` (3) stages (6 workers), 1F1B, ``--m`` (12)
micro-batches (virtual nodes) per step, default mode, trained through ``virtualflow.launch`` on the
local backend (one process per worker, 1 thread each). Each stage is one SLEEP-EMULATED layer
(``bench/harness/sleep_stages.py``: a real ``--width`` x ``--width`` weight, forward ``--f-ms`` and
backward ``--b-ms`` per micro-batch as sleeps), so that 6 processes overlap on 2 shared cores as on
their own devices. Replica 1's workers run ``--slowdown`` (2x) slower (``WorkerSpec.slowdown``:
each compute action is followed by a sleep of ``slowdown - 1`` times its duration).

Two runs of the same job in one invocation:

* **weighted** - ``slowdowns=[1, 1, 1, s, s, s]`` (balance on): the controller gives each replica
  the share that minimises the predicted step (``virtualflow.plan.replica_shares``);
* **equal** - the same slowdowns with ``balance=False``: 6 and 6 micro-batches.

The model (1F1B, a replica of equal stages of ``t = f + b`` each and ``m`` micro-batches):
``(m + p - 1) t`` for the fast replica, ``(m + p - 1) s t`` for the slow one; the step is the
slower of the two (plus the reduction and the optimizer, not modelled). With the defaults, equal
6/6 predicts ``max(8, 16) t = 16 t`` and the solver's 9/3 ``max(11, 10) t = 11 t``: weighted
1.45x faster. Target (key ``speedup_vs_model``): measured speedup (equal's median step /
weighted's) at least 0.85x the model's, i.e. within 15 % of what the model predicts or better.
Also checked: the weighted run used the solver's shares.

From the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.weighted_replicas            # about 1.5 minutes
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.weighted_replicas --quick    # about 1 minute
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from bench import harness as H
from bench.harness.sleep_stages import adamw, configure_stages, data, model, output_loss

NAME = "weighted_replicas"
TARGET_KEYS = ("speedup_vs_model",)
TARGET_SPEEDUP_VS_MODEL = 0.85
REPLICAS = 2


def weighted_job():
    """The job (module level: the worker processes import it); its shape from ``VF_WR_*``."""
    import virtualflow as vf

    env = os.environ
    m = int(env.get("VF_WR_M", "12"))
    return vf.Job(model=model, optimizer=adamw, output_loss=output_loss, dataset=data,
                  global_batch_size=m * int(env.get("VF_WR_MB", "4")), virtual_nodes=m, seed=H.SEED, name=NAME,
                  pipeline=vf.Pipeline(stages=int(env.get("VF_WR_STAGES", "3")), schedule="1f1b"))


def configure(args) -> None:
    os.environ.update(configure_stages(width=args.width, stages=args.stages, f_ms=args.f_ms, b_ms=args.b_ms),
                      VF_WR_STAGES=str(args.stages), VF_WR_M=str(args.m), VF_WR_MB=str(args.mb))


def model_prediction(args) -> dict:
    """The shares and step times of the time model, in seconds of emulated compute."""
    from virtualflow.plan.replica_shares import predict_step_s, replica_time, solve_shares

    t = (args.f_ms + args.b_ms) / 1e3
    times = [replica_time([t] * args.stages), replica_time([t * args.slowdown] * args.stages)]
    best = solve_shares(args.m, times)
    equal = [args.m - args.m // REPLICAS, args.m // REPLICAS]
    equal_s = predict_step_s(equal, times)
    return {"weighted_shares": best.counts, "equal_shares": equal, "weighted_step_s": best.predicted_step_s,
            "equal_step_s": equal_s, "speedup": equal_s / best.predicted_step_s}


def one_run(args, balance: bool) -> dict:
    import virtualflow as vf

    workers = REPLICAS * args.stages
    slowdowns = [1.0] * args.stages + [args.slowdown] * args.stages
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = os.path.join(tmp, "run")
        with H.LoadMeter() as meter:
            handle = vf.launch(weighted_job, workers=workers, steps=args.steps, threads_per_worker=1,
                               run_dir=run_dir, slowdowns=slowdowns, balance=balance)
            try:
                H.wait_steps(handle, run_dir, 2, timeout_s=180)
                status = handle.status()
                result = handle.wait()
            finally:
                if not handle.done:
                    handle.stop(timeout_s=30)
        metrics = H.run_metrics(run_dir)
    ranks = sorted(status["workers"], key=lambda w: w["rank"] if w["rank"] is not None else 1 << 30)
    shares = [len(ranks[j * args.stages]["vns"]) for j in range(REPLICAS)]
    times = [m["step_time_s"] for m in metrics]
    return {"balance": balance, "shares": shares, "step_s": H.median(times[args.warmup:]),
            "step_times_s": times, "steps": len(result.history), "other_load_cores": meter.other_cores,
            "generations": sorted({m["generation"] for m in metrics})}


def parse_args(argv=None):
    p = H.parser(__doc__, quiet_wait=20.0)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--m", type=int, default=12, help="micro-batches (virtual nodes) per step, over the 2 replicas")
    p.add_argument("--mb", type=int, default=4, help="samples per micro-batch")
    p.add_argument("--width", type=int, default=256, help="each stage's weight is width x width")
    p.add_argument("--f-ms", type=float, default=12.0, help="emulated forward per stage and micro-batch")
    p.add_argument("--b-ms", type=float, default=24.0, help="emulated backward per stage and micro-batch")
    p.add_argument("--slowdown", type=float, default=2.0, help="replica 1's workers' WorkerSpec.slowdown")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=4, help="steps left out of the median")
    args = p.parse_args(argv)
    if args.quick:
        args.steps = 16
    return args


def markdown(run, args, runs: dict, nom: dict, speedup: float, env: dict) -> str:
    rows = [[name, r["shares"], f"{nom[name + '_step_s'] * 1e3:.0f}", f"{r['step_s'] * 1e3:.1f}",
             f"{r['other_load_cores']:.2f}"] for name, r in runs.items()]
    return "\n".join([
        f"# {run.name}: speed-weighted micro-batch shares of {REPLICAS} pipeline replicas",
        "",
        f"{REPLICAS} replicas x {args.stages} sleep-emulated stages (f={args.f_ms:g} ms, b={args.b_ms:g} ms per "
        f"micro-batch, {args.width}x{args.width} weights), 1F1B, m={args.m}, replica 1's workers at slowdown "
        f"{args.slowdown:g}; {args.steps} steps per run, the first {args.warmup} left out. Taken on a shared 2-core "
        f"machine under other load (last column). Reproduce: `{run.command(NAME)}`.",
        "",
        H.md_table(["run", "shares (replica 0, 1)", "model step ms", "measured step ms (median)",
                    "other load (cores)"], rows),
        "",
        f"Speedup of the weighted shares: measured {speedup:.3f}x, model {nom['speedup']:.3f}x "
        f"(measured / model {speedup / nom['speedup']:.3f}). The model counts emulated compute only "
        f"(1F1B: (m + p - 1) stage times on the slower replica); the reduction, the optimizer and the messages "
        f"add about the same absolute time to both runs, which lowers the measured ratio a little.",
        "",
        H.env_markdown(env),
    ])


def main(argv=None) -> int:
    args = parse_args(argv)
    run = H.Run(NAME, args, TARGET_KEYS)
    torch.set_num_threads(1)
    configure(args)
    env = H.environment()
    nom = model_prediction(args)
    print(H.banner(f"weighted_replicas: {REPLICAS} replicas x {args.stages} stages, 1f1b, m={args.m}; replica 1 "
                   f"at slowdown {args.slowdown:g}; model: weighted {nom['weighted_shares']} "
                   f"{nom['weighted_step_s'] * 1e3:.0f} ms vs equal {nom['equal_shares']} "
                   f"{nom['equal_step_s'] * 1e3:.0f} ms ({nom['speedup']:.3f}x)"))
    runs = {}
    for name, balance in (("weighted", True), ("equal", False)):
        H.wait_for_quiet(args.quiet_wait)
        runs[name] = r = one_run(args, balance)
        print(f"  {name}: shares {r['shares']}, median step {r['step_s'] * 1e3:.1f} ms (model "
              f"{nom[name + '_step_s'] * 1e3:.0f} ms), other load {r['other_load_cores']:.2f} cores", flush=True)
    w, e = runs["weighted"], runs["equal"]
    speedup = e["step_s"] / w["step_s"]
    t = run.targets
    t.at_least("speedup_vs_model", f"measured speedup of weighted over equal shares ({speedup:.3f}x) / the model's "
               f"({nom['speedup']:.3f}x)", speedup / nom["speedup"], TARGET_SPEEDUP_VS_MODEL, "x")
    t.holds(f"the weighted run used the solver's shares {nom['weighted_shares']}, the equal run "
            f"{nom['equal_shares']}", w["shares"] == nom["weighted_shares"] and e["shares"] == nom["equal_shares"],
            f"(weighted {w['shares']}, equal {e['shares']})")
    t.holds("every step ran, each run in one generation", w["steps"] == e["steps"] == args.steps
            and w["generations"] == e["generations"] == [0])
    payload = {"benchmark": run.name, "environment": env, "config": vars(args), "model": nom, "runs": runs,
               "speedup": speedup}
    return run.finish(payload, markdown(run, args, runs, nom, speedup, env))


if __name__ == "__main__":
    sys.exit(main())
