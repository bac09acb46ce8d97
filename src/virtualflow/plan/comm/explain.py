"""A program, and what rewrites make of it, as text: every tensor's layout, each communicating
op's bytes and messages per rank, the bytes each rank holds per declared tensor (pure).

One program's text (:func:`explain`) lives in :mod:`virtualflow.plan.comm.ledger`, below
``Program`` (whose ``explain`` method calls it), and is re-exported here; this module adds what
needs the rewrites (:func:`explain_rewrites`).
"""

from __future__ import annotations

from typing import Sequence

from virtualflow.plan.comm.ir import LOCAL_KINDS, Program
from virtualflow.plan.comm.ledger import comm_ledger, explain, memory_ledger, totals
from virtualflow.plan.comm.rewrites import apply

__all__ = ["explain", "explain_rewrites"]


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
