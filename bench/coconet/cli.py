"""The command line: flags (``--quick`` and the benchmark's own), the child entry points, and
:func:`main`, which runs the parts, checks the targets and writes the results.
"""

from __future__ import annotations

import argparse
import json

import torch

from bench import harness as H
from bench import coconet as package  # its docstring describes the benchmark (--help)
from bench.coconet.workload import NAME, TARGET_KEYS, WORLD
from bench.coconet.collectives import collectives_rank, measure_collectives
from bench.coconet.step import measure_step, step_rank
from bench.coconet.report import collectives_table, markdown, step_table, summarize_collectives, summarize_step


# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None):
    p = H.parser(package.__doc__, prog="python -m bench.coconet", reps=9, reps_help="timed repetitions per collective and size", quiet_wait=60.0)
    p.add_argument("--warmup", type=int, default=2, help="untimed repetitions per collective and size")
    p.add_argument("--sizes", type=lambda t: [float(x) for x in t.split(",")], default=[10, 30, 100],
                   help="vector sizes in millions of float32 (comma-separated)")
    p.add_argument("--steps", type=int, default=24, help="steps per plain-torch run")
    p.add_argument("--vf-steps", type=int, default=24, help="steps per virtualflow.train run")
    p.add_argument("--warmup-steps", type=int, default=4, help="steps left out of the medians")
    p.add_argument("--step-reps", type=int, default=3, help="interleaved pairs of (all-reduce, sharded) runs")
    p.add_argument("--max-other-cores", type=float, default=0.3,
                   help="repeat a part-2 pair when other processes used more CPU cores than this during it")
    p.add_argument("--retries", type=int, default=1, help="repetitions of a part-2 pair measured on a busy machine")
    p.add_argument("--parts", default="1,2", help="which parts to run (1, 2 or 1,2)")
    p.add_argument("--child-collectives", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-step", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.reps, args.warmup, args.sizes = 3, 1, [10, 30]
        args.steps = args.vf_steps = 12
        args.warmup_steps, args.step_reps, args.retries, args.quiet_wait = 3, 1, 0, min(args.quiet_wait, 10.0)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child_collectives:
        print(json.dumps(collectives_rank(json.loads(args.child_collectives))))
        return 0
    if args.child_step:
        print(json.dumps(step_rank(json.loads(args.child_step))))
        return 0
    malloc_env = H.apply_malloc_mode("stable")
    run = H.Run(NAME, args, TARGET_KEYS)
    torch.set_num_threads(1)
    parts = {x.strip() for x in args.parts.split(",")}
    print(H.banner(f"coconet: ring collectives vs gloo ({WORLD} ranks); sharded step vs all-reduce + Adam"))
    payload: dict = {"benchmark": run.name, "environment": H.environment(), "allocator": malloc_env,
                     "config": {k: v for k, v in vars(args).items() if not k.startswith("child")}}
    load: dict[str, float] = {}
    c = s = None
    if "1" in parts:
        H.wait_for_quiet(args.quiet_wait)
        with H.LoadMeter() as meter:
            c = measure_collectives(args)
        load["part 1"] = meter.other_cores
        summarize_collectives(c, run.targets)
        payload["collectives"] = c
        print()
        print(H.text_table(*collectives_table(c)))
    if "2" in parts:
        with H.LoadMeter() as meter:
            m = measure_step(args)
        load["part 2"] = meter.other_cores
        s = summarize_step(m, args.warmup_steps, run.targets)
        payload["step_raw"] = m
        payload["step"] = s
        print()
        print(H.text_table(*step_table(s)))
        print(f"  targets read from: {s['targets_from']}")
    payload["other_load_cores"] = load
    return run.finish(payload, markdown(run, args, c, s, load))
