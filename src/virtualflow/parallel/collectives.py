"""What the tensor-parallel blocks need from communication, and the differentiable collectives.

Purpose: the :class:`Comm` protocol (the ring collectives of :class:`virtualflow.comm.ring.Collectives`
are one implementation; this package imports no communication code), the token layout of the
rows each rank owns between a reduce-scatter and an all-gather (:class:`TokenLayout`), and the
collectives as differentiable ops (Megatron's "f" and "g" and their row-wise relatives).

Invariants: every rank calls the same collectives in the same order with the same shapes (they
run in issue order); the gradient arriving at a replicated tensor is the same on every rank, so
an all-gather's backward is "take this rank's rows" and a reduce-scatter's is an all-gather.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F

from virtualflow.plan.shards import shard_bounds

Bounds = list[tuple[int, int]]


class Rank(Protocol):
    rank: int
    size: int


class Handle(Protocol):
    def wait(self) -> None: ...


class Comm(Protocol):
    """The collectives a tensor-parallel block uses (:class:`virtualflow.comm.ring.Collectives`
    is one): in place on a 1-D contiguous tensor, ``bounds`` one ``(lo, hi)`` per rank."""

    group: Rank

    def reduce_scatter(self, flat: torch.Tensor, bounds: Sequence[tuple[int, int]], *,
                       async_op: bool = False) -> Handle | None: ...

    def all_gather(self, flat: torch.Tensor, bounds: Sequence[tuple[int, int]], *,
                   async_op: bool = False) -> Handle | None: ...

    def all_reduce(self, flat: torch.Tensor, *, async_op: bool = False) -> Handle | None: ...


@dataclass(frozen=True, slots=True)
class TokenLayout:
    """Which token rows each rank owns between the reduce-scatter and the all-gather.

    ``chunks[c]`` = the rows ``(c0, c1)`` of overlap chunk ``c`` (empty chunks dropped);
    ``owned[c][r]`` = the rows ``(lo, hi)`` (absolute) of chunk ``c`` that rank ``r`` owns. Every
    chunk's owned ranges cover it contiguously in rank order."""

    tokens: int
    ranks: int
    chunks: tuple[tuple[int, int], ...]
    owned: tuple[tuple[tuple[int, int], ...], ...]

    @classmethod
    def build(cls, tokens: int, ranks: int, chunks: int = 1) -> "TokenLayout":
        if chunks < 1:
            raise ValueError(f"TokenLayout: chunks={chunks} must be at least 1 (1 = no overlap)")
        if tokens < 0 or ranks < 1:
            raise ValueError(f"TokenLayout: tokens={tokens} and ranks={ranks} must be >= 0 and >= 1")
        spans = tuple((a, b) for a, b in shard_bounds(tokens, chunks) if b > a)
        owned = tuple(tuple((c0 + lo, c0 + hi) for lo, hi in shard_bounds(c1 - c0, ranks)) for c0, c1 in spans)
        return cls(tokens, ranks, spans, owned)

    def rows_of(self, rank: int) -> list[tuple[int, int]]:
        """The row ranges rank ``rank`` owns, one per chunk (some may be empty)."""
        return [per_rank[rank] for per_rank in self.owned]

    def rows_owned(self, rank: int) -> int:
        return sum(hi - lo for lo, hi in self.rows_of(rank))

    def element_bounds(self, c: int, width: int) -> Bounds:
        """Chunk ``c``'s rank bounds in elements, relative to the chunk's flat view (rows * width)."""
        c0 = self.chunks[c][0]
        return [((lo - c0) * width, (hi - c0) * width) for lo, hi in self.owned[c]]


def split_range(n: int, parts: int, rank: int, what: str, knob: str) -> tuple[int, int]:
    """Rank ``rank``'s share ``(lo, hi)`` of ``n`` units (MLP columns, heads); every rank gets one."""
    if n < parts:
        raise ValueError(f"{what}={n} cannot be split over {parts} ranks (every rank needs at least one); "
                         f"{knob}")
    return shard_bounds(n, parts)[rank]


