"""The command line: flags (``--quick`` and the benchmark's own), and :func:`main`, which runs the
parts, checks the targets and writes the results.
"""

from __future__ import annotations

import torch

from bench import harness as H
from bench import bamboo_failover as package  # its docstring describes the benchmark (--help)
from bench.bamboo_failover.workload import (
    NAME, TARGET_FAILOVER_S, TARGET_KEYS, TARGET_REPLAY_ERROR, TARGET_SLOWDOWN, TARGET_VS_CHECKPOINT,
    TARGET_VS_ON_DEMAND, configure, nominal_failed_over_s, nominal_full_s,
)
from bench.bamboo_failover.kills import measure_kills
from bench.bamboo_failover.replay import predict_replay, replay_plan, run_replay
from bench.bamboo_failover.simulate import simulate_value, what_if, write_constants
from bench.bamboo_failover.report import markdown


# --------------------------------------------------------------------------------------------
# Command line.


def parse_args(argv):
    p = H.parser(package.__doc__, prog="python -m bench.bamboo_failover", reps=3, reps_help="kill runs of each kind (without / with a replacement)", quiet_wait=20.0)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--m", type=int, default=8, help="micro-batches per step")
    p.add_argument("--mb", type=int, default=4, help="samples per micro-batch")
    p.add_argument("--width", type=int, default=1024, help="each stage's weight is width x width")
    p.add_argument("--f-ms", type=float, default=12.0, help="emulated forward per stage and micro-batch")
    p.add_argument("--b-ms", type=float, default=24.0, help="emulated backward per stage and micro-batch")
    p.add_argument("--before-steps", type=int, default=10, help="steps before the kill")
    p.add_argument("--after-steps", type=int, default=12, help="steps after the failover / reconfiguration")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--stuck-s", type=float, default=60.0,
                   help="a job that does not reach the next milestone after a kill within this time is stuck")
    p.add_argument("--replay-window-min", type=float, nargs=2, default=(19.0, 87.0),
                   help="the window of the p2 trace replayed, in trace minutes")
    p.add_argument("--replay-speedup", type=float, default=40.0)
    args = p.parse_args(argv)
    if args.quick:
        args.reps, args.before_steps, args.after_steps = 1, 8, 8
        args.replay_window_min = (19.0, 48.0)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    run = H.Run(NAME, args, TARGET_KEYS)
    torch.set_num_threads(1)
    configure(args)
    env = H.environment()
    print(H.banner(f"bamboo_failover: {args.stages} stages, one pipeline, redundancy, 1f1b, m={args.m}; "
                   f"emulated stages f={args.f_ms:g} ms b={args.b_ms:g} ms"))
    print("(1)-(3) kill the middle stage: failover, slowdown, reconfiguration", flush=True)
    ks = measure_kills(args)
    print("(4) time-compressed replay", flush=True)
    plan = replay_plan(args)
    H.wait_for_quiet(args.quiet_wait)
    rp = run_replay(args, plan)
    pred = None if rp.get("stuck") else predict_replay(args, rp, ks)
    if pred is not None:
        print(f"  replay: {rp['history_steps']} steps, every step once {rp['every_step_once']}; measured "
              f"{rp['measured_samples_per_s']:.1f} samples/s, predicted {pred['predicted_samples_per_s']:.1f} "
              f"({100 * pred['error']:+.1f} %)", flush=True)
    print("(5) constants and the simulator's value on the p2 trace", flush=True)
    cs = write_constants(run, ks, env)
    val = simulate_value(cs["path"])
    val["what_if"] = what_if(cs["path"], cs["bamboo_py_constants"])
    print(f"  wrote {cs['path']}; bamboo vs on-demand {val['vs_on_demand']:.2f}x, vs checkpoint "
          f"{val['vs_checkpoint']:.2f}x", flush=True)
    t = run.targets
    t.at_most("failover_s", f"failover time, SIGKILL -> first completed step, eager (the default; median of "
              f"{len(ks['runs'])})",
              ks["failover_s"], TARGET_FAILOVER_S, " s")
    t.at_most("failover_slowdown", f"failed-over step / full-depth step ({args.stages} equal stages, m={args.m}; "
              f"1F1B's nominal {nominal_failed_over_s(args) / nominal_full_s(args):.3f})", ks["slowdown"],
              TARGET_SLOWDOWN, "x")
    t.holds("every step exactly once in every kill run (eager and lazy)", ks["every_step_once"])
    t.holds(f"every kill run went on after the kill ({len(ks['stuck'])} of "
            f"{len(ks['runs']) + len(ks['lazy_runs']) + len(ks['stuck'])} stuck)",
            not ks["stuck"])
    if pred is None:
        t.holds("replay: the job went on after every kill", False, rp["error"])
        t.at_most("replay_error", "replay: |measured / predicted throughput - 1| (no replay)", float("nan"),
                  TARGET_REPLAY_ERROR)
    else:
        t.holds(f"replay: 0 lost steps (every step in Result.history exactly once, {rp['history_steps']} steps, "
                f"{rp['failovers']} failovers)", rp["every_step_once"] and rp["fallbacks"] == 0)
        t.at_most("replay_error", "replay: |measured / predicted throughput - 1|", abs(pred["error"]),
                  TARGET_REPLAY_ERROR)
    t.at_least("value_vs_on_demand", "p2 trace, 4 stages, simulator with the measured constants: bamboo value / "
               "on-demand", val["vs_on_demand"], TARGET_VS_ON_DEMAND, "x")
    t.at_least("value_vs_checkpoint", "p2 trace, 4 stages, simulator with the measured constants: bamboo value / "
               "checkpoint-restart", val["vs_checkpoint"], TARGET_VS_CHECKPOINT, "x")
    payload = {"benchmark": run.name, "environment": env, "config": vars(args) | {"replay_window_min": list(args.replay_window_min)},
               "nominal": {"full_step_s": nominal_full_s(args), "failed_over_step_s": nominal_failed_over_s(args),
                           "slowdown": nominal_failed_over_s(args) / nominal_full_s(args)},
               "kills": ks, "replay_plan": plan, "replay": rp, "replay_prediction": pred,
               "constants_file": cs, "value": {k: v for k, v in val.items() if k != "summary"},
               "value_summary": val["summary"]}
    return run.finish(payload, markdown(run, args, ks, plan, rp, pred, cs, val, env))
