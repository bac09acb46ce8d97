"""``virtualflow explain WORKLOAD [--ranks P] [--rewrites split,reorder,...]``: print a shipped
communication program and its rewritten form.

Shows every tensor's layout, each communicating op's bytes and messages per rank (ring
formulas), the state each rank holds, a line per rewrite, and whether the p-rank simulator finds
the rewritten program's results equal to the original's on random inputs (bit-identical, or the
largest difference). ``--json`` prints the per-rewrite numbers as one JSON object. Bad input
raises ``ValueError`` (the CLI prints one line, exit status 2).
"""

from __future__ import annotations

import argparse
import json

from virtualflow.plan.comm.explain import explain_rewrites
from virtualflow.plan.comm.rewrites import REWRITES, apply
from virtualflow.plan.comm.simulate import comm_ledger, memory_ledger, simulate, totals
from virtualflow.plan.comm.workloads import DEFAULT_REWRITES, WORKLOADS, example_inputs


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "explain",
        help="print a communication program (CoCoNeT) and its rewritten form with layouts and bytes per rank",
        description="Print one of the shipped communication programs, the rewrites applied to it in order, and "
        "the rewritten program: layouts, bytes and messages each rank sends, state each rank holds; the p-rank "
        "simulator checks the rewritten program against the original.",
    )
    p.add_argument("workload", choices=sorted(WORKLOADS), help="the program to explain")
    p.add_argument("--ranks", type=int, default=4, help="p: ranks per stage (default 4)")
    p.add_argument("--rewrites", help=f"comma-separated, applied in order, from {', '.join(REWRITES)}; 'none' for "
                   "none (default: the workload's own list)")
    p.add_argument("--chunks", type=int, default=2, help="pieces per matmul for overlap (default 2)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.ranks < 1:
        raise ValueError(f"--ranks {args.ranks} must be at least 1")
    prog = WORKLOADS[args.workload]()
    spec = DEFAULT_REWRITES[args.workload] if args.rewrites is None else (
        () if args.rewrites.strip() in ("", "none") else tuple(r.strip() for r in args.rewrites.split(",")))
    for r in spec:
        if r not in REWRITES:
            raise ValueError(f"--rewrites: unknown rewrite {r!r}; choose from {', '.join(REWRITES)}")
    steps = [("(none)", prog)]
    for r in spec:
        steps.append((r, apply(steps[-1][1], [r], chunks=args.chunks)))
    final = steps[-1][1]
    inputs = example_inputs(prog, args.ranks, seed=0)
    base = simulate(prog, args.ranks, inputs).results()
    got = simulate(final, args.ranks, inputs).results()
    diff = max(float((got[k].double() - base[k].double()).abs().max()) if got[k].numel() else 0.0 for k in base)
    same = all(got[k].shape == base[k].shape and bool((got[k] == base[k]).all()) for k in base)
    scale = max((float(base[k].double().abs().max()) for k in base if base[k].numel()), default=0.0)
    rel = diff / scale if scale > 0 else diff
    # overlap cuts a matmul into pieces; BLAS picks its kernels by shape, so the pieces agree with
    # the uncut product within float tolerance and bit for bit only where the same kernels run
    # (docs/coconet.md, "Summation order"): never claim more than that.
    cut = "overlap" in spec
    if args.json:
        rows = []
        for name, pr in steps:
            b, m = totals(comm_ledger(pr, args.ranks))
            mem = memory_ledger(pr, args.ranks)
            held = [sum(mem[s][r] for s in pr.states) for r in range(args.ranks)]
            rows.append({"rewrite": name, "bytes_sent_per_rank": b, "messages_per_rank": m,
                         "state_bytes_per_rank": held, "ops": len(pr.ops)})
        print(json.dumps({"workload": args.workload, "ranks": args.ranks, "stages": prog.stages, "steps": rows,
                          "simulator_bit_identical": same, "simulator_max_abs_diff": diff,
                          "simulator_max_rel_diff": rel, "bit_identical_on_every_cpu": same and not cut}))
        return 0
    print(explain_rewrites(prog, args.ranks, spec, chunks=args.chunks))
    print()
    verdict = "bit-identical" if same else f"max abs difference {diff:.3g} ({rel:.2g} of the largest value)"
    if cut:
        verdict += (" on this CPU; overlap cuts a matmul into pieces, so on other CPUs the results are equal "
                    "within float tolerance, bit-identical only to the same matmul cut the same way")
    print(f"simulator on {args.ranks} ranks, random inputs (seed 0): rewritten vs original results: {verdict}")
    return 0
