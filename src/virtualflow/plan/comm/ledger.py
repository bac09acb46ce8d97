"""What a communication program costs and how it reads, from shapes alone (pure): every
communicating op's bytes and messages per rank (:func:`comm_ledger`), the bytes each rank holds per
declared tensor (:func:`memory_ledger`), and the program as text (:func:`explain`, which
``Program.explain`` calls).

Counting rules (bytes and messages *sent* by each rank, global rank ``stage * p + r``):

* reduce-scatter / all-gather: ring over chunks of ``n_c`` elements; rank r sends every chunk but
  one (its own / its right neighbour's): ``(p-1)/p`` of the data for even chunks, ``p-1`` messages;
* all-reduce: both, ``2 (p-1)/p`` of the data, ``2 (p-1)`` messages;
* broadcast: the source sends the whole tensor to each of the ``p-1`` others (flat tree);
* send: each rank of the sending stage sends its piece, one message.

The simulator (:mod:`virtualflow.plan.comm.simulate`) leaves the same records for the tensors it
really moves. Invariant: this module sits below :class:`~virtualflow.plan.comm.ir.Program` (whose
``explain`` calls it), so it reads a program through :class:`ProgramView` and imports only the
IR's pieces (:mod:`virtualflow.plan.comm.ops`) and the ring's traffic
(:mod:`virtualflow.plan.comm.kernels`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from virtualflow.plan.comm.kernels import DEFAULT_SEGMENT_BYTES, ring_traffic
from virtualflow.plan.comm.ops import LOCAL_KINDS, Decl, Info, Op, numel, piece_shape
from virtualflow.plan.shards import shard_bounds


class ProgramView(Protocol):
    """What the ledger reads of a :class:`~virtualflow.plan.comm.ir.Program`."""

    name: str
    decls: tuple[Decl, ...]
    ops: tuple[Op, ...]
    info: dict[str, Info]

    @property
    def stages(self) -> int: ...


@dataclass(frozen=True, slots=True)
class CommRecord:
    """One communicating op: what each global rank sent."""

    op: str
    """The op's label (``g = all_reduce(grad)``)."""
    kind: str
    stage: int
    bytes_sent: tuple[int, ...]
    messages: tuple[int, ...]


def totals(records: Sequence[CommRecord]) -> tuple[list[int], list[int]]:
    """Bytes and messages sent per global rank, summed over ``records``."""
    if not records:
        return [], []
    n = len(records[0].bytes_sent)
    b, m = [0] * n, [0] * n
    for rec in records:
        for i in range(n):
            b[i] += rec.bytes_sent[i]
            m[i] += rec.messages[i]
    return b, m


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def numel_except(shape: Sequence[int], dim: int) -> int:
    """Elements in one index of ``dim``: the product of the other dims."""
    return numel([s for j, s in enumerate(shape) if j != dim])


def collective_chunks(kind: str, shapes: Sequence[Sequence[int]], dims: Sequence[int | None], p: int) -> list[int]:
    """Elements in each ring chunk of a (bucketed) collective: chunk r holds every member's piece r
    (rank-major packing), an all-reduce member being cut flat by ``shard_bounds(numel, p)``."""
    chunks = [0] * p
    for shape, dim in zip(shapes, dims):
        if kind == "all_reduce":
            sizes = [hi - lo for lo, hi in shard_bounds(numel(shape), p)]
        else:
            rest = numel_except(shape, dim)
            sizes = [(hi - lo) * rest for lo, hi in shard_bounds(shape[dim], p)]
        chunks = [a + b for a, b in zip(chunks, sizes)]
    return chunks


def comm_record(prog: ProgramView, op: Op, p: int, traffic: dict[int, tuple[int, int]], stage: int) -> CommRecord:
    """``op``'s record from ``traffic`` (rank within ``stage`` -> (bytes, messages) it sent)."""
    ranks = prog.stages * p
    b, m = [0] * ranks, [0] * ranks
    for r, (nb, nm) in traffic.items():
        b[stage * p + r] = nb
        m[stage * p + r] = nm
    return CommRecord(op.label(), op.kind, stage, tuple(b), tuple(m))


def comm_ledger(prog: ProgramView, p: int, segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> list[CommRecord]:
    """Every communicating op's :class:`CommRecord`, from shapes alone."""
    check_ranks(p)
    out = []
    for op in prog.ops:
        if op.kind in LOCAL_KINDS or op.kind == "update":
            continue
        infos = [prog.info[a] for a in op.tensor_args]
        stage = infos[0].stage
        size = _itemsize(infos[0].dtype)
        if op.kind in ("all_reduce", "reduce_scatter", "all_gather"):
            dims = op.attrs.get("dims", (None,) * len(infos))
            chunks = collective_chunks(op.kind, [i.shape for i in infos], dims, p)
            traffic = {r: ring_traffic(op.kind, chunks, size, r, segment_bytes) for r in range(p)}
        elif op.kind == "broadcast":
            traffic = {op.attrs["src"]: ((p - 1) * numel(infos[0].shape) * size, p - 1)}
        else:  # send
            traffic = {r: (numel(piece_shape(infos[0].shape, infos[0].layout, p, r)) * size, 1) for r in range(p)}
        out.append(comm_record(prog, op, p, traffic, stage))
    return out


def memory_ledger(prog: ProgramView, p: int) -> dict[str, list[int]]:
    """Bytes rank ``r`` of the tensor's stage holds for each declared tensor (index r)."""
    check_ranks(p)
    return {d.name: [numel(piece_shape(d.shape, d.layout, p, r)) * _itemsize(d.dtype) for r in range(p)]
            for d in prog.decls}


def check_ranks(p: int) -> None:
    """Raise ``ValueError`` unless ``p`` (ranks per stage) is a positive int."""
    if not isinstance(p, int) or p < 1:
        raise ValueError(f"ranks={p!r} must be a positive int (the ranks of each stage's group)")


# --------------------------------------------------------------------------------------------
# A program as text.


def _ranks_label(prog: ProgramView, p: int) -> str:
    return f"{p} ranks" if prog.stages == 1 else f"{prog.stages} stages x {p} ranks"


def _fmt_bytes(n: int) -> str:
    return f"{n} B" if n < 10 * 1024 else f"{n / 1024:.1f} KiB" if n < 10 * 1024 * 1024 else f"{n / 2**20:.1f} MiB"


def explain(prog: ProgramView, ranks: int) -> str:
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
