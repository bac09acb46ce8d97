"""A single-process p-rank interpreter of communication programs (pure).

:func:`simulate` runs a :class:`~virtualflow.plan.comm.ir.Program` with one torch tensor per rank
per name: local ops run once per rank (the same kernels as the executor's), collectives combine
the ranks' tensors. Sums are added in the ring's order (:func:`~virtualflow.plan.comm.kernels.ring_reduce`),
so the simulator's values are bit-identical to the executor's on gloo (both run every local op on
the same shapes). A rewrite that keeps each element's chunk and its arithmetic unchanged is
bit-identical to the original on every CPU; "unchanged" means every matmul keeps its shape (BLAS
picks kernels by shape, so ``x[rows] @ W`` is not always the rows of ``x @ W``: ``overlap`` is
bit-identical only to the same matmuls cut the same way, and within float tolerance of the uncut
program) and the ops moved onto slices are correctly rounded per element (add, mul, div, sqrt...;
gelu's vectorised and scalar kernels may differ by an ulp).

Every communicating op leaves a :class:`CommRecord`: bytes and messages *sent* by each rank
(global rank ``stage * p + r``), counted on the tensors actually moved:

* reduce-scatter / all-gather: ring over chunks of ``n_c`` elements; rank r sends every chunk but
  one (its own / its right neighbour's): ``(p-1)/p`` of the data for even chunks, ``p-1`` messages;
* all-reduce: both, ``2 (p-1)/p`` of the data, ``2 (p-1)`` messages;
* broadcast: the source sends the whole tensor to each of the ``p-1`` others (flat tree);
* send: each rank of the sending stage sends its piece, one message.

:func:`~virtualflow.plan.comm.ledger.comm_ledger` computes the same records from shapes alone (no
tensors), and :func:`~virtualflow.plan.comm.ledger.memory_ledger` the bytes each rank holds per
declared tensor (states sliced by a rewrite show ``1/p``); both live in
:mod:`virtualflow.plan.comm.ledger` and are re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from virtualflow.plan.comm.ir import LOCAL_KINDS, Decl, Info, Local, Program, Replicated, Sliced
from virtualflow.plan.comm.kernels import DEFAULT_SEGMENT_BYTES, ring_reduce, ring_traffic, run_local
from virtualflow.plan.comm.ledger import (  # noqa: F401 - the ledger is re-exported: its home before ledger.py
    CommRecord, check_ranks, collective_chunks, comm_ledger, comm_record, memory_ledger, numel_except, totals,
)
from virtualflow.plan.shards import shard_bounds


# --------------------------------------------------------------------------------------------
# The interpreter.


@dataclass
class SimResult:
    program: Program
    p: int
    values: dict[str, list[torch.Tensor]]
    """Every tensor's per-rank values (index r within its stage); a state's are its final ones."""
    ledger: list[CommRecord]

    def view(self, name: str) -> torch.Tensor:
        """The global value: a Replicated tensor (checked equal on every rank), the pieces of a
        Sliced one concatenated, or the ranks' values of a Local one stacked along a new dim 0."""
        return global_view(name, self.program.info[name], self.values[name])

    def results(self) -> dict[str, torch.Tensor]:
        """Global views of the outputs and the states' final values."""
        return {n: self.view(n) for n in (*self.program.outputs, *self.program.states)}

    def bytes_per_rank(self) -> list[int]:
        return totals(self.ledger)[0]

    def messages_per_rank(self) -> list[int]:
        return totals(self.ledger)[1]


def global_view(name: str, info: Info, per_rank: Sequence[torch.Tensor]) -> torch.Tensor:
    lay = info.layout
    if isinstance(lay, Replicated):
        for r, v in enumerate(per_rank[1:], 1):
            if not torch.equal(v, per_rank[0]):
                raise ValueError(f"{name} is Replicated but rank {r}'s value differs from rank 0's")
        return per_rank[0]
    if isinstance(lay, Sliced):
        return torch.cat(list(per_rank), lay.dim)
    return torch.stack(list(per_rank))


