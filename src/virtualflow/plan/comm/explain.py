"""A program, and what rewrites make of it, as text: every tensor's layout, each communicating
op's bytes and messages per rank, the bytes each rank holds per declared tensor (pure)."""

from __future__ import annotations

from typing import Sequence

from virtualflow.plan.comm.ir import LOCAL_KINDS, Program
from virtualflow.plan.comm.rewrites import apply
from virtualflow.plan.comm.simulate import comm_ledger, memory_ledger, totals


def _ranks_label(prog: Program, p: int) -> str:
    return f"{p} ranks" if prog.stages == 1 else f"{prog.stages} stages x {p} ranks"


def _fmt_bytes(n: int) -> str:
    return f"{n} B" if n < 10 * 1024 else f"{n / 1024:.1f} KiB" if n < 10 * 1024 * 1024 else f"{n / 2**20:.1f} MiB"


def explain(prog: Program, ranks: int) -> str:
    """The program's declarations, ops (with the layout of what each defines and, for
    communication, bytes sent per rank) and totals on ``ranks`` ranks per stage."""
    lines = [f"program {prog.name} on {_ranks_label(prog, ranks)}"]
    mem = memory_ledger(prog, ranks)
    lines.append("  declared:")
    for d in prog.decls:
        kind = "state (shardable)" if d.shardable else "state" if d.state else "input"
        per = mem[d.name]
        lines.append(f"    {d.name:<12} {str(d.shape):<12} {str(d.layout):<12} stage {d.stage}  {kind:<17} "
                     f"{_fmt_bytes(max(per))}/rank")
    recs = iter(comm_ledger(prog, ranks))
    lines.append("  ops:")
    for i, op in enumerate(prog.ops):
        lay = ", ".join(f"{o}: {prog.info[o].layout}" for o in op.outs) if op.outs else "in place"
        text = f"    {i:>3} {op.label()}"
        if op.kind not in LOCAL_KINDS and op.kind != "update":
            rec = next(recs)
            text += f"   -> {lay}   sends {_per_rank(rec.bytes_sent)} B in {_per_rank(rec.messages)} msgs"
        else:
            text += f"   -> {lay}"
        if op.kind == "fused":
            text += "   [" + "; ".join(inner.label() for inner in op.attrs["body"]) + "]"
        lines.append(text)
    b, m = totals(comm_ledger(prog, ranks))
    lines.append(f"  bytes sent per rank: {_per_rank(b) if b else 0}; messages per rank: {_per_rank(m) if m else 0}")
    states = [d.name for d in prog.decls if d.state]
    if states:
        held = [sum(mem[s][r] for s in states) for r in range(ranks)]
        lines.append(f"  state held per rank: {_per_rank(held)} B")
    return "\n".join(lines)


def _per_rank(xs: Sequence[int]) -> str:
    xs = list(xs)
    if xs and all(x == xs[0] for x in xs):
        return f"{xs[0]} (every rank)"
    return "[" + ", ".join(map(str, xs)) + "]"


def explain_rewrites(prog: Program, ranks: int, rewrites: Sequence[str], *, chunks: int = 2) -> str:
    """The program, a line per rewrite with the bytes sent and state held per rank after it, and
    the rewritten program."""
    out = [explain(prog, ranks), "", "rewrites:"]
    cur = prog
    out.append(f"  {'(none)':<10} {_summary(cur, ranks)}")
    for r in rewrites:
        cur = apply(cur, [r], chunks=chunks)
        out.append(f"  {r:<10} {_summary(cur, ranks)}")
    out += ["", explain(cur, ranks)]
    return "\n".join(out)


def _summary(prog: Program, ranks: int) -> str:
    b, m = totals(comm_ledger(prog, ranks))
    mem = memory_ledger(prog, ranks)
    states = [d.name for d in prog.decls if d.state]
    held = max((sum(mem[s][r] for s in states) for r in range(ranks)), default=0)
    comm = sum(1 for op in prog.ops if op.kind not in LOCAL_KINDS and op.kind != "update")
    return (f"bytes sent/rank max {max(b, default=0):>8}  messages/rank max {max(m, default=0):>3}  "
            f"communicating ops {comm:>2}  ops {len(prog.ops):>3}  state held/rank {held} B")