class ColumnParallelLinear(torch.autograd.Function):
    """``x @ w_r^T + b_r`` on a replicated ``x`` (``F.linear``). Backward: the input gradient is
    the all-reduced sum of the ranks' partials (overlapped with the weight-gradient matmul)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.comm = comm
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, weight = ctx.saved_tensors
        gx = handle = None
        if ctx.needs_input_grad[0]:
            gx = g @ weight
            handle = ctx.comm.all_reduce(gx.view(-1), async_op=True)
        gw = None
        if ctx.needs_input_grad[1]:
            # The matmul autograd runs for F.linear's addmm: a weight stored [in, out] (a Conv1D's,
            # passed transposed) gets x^T g, one stored [out, in] gets g^T x (bit for bit).
            stored_transposed = not weight.is_contiguous() and weight.t().is_contiguous()
            gw = (x.t() @ g).t() if stored_transposed else g.t() @ x
        gb = g.sum(0) if ctx.needs_input_grad[2] else None
        if handle is not None:
            handle.wait()
        return gx, gw, gb, None


class _CopyToRanks(torch.autograd.Function):
    """Identity forward; backward: the all-reduced sum of the ranks' gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        g = g.contiguous().clone()
        ctx.comm.all_reduce(g.view(-1))
        return g, None


class _ReduceScatterRows(torch.autograd.Function):
    """[T, h] partial sums -> this rank's rows of the sum; backward: all-gather (every rank's
    partial gets the gradient of the whole sum)."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, comm: Comm) -> torch.Tensor:
        tokens, width = z.shape
        rows = shard_bounds(tokens, comm.group.size)
        buf = z.contiguous().clone()
        comm.reduce_scatter(buf.view(-1), [(lo * width, hi * width) for lo, hi in rows])
        ctx.comm, ctx.rows = comm, rows
        lo, hi = rows[comm.group.rank]
        return buf[lo:hi].clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        rows, width = ctx.rows, g.shape[1]
        lo, hi = rows[ctx.comm.group.rank]
        full = g.new_empty(rows[-1][1], width)
        full[lo:hi] = g
        ctx.comm.all_gather(full.view(-1), [(a * width, b * width) for a, b in rows])
        return full, None


class _AllGatherRows(torch.autograd.Function):
    """This rank's rows -> the replicated [T, h]; backward: this rank's rows of the (replicated,
    the same on every rank) gradient."""

    @staticmethod
    def forward(ctx, o: torch.Tensor, comm: Comm, tokens: int) -> torch.Tensor:
        rows = shard_bounds(tokens, comm.group.size)
        lo, hi = rows[comm.group.rank]
        if o.shape[0] != hi - lo:
            raise ValueError(f"all_gather_rows: rank {comm.group.rank} owns rows [{lo}, {hi}) of {tokens} "
                             f"(shard_bounds), but its input has {o.shape[0]} rows")
        width = o.shape[1]
        full = o.new_empty(tokens, width)
        full[lo:hi] = o
        comm.all_gather(full.view(-1), [(a * width, b * width) for a, b in rows])
        ctx.lo, ctx.hi = lo, hi
        return full

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g[ctx.lo:ctx.hi], None, None


def copy_to_ranks(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """A replicated tensor entering rank-local computation (Megatron's "f"): identity forward; the
    backward sums the ranks' gradients (all-reduce), so the gradient is again replicated."""
    return _CopyToRanks.apply(x, comm)


def reduce_scatter_rows(z: torch.Tensor, comm: Comm) -> torch.Tensor:
    """``[T, h]`` partial sums (one per rank) -> this rank's rows ``shard_bounds(T, t)[rank]`` of
    their sum. Backward: an all-gather of the rows' gradients."""
    return _ReduceScatterRows.apply(z, comm)


def all_gather_rows(o: torch.Tensor, comm: Comm, tokens: int) -> torch.Tensor:
    """Each rank's rows ``shard_bounds(tokens, t)[rank]`` -> the replicated ``[tokens, h]``.
    Backward: this rank's rows of the gradient (which must be the same on every rank, see the
    module docstring). The blocks fuse these steps (and chunk them); these are the unfused pieces
    for other compositions, e.g. a pipeline boundary that sends only a rank's rows."""
    return _AllGatherRows.apply(o, comm, tokens)