def distribute(d: Decl, value, p: int) -> list[torch.Tensor]:
    """The ranks' pieces of a declared tensor given its global value (a Local one: p values)."""
    if isinstance(d.layout, Local):
        if isinstance(value, torch.Tensor) or len(value) != p:
            raise ValueError(f"input {d.name} is Local: pass a sequence of {p} tensors (one per rank)")
        vals = list(value)
    else:
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"input {d.name} is {d.layout}: pass one tensor (its global value)")
        vals = [value] * p
    for r, v in enumerate(vals):
        if tuple(v.shape) != d.shape or v.dtype != d.dtype:
            raise ValueError(f"input {d.name} (rank {r}): got {tuple(v.shape)} {v.dtype}, declared {d.shape} {d.dtype}")
    if isinstance(d.layout, Sliced):
        dim = d.layout.dim
        return [value.narrow(dim, lo, hi - lo).contiguous() for lo, hi in shard_bounds(d.shape[dim], p)]
    return [v.clone() for v in vals]


def check_inputs(prog: Program, inputs: Mapping) -> None:
    names = {d.name for d in prog.decls}
    missing = sorted(names - set(inputs))
    extra = sorted(set(inputs) - names)
    if missing or extra:
        raise ValueError(f"program {prog.name}: inputs missing {missing}, unknown {extra}; pass one value per "
                         f"declared tensor ({sorted(names)})")


def simulate(prog: Program, p: int, inputs: Mapping[str, object],
             segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> SimResult:
    """Run ``prog`` on ``p`` ranks per stage. ``inputs``: each declared tensor's global value (a
    Local one: a sequence of p values)."""
    check_ranks(p)
    check_inputs(prog, inputs)
    vals: dict[str, list[torch.Tensor]] = {d.name: distribute(d, inputs[d.name], p) for d in prog.decls}
    ledger: list[CommRecord] = []
    for op in prog.ops:
        k = op.kind
        if k == "update":
            vals[op.args[0]] = vals[op.args[1]]
            continue
        if k in LOCAL_KINDS:
            outs = [run_local(op, [vals[a][r] if isinstance(a, str) else a for a in op.args], p, r) for r in range(p)]
            for i, name in enumerate(op.outs):
                vals[name] = [outs[r][i] for r in range(p)]
            continue
        stage = prog.info[op.args[0]].stage
        members = [vals[a] for a in op.tensor_args]
        size = members[0][0].element_size()
        if k == "broadcast":
            src = op.attrs["src"]
            if src >= p:
                raise ValueError(f"`{op.label()}`: src={src} is not a rank of a {p}-rank group")
            vals[op.out] = [members[0][src].clone() for _ in range(p)]
            traffic = {src: ((p - 1) * members[0][src].numel() * size, p - 1)}
        elif k == "send":
            vals[op.out] = [v.clone() for v in members[0]]
            traffic = {r: (v.numel() * size, 1) for r, v in enumerate(members[0])}
        else:
            chunks = [0] * p
            for i, (name, per_rank) in enumerate(zip(op.outs, members)):
                outs, sizes = _collective(k, per_rank, op.attrs.get("dims", (None,))[i] if k != "all_reduce" else None,
                                          p)
                vals[name] = outs
                chunks = [a + b for a, b in zip(chunks, sizes)]
            traffic = {r: ring_traffic(k, chunks, size, r, segment_bytes) for r in range(p)}
        ledger.append(comm_record(prog, op, p, traffic, stage))
    return SimResult(prog, p, vals, ledger)


def _collective(kind: str, per_rank: list[torch.Tensor], dim: int | None, p: int):
    """Outputs per rank and elements per ring chunk of one member of a collective."""
    if kind == "all_reduce":
        shape = per_rank[0].shape
        flats = [v.reshape(-1) for v in per_rank]
        bounds = shard_bounds(flats[0].numel(), p)
        s = ring_reduce(flats, bounds).reshape(shape)
        return [s.clone() for _ in range(p)], [hi - lo for lo, hi in bounds]
    if kind == "reduce_scatter":
        moved = [v.movedim(dim, 0).contiguous() for v in per_rank]
        rows = shard_bounds(moved[0].shape[0], p)
        rest = numel_except(moved[0].shape, 0)
        bounds = [(lo * rest, hi * rest) for lo, hi in rows]
        s = ring_reduce([m.reshape(-1) for m in moved], bounds).reshape(moved[0].shape)
        outs = [s[lo:hi].movedim(0, dim).contiguous() for lo, hi in rows]
        return outs, [hi - lo for lo, hi in bounds]
    # all_gather
    full = torch.cat(per_rank, dim)
    return [full.clone() for _ in range(p)], [v.numel() for v in per_rank]
