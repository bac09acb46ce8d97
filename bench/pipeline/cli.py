"""The command line: flags (``--quick`` and the benchmark's own), the child entry points, and
:func:`main`, which runs the parts, checks the targets and writes the results.
"""

from __future__ import annotations

import argparse
import json

import torch

from bench import harness as H
from bench import pipeline as package  # its docstring describes the benchmark (--help)
from bench.pipeline.workload import EMU_P, NAME, TARGET_KEYS, VS_HIDDEN, VS_P
from bench.pipeline.vs_torch import measure_vs, summarize_vs, vs_rank
from bench.pipeline.bubbles_stash import emu_rank, measure_emu, summarize_emu
from bench.pipeline.deterministic import det_markdown, det_rank, measure_det, summarize_det
from bench.pipeline.report import markdown


# --------------------------------------------------------------------------------------------
# Entry points.


def parse_args(argv):
    p = H.parser(package.__doc__, prog="python -m bench.pipeline", quiet_wait=20.0)
    p.add_argument("--m", type=int, default=8, help="(1) micro-batches per step")
    p.add_argument("--mb", type=int, default=32, help="(1) samples per micro-batch")
    p.add_argument("--hidden", type=int, default=VS_HIDDEN, help="(1) MLP width")
    p.add_argument("--vs-steps", type=int, default=60, help="(1) steps per side per schedule")
    p.add_argument("--vs-warmup", type=int, default=10)
    p.add_argument("--vs-reps", type=int, default=3, help="(1) repetitions in fresh processes")
    p.add_argument("--hidden2", type=int, default=2 * VS_HIDDEN,
                   help="(1) a second MLP width, compared as a diagnostic (0: skip)")
    p.add_argument("--hidden2-reps", type=int, default=1, help="(1) repetitions at --hidden2")
    p.add_argument("--diag-steps", type=int, default=20,
                   help="(1) more steps per schedule with the executor's timeline on (0: skip)")
    p.add_argument("--two-devices", action=argparse.BooleanOptionalAction, default=True,
                   help="(1) diagnostic: also run the executor over a group with one gloo device (both directions "
                        "on one connection, as before duplex groups), alternating with the other two")
    p.add_argument("--skip-emulated", action="store_true", help="run (1) only: no emulated bubbles or stash")
    p.add_argument("--emu-m", type=int, default=8, help="(2) micro-batches per step")
    p.add_argument("--f-ms", type=float, default=10.0, help="(2) emulated forward per stage and micro-batch")
    p.add_argument("--i-ms", type=float, default=10.0, help="(2) emulated input-gradient backward")
    p.add_argument("--w-ms", type=float, default=10.0, help="(2) emulated weight-gradient backward")
    p.add_argument("--emu-steps", type=int, default=8, help="(2) steps per flush schedule (the first: warm-up)")
    p.add_argument("--window", type=int, default=4, help="(2) 2BW steps per window")
    p.add_argument("--emu-windows", type=int, default=3, help="(2) 2BW windows (the first: warm-up)")
    p.add_argument("--det-steps", type=int, default=40, help="(4) steps per mode")
    p.add_argument("--det-warmup", type=int, default=8)
    p.add_argument("--det-reps", type=int, default=3, help="(4) repetitions in fresh processes")
    p.add_argument("--deterministic-only", action="store_true",
                   help="run (4) only: deterministic vs default pipelined step (1f1b, p=2, d=2)")
    p.add_argument("--skip-deterministic", action="store_true", help="do not run (4)")
    p.add_argument("--child-vs", help=argparse.SUPPRESS)
    p.add_argument("--child-emu", help=argparse.SUPPRESS)
    p.add_argument("--child-det", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick and not (args.child_vs or args.child_emu or args.child_det):
        args.vs_steps, args.vs_warmup, args.vs_reps, args.diag_steps = 24, 6, 1, 10
        args.emu_steps, args.emu_windows = 4, 2
        args.det_steps, args.det_warmup, args.det_reps = 16, 4, 1
    return args


CHILDREN = {"child_vs": vs_rank, "child_emu": emu_rank, "child_det": det_rank}


def main(argv=None) -> int:
    args = parse_args(argv)
    for flag, fn in CHILDREN.items():
        if getattr(args, flag):
            print(json.dumps(fn(json.loads(getattr(args, flag)))))
            return 0
    run = H.Run(f"{NAME}_deterministic" if args.deterministic_only else NAME, args, TARGET_KEYS)
    torch.set_num_threads(1)
    if args.deterministic_only:
        return _deterministic_only(run, args)
    print(H.banner(f"pipeline: virtualflow's executor vs torch.distributed.pipelining (p={VS_P}, m={args.m}, "
                   f"mb={args.mb}); emulated bubbles and stash (p={EMU_P}, m={args.emu_m})"))
    print("(1) step time against torch.distributed.pipelining, alternating in the same processes", flush=True)
    vs = measure_vs(args, args.hidden, args.vs_reps, args.diag_steps)
    vs2 = measure_vs(args, args.hidden2, args.hidden2_reps, 0) if args.hidden2 else None
    emu = None
    if not args.skip_emulated:
        print("(2)+(3) emulated compute: bubbles, stash, weight versions", flush=True)
        emu = measure_emu(args)
    det = None
    if not args.skip_deterministic:
        print("(4) deterministic vs default pipelined step (1f1b, p=2, d=2)", flush=True)
        det = measure_det(args)
    vs_sum = summarize_vs(vs, args, run.targets)
    vs2_sum = summarize_vs(vs2, args, None) if vs2 is not None else None
    if emu is not None:
        summarize_emu(emu, run.targets)
    det_sum = summarize_det(det, args, run.targets) if det is not None else None
    payload = {"benchmark": run.name, "environment": H.environment(),
               "config": {k: v for k, v in vars(args).items() if not k.startswith("child")},
               "vs_torch": {"hidden": args.hidden, "summary": vs_sum, "reps": vs["reps"]},
               "vs_torch_hidden2": (None if vs2 is None else
                                    {"hidden": vs2["hidden"], "summary": vs2_sum, "reps": vs2["reps"]}),
               "emulated": emu,
               "deterministic": None if det is None else {"summary": det_sum, "reps": det["reps"]},
               "how": {"vs_torch": "virtualflow's executor (build_engine + StageEngine.steps driven by "
                                   "links.drive with one Links per engine kept across steps, over its own "
                                   "ProcessGroupGloo), not virtualflow.train",
                       "bubble": "mean over ranks of 1 - compute/(first compute start .. last compute end of the "
                                 "step over all ranks), median over post-warm-up steps",
                       "stash": "live contexts from saved_tensors_hooks tagged by piece forward pre-hooks"}}
    md = markdown(run, args, vs, vs_sum, vs2, vs2_sum, emu)
    if det is not None:
        md += "\n\n" + "\n".join(det_markdown(args, det, det_sum))
    return run.finish(payload, md)


def _deterministic_only(run: H.Run, args) -> int:
    """``--deterministic-only``: part (4) alone, its target checked."""
    print(H.banner(f"pipeline (4): deterministic vs default pipelined step (1f1b, p=2, d=2, m={args.m}, "
                   f"mb={args.mb}, hidden={args.hidden})"))
    det = measure_det(args)
    det_sum = summarize_det(det, args, run.targets)
    payload = {"benchmark": run.name, "environment": H.environment(),
               "config": {k: v for k, v in vars(args).items() if not k.startswith("child")},
               "deterministic": {"summary": det_sum, "reps": det["reps"]}}
    md = "\n".join([f"# {run.name}: deterministic vs default pipelined step", "", H.env_markdown(), ""]
                    + det_markdown(args, det, det_sum) + [f"Reproduce: `{run.command(NAME, ' --deterministic-only')}`"])
    return run.finish(payload, md)
