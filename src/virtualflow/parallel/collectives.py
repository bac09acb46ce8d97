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


@dataclass(frozen=True, slots=True)
class Precision:
    """The dtypes a tensor-parallel autograd Function computes in: fixed by the autocast state of
    its forward, and used again by its backward (what ``torch.amp.custom_fwd`` / ``custom_bwd``
    do for one device type; this records the state of the input's device, CPU or CUDA).

    ``compute``: the autocast dtype (bfloat16, float16) when autocast is on for the device, else
    None (every op in the tensors' own dtypes, bit for bit as without autocast). The matmuls run
    where the unconverted block's ``F.linear`` runs them under autocast: inputs and weights cast
    to ``compute``. Inside the Functions autocast is off (:meth:`off`) and every cast is explicit,
    so that a float32 sum is not cast down again.

    **Row-parallel sums** (the partial sums of the t ranks, in the forward's reduce-scatter and in
    the column-parallel input gradient's all-reduce) travel and are added in :meth:`sum_dtype`:
    float32 for a bfloat16/float16 compute dtype. Each rank's partial is the matmul of the
    low-precision operands with float32 accumulation (their products are exact in float32), the t
    partials are added in float32 and the sum is rounded to the compute dtype once: what the
    unconverted matmul does with its float32 accumulator, up to the order of the additions. Summing
    in bfloat16 would round t times (t partials, each already rounded, then every addition),
    about ``t`` times the single-worker error; float32 costs twice the bytes of those two
    collectives (the all-gathers of replicated rows travel in their own dtype, exactly)."""

    device_type: str
    compute: torch.dtype | None

    @classmethod
    def of(cls, t: torch.Tensor) -> "Precision":
        """The autocast state of ``t``'s device now."""
        device_type = t.device.type
        on = torch.is_autocast_enabled(device_type)
        return cls(device_type, torch.get_autocast_dtype(device_type) if on else None)

    def off(self):
        """A region with autocast off on the device (the Functions cast explicitly)."""
        return torch.autocast(self.device_type, enabled=False)

    def cast(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """``t`` as autocast casts a matmul operand: floating tensors (not float64) to ``compute``."""
        if t is None or self.compute is None or not t.is_floating_point() or t.dtype == torch.float64:
            return t
        return t.to(self.compute)

    def sum_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype partial sums of a ``dtype`` matmul travel and are added in (see above)."""
        return torch.promote_types(dtype, torch.float32) if self.compute is not None else dtype


def partial_mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` as a partial sum in ``dtype`` (the operands upcast: bfloat16/float16 products are
    exact in float32, so this is the low-precision matmul with a float32 accumulator, unrounded)."""
    return torch.mm(a.to(dtype), b.to(dtype))


class ColumnParallelLinear(torch.autograd.Function):
    """``x @ w_r^T + b_r`` on a replicated ``x`` (``F.linear``; under autocast in its dtype, as
    ``F.linear`` runs). Backward: the input gradient is the all-reduced sum of the ranks' partials
    (in :meth:`Precision.sum_dtype`, rounded once; overlapped with the weight-gradient matmul)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, comm: Comm) -> torch.Tensor:
        prec = Precision.of(x)
        with prec.off():
            xc, wc, bc = prec.cast(x), prec.cast(weight), prec.cast(bias)
            ctx.save_for_backward(xc, wc)
            ctx.comm, ctx.prec, ctx.dtypes = comm, prec, (x.dtype, weight.dtype)
            return F.linear(xc, wc, bc)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        with ctx.prec.off():
            return ColumnParallelLinear._backward(ctx, g)

    @staticmethod
    def _backward(ctx, g: torch.Tensor):
        x, weight = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        g = g.to(x.dtype)
        gx = handle = None
        if ctx.needs_input_grad[0]:
            gx = partial_mm(g, weight, ctx.prec.sum_dtype(g.dtype) if ctx.comm.group.size > 1 else g.dtype)
            handle = ctx.comm.all_reduce(gx.view(-1), async_op=True)
        gw = None
        if ctx.needs_input_grad[1]:
            # The matmul autograd runs for F.linear's addmm: a weight stored [in, out] (a Conv1D's,
            # passed transposed) gets x^T g, one stored [out, in] gets g^T x (bit for bit).
            stored_transposed = not weight.is_contiguous() and weight.t().is_contiguous()
            gw = ((x.t() @ g).t() if stored_transposed else g.t() @ x).to(w_dtype)
        gb = g.sum(0).to(w_dtype) if ctx.needs_input_grad[2] else None
        if handle is not None:
            handle.wait()
            gx = gx.to(x.dtype).to(x_dtype)  # rounded once to the compute dtype, as autocast's cast passes it
        return gx, gw, gb, None


class _CopyToRanks(torch.autograd.Function):
    """Identity forward; backward: the all-reduced sum of the ranks' gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm, ctx.prec = comm, Precision.of(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        total = g.to(ctx.prec.sum_dtype(g.dtype)).contiguous().clone()
        ctx.comm.all_reduce(total.view(-1))
        return total.to(g.dtype), None


class _ReduceScatterRows(torch.autograd.Function):
    """[T, h] partial sums -> this rank's rows of the sum (added in :meth:`Precision.sum_dtype`,
    rounded once); backward: all-gather (every rank's partial gets the gradient of the whole sum)."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, comm: Comm) -> torch.Tensor:
        tokens, width = z.shape
        rows = shard_bounds(tokens, comm.group.size)
        buf = z.to(Precision.of(z).sum_dtype(z.dtype)).contiguous().clone()
        comm.reduce_scatter(buf.view(-1), [(lo * width, hi * width) for lo, hi in rows])
        ctx.comm, ctx.rows = comm, rows
        lo, hi = rows[comm.group.rank]
        return buf[lo:hi].to(z.dtype, copy=True)

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
