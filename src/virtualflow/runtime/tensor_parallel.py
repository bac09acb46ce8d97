"""Tensor-parallel transformer blocks (Megatron-style) with CoCoNeT's reorder and overlap.

Purpose: a transformer MLP block or attention block split over the ``t`` ranks of a group, each
rank holding ``1/t`` of the block's weights, computing the single-worker block (:class:`MLPBlock`,
:class:`AttentionBlock`, in this file) up to the order of floating-point sums (see "What
'exactly' means here" below).

Layouts (``T`` = tokens = batch * sequence, ``h`` = hidden width, ``f`` = MLP width, rank ``r``)::

    x        [T, h]      replicated (every rank holds the same tensor)
    fc1/qkv  column-parallel: rank r holds the rows of its slice of f (MLP), or of its heads
             (attention: its rows of each of q, k and v)        -> [T, f_r] / [T, 3 h_r], local
    fc2/out  row-parallel: rank r holds the matching columns    -> z_r [T, h], a *partial sum*
    reduce-scatter along tokens: rank r gets sum_r z_r on its token rows only      [T_r, h]
    on those rows: + bias, dropout, + residual x   (pointwise work on 1/t of the elements)
    all-gather along tokens                                     -> y [T, h], replicated

A tensor ``[T, h]`` cut along tokens is one contiguous range of its flat storage per rank, which
is what the ring collectives (:class:`virtualflow.comm.ring.Collectives`) work on in place.

**Overlap** (``chunks = k``): the token rows are cut into ``k`` chunks (``shard_bounds(T, k)``)
and each chunk is itself cut over the ``t`` ranks (:class:`TokenLayout`); chunk ``c``'s
reduce-scatter is issued asynchronously while chunk ``c+1`` computes, and chunk ``c``'s epilogue
and all-gather follow as soon as its reduce-scatter is done. Every chunk is a complete
reduce-scatter over ``t`` ranks, so a rank owns ``k`` row ranges (one per chunk) instead of one;
the result is the same tensor. The MLP is token-wise, so its whole chain (fc1, gelu, fc2) is the
producer that is chunked; attention mixes the tokens of a sequence, so only its out-projection is.
Backward overlaps the same way: each chunk's all-gather of the output gradient runs while the
previous chunk's matmuls compute, and (MLP) each chunk's all-reduce of the input gradient runs
while the next chunk computes.

**Gradients** (the invariant for replicated tensors, as in Megatron): the gradient arriving at a
replicated tensor is the same on every rank (every rank computes the same loss from the same
replicated output). Under it:

* all-gather's backward is "take this rank's rows" (no communication; the adjoint of an
  all-gather, a reduce-scatter, would add ``t`` equal copies);
* reduce-scatter's backward is an all-gather: the gradient of every rank's partial ``z_r`` is the
  gradient of the sum for *all* tokens;
* the residual's gradient is the output gradient itself (known on every rank);
* the replicated input of a column-parallel layer gets the *sum* of the ranks' partial input
  gradients: one all-reduce (overlapped with the weight-gradient matmul);
* the replicated bias of the epilogue gets ``sum`` over tokens of the all-gathered gradient,
  computed locally: bit-identical to the single-worker block's, with no extra message.

So the block's input gradient is again the same on every rank, and blocks compose. Each rank's
weight shards get exactly the slices of the single-worker block's gradients
(:meth:`TensorParallelMLP.shard_state` slices a full state or gradient dict the same way). The
blocks run these steps fused in two autograd Functions (so that they can be chunked and overlapped
in both directions); :func:`copy_to_ranks`, :func:`reduce_scatter_rows` and
:func:`all_gather_rows` are the same collectives unfused, one differentiable op each, for other
compositions.

**Dropout rule** (so that ``t`` ranks and the single worker draw the same mask): the keep-mask of
the ``[T, h]`` output is cut into blocks of :data:`DROPOUT_BLOCK_ROWS` token rows; block ``b`` is
``torch.rand(DROPOUT_BLOCK_ROWS, h) >= p`` from a CPU generator seeded with
``splitmix64((seed mod 2**32) << 32 | b) mod 2**32`` (:func:`dropout_keep`; torch's CPU
generator keeps only the low 32 bits of a seed, so seed and block are mixed first). A rank draws
only the blocks that meet its rows (its share plus at most two partial blocks per chunk), so the
mask of a token depends on neither ``t`` nor ``k``. ``seed`` is the forward's ``dropout_seed`` or,
when not given, the module's ``seed`` plus the number of training forwards it ran before (every
rank runs the same number). The single-worker blocks draw the whole mask by the same rule.

**Bytes per rank** (ring collectives, ``e`` bytes per element, even chunks): forward:
reduce-scatter ``(t-1)/t T h e`` + all-gather ``(t-1)/t T h e``; backward: all-gather
``(t-1)/t T h e`` + all-reduce ``2 (t-1)/t T h e`` of the input gradient (only when the input needs
one; MLP: one per chunk, attention: one for the qkv projection). Chunking changes only the number
of collectives (``k`` times as many), not the bytes. Saved for backward per rank: the input, fc1's
pre-activation and activation ``[T, f/t]`` (MLP), and the keep-mask of the owned rows (bool,
``[T/t, h]``).

**The same block on every rank.** ``MLPBlock(..., seed=s)`` / ``AttentionBlock(..., seed=s)`` draw
their whole weights from ``s`` (:func:`init_linears`), not from the global generator, so every
rank builds the same single-worker block and ``from_module`` cuts its slice of it; ``from_module``
also checks that the ranks' blocks are equal (:func:`verify_same_block`, one small all-reduce) and
refuses otherwise, since a rank holding another block gives a wrong output with no error.

**What "exactly" means here.** The tensor-parallel block adds the ranks' partial sums in the
ring's order and, with ``chunks = k``, multiplies row chunks of the tokens (``x[rows] @ W``); BLAS
picks its kernel by shape, so neither is the single worker's arithmetic and the outputs agree to
float tolerance, not bit for bit (the tests hold float64 to ``1e-12`` and float32 to
``atol=1e-5, rtol=1e-4``; docs/coconet.md has the measured differences). Bit-identical on every CPU are the
results whose two sides run the same kernels on the same shapes: the overlapped and the serial
schedule of the same ``k`` (the same matmuls, waited for at other times), one rank with
``chunks=1`` against the single-worker block, and the out-projection's bias gradient (summed
locally from the all-gathered ``[T, h]`` gradient, as the single worker sums it).

Invariants: every rank calls the same blocks in the same order with the same shapes (the
collectives run in issue order, see ``comm/ring.py``); ``t`` <= the MLP width and <= the number
of heads (no rank without weights).
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from virtualflow.plan.shards import shard_bounds

Bounds = list[tuple[int, int]]

DROPOUT_BLOCK_ROWS = 64
"""Token rows per dropout block (see the module docstring's dropout rule)."""

_MASK32 = (1 << 32) - 1
_MASK64 = (1 << 64) - 1
_INIT_TAG = 0x5EED_0F_11  # mixed into the weight generator's seed (the dropout blocks mix in block indices)


# --------------------------------------------------------------------------------------------
# What the blocks need from communication.


class _Rank(Protocol):
    rank: int
    size: int


class Handle(Protocol):
    def wait(self) -> None: ...


class Comm(Protocol):
    """The collectives a tensor-parallel block uses (:class:`virtualflow.comm.ring.Collectives`
    is one): in place on a 1-D contiguous tensor, ``bounds`` one ``(lo, hi)`` per rank."""

    group: _Rank

    def reduce_scatter(self, flat: torch.Tensor, bounds: Sequence[tuple[int, int]], *,
                       async_op: bool = False) -> Handle | None: ...

    def all_gather(self, flat: torch.Tensor, bounds: Sequence[tuple[int, int]], *,
                   async_op: bool = False) -> Handle | None: ...

    def all_reduce(self, flat: torch.Tensor, *, async_op: bool = False) -> Handle | None: ...


# --------------------------------------------------------------------------------------------
# Layouts (pure).


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


# --------------------------------------------------------------------------------------------
# Dropout (the rule of the module docstring).


def dropout_keep(seed: int, lo: int, hi: int, width: int, p: float,
                 block_rows: int = DROPOUT_BLOCK_ROWS) -> torch.Tensor:
    """The keep-mask (bool ``[hi - lo, width]``, on the CPU: the rule's generator is torch's CPU
    generator on every device) of token rows ``[lo, hi)`` under ``seed``."""
    if not 0 <= lo <= hi:
        raise ValueError(f"dropout_keep: rows [{lo}, {hi}) are not a valid range")
    if hi == lo:
        return torch.ones(0, width, dtype=torch.bool)
    pieces = []
    gen = torch.Generator()
    for b in range(lo // block_rows, (hi - 1) // block_rows + 1):
        if b > _MASK32:
            raise ValueError(f"dropout_keep: {hi} token rows exceed the rule's 2**32 blocks")
        gen.manual_seed(_splitmix64(((seed & _MASK32) << 32) | b) & _MASK32)
        block = torch.rand(block_rows, width, generator=gen) >= p
        a, z = max(lo, b * block_rows) - b * block_rows, min(hi, (b + 1) * block_rows) - b * block_rows
        pieces.append(block[a:z])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _splitmix64(x: int) -> int:
    """A bijective 64-bit mixer (Steele, Lea, Flood 2014), so nearby (seed, block) pairs seed
    unrelated-looking streams."""
    m = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def keep_scale(keep: torch.Tensor, p: float, dtype: torch.dtype) -> torch.Tensor:
    """``keep`` as 0 or ``1/(1-p)`` in ``dtype`` (the single-worker block multiplies by the same)."""
    return keep.to(dtype) * (1.0 / (1.0 - p))


class _Seeds:
    """The dropout seed of each training forward: explicit, or ``seed`` + forwards so far."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.calls = 0

    def next(self, explicit: int | None) -> int:
        if explicit is not None:
            return explicit
        s = self.seed + self.calls
        self.calls += 1
        return s


def _check_p(p: float) -> None:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p={p} must be in [0, 1)")


# --------------------------------------------------------------------------------------------
# The single-worker reference blocks (same math, same dropout rule).


def init_linears(seed: int, *linears: nn.Linear) -> None:
    """Draw the weights and biases of ``linears`` (in order) from a CPU generator seeded from
    ``seed`` alone, with ``nn.Linear``'s own distribution (``U(-1/sqrt(in), 1/sqrt(in))`` for both).

    Why: ``nn.Linear`` draws from the global generator, whose state differs between ranks (data
    shuffling, per-rank seeds): ranks would cut *different* blocks and the tensor-parallel output
    would be wrong with no error. Drawn from ``seed``, the whole (unsharded) matrices are the same
    on every rank and each rank takes its slice. The global generator is not touched. The
    generator's seed is ``seed`` mixed twice with a tag: a stream unrelated to the dropout blocks'."""
    gen = torch.Generator()
    gen.manual_seed(_splitmix64(_splitmix64(seed & _MASK64) ^ _INIT_TAG) & _MASK32)
    with torch.no_grad():
        for lin in linears:
            bound = 1.0 / math.sqrt(lin.in_features) if lin.in_features > 0 else 0.0
            weight = torch.empty(lin.weight.shape, dtype=torch.float32).uniform_(-bound, bound, generator=gen)
            lin.weight.copy_(weight)
            if lin.bias is not None:
                lin.bias.copy_(torch.empty(lin.bias.shape, dtype=torch.float32).uniform_(-bound, bound, generator=gen))


def _skip_init_linear(in_features: int, out_features: int) -> nn.Linear:
    """An ``nn.Linear`` whose constructor draws nothing from the global generator (its values are
    set by :func:`init_linears`)."""
    return torch.nn.utils.skip_init(nn.Linear, in_features, out_features)


def epilogue(z: torch.Tensor, bias: torch.Tensor, scale: torch.Tensor | None, resid: torch.Tensor) -> torch.Tensor:
    """``(z + bias) * keep_scale + resid``: the pointwise work between the collectives."""
    v = z + bias
    if scale is not None:
        v = v * scale
    return v + resid


class MLPBlock(nn.Module):
    """``y = x + dropout(fc2(gelu(fc1(x))))`` on ``[..., hidden]`` (one worker).

    ``seed`` fixes the weights (drawn whole from it, :func:`init_linears`) and the dropout
    masks, and nothing else does: every rank that builds ``MLPBlock(..., seed=s)`` holds the same
    block, whatever its global random state, so :meth:`TensorParallelMLP.from_module` cuts the
    same block on every rank. Stacked blocks need different seeds."""

    def __init__(self, hidden: int, ffn_hidden: int, dropout_p: float = 0.0, *, seed: int = 0) -> None:
        super().__init__()
        _check_p(dropout_p)
        self.fc1 = _skip_init_linear(hidden, ffn_hidden)
        self.fc2 = _skip_init_linear(ffn_hidden, hidden)
        init_linears(seed, self.fc1, self.fc2)
        self.dropout_p = dropout_p
        self.seeds = _Seeds(seed)

    def forward(self, x: torch.Tensor, *, dropout_seed: int | None = None) -> torch.Tensor:
        h = self.fc2.out_features
        x2 = x.reshape(-1, h)
        a = F.gelu(F.linear(x2, self.fc1.weight, self.fc1.bias))
        z = a @ self.fc2.weight.t()
        scale = _full_scale(self, x2, dropout_seed)
        return epilogue(z, self.fc2.bias, scale, x2).reshape(x.shape)


class AttentionBlock(nn.Module):
    """``y = x + dropout(out(attention(qkv(x))))`` on ``[batch, seq, hidden]`` (one worker); qkv's
    rows are ``[q; k; v]``, each ``heads`` blocks of ``hidden / heads`` rows. ``seed`` fixes the
    weights and the dropout masks, as in :class:`MLPBlock`."""

    def __init__(self, hidden: int, heads: int, dropout_p: float = 0.0, *, causal: bool = True,
                 seed: int = 0) -> None:
        super().__init__()
        _check_p(dropout_p)
        if heads < 1 or hidden % heads:
            raise ValueError(f"AttentionBlock: hidden={hidden} must be a multiple of heads={heads}")
        self.qkv = _skip_init_linear(hidden, 3 * hidden)
        self.out = _skip_init_linear(hidden, hidden)
        init_linears(seed, self.qkv, self.out)  # the same block on every rank (see MLPBlock)
        self.heads = heads
        self.causal = causal
        self.dropout_p = dropout_p
        self.seeds = _Seeds(seed)

    def forward(self, x: torch.Tensor, *, dropout_seed: int | None = None) -> torch.Tensor:
        hidden = self.out.out_features
        x2 = _flat_tokens(x, hidden)
        qkv = F.linear(x2, self.qkv.weight, self.qkv.bias)
        ctx = _attend(qkv, x.shape[0], x.shape[1], self.heads, hidden // self.heads, self.causal)
        z = ctx @ self.out.weight.t()
        scale = _full_scale(self, x2, dropout_seed)
        return epilogue(z, self.out.bias, scale, x2).reshape(x.shape)


def _full_scale(block: Any, x2: torch.Tensor, dropout_seed: int | None) -> torch.Tensor | None:
    if not (block.training and block.dropout_p > 0):
        return None
    seed = block.seeds.next(dropout_seed)
    keep = dropout_keep(seed, 0, x2.shape[0], x2.shape[1], block.dropout_p).to(x2.device)
    return keep_scale(keep, block.dropout_p, x2.dtype)


def _flat_tokens(x: torch.Tensor, hidden: int) -> torch.Tensor:
    if x.dim() != 3 or x.shape[-1] != hidden:
        raise ValueError(f"attention input must be [batch, seq, hidden={hidden}], got {tuple(x.shape)}")
    return x.reshape(-1, hidden)


def _attend(qkv: torch.Tensor, batch: int, seq: int, heads: int, head_dim: int, causal: bool) -> torch.Tensor:
    """``[T, 3 * heads * head_dim]`` (q, k, v blocks) -> attention context ``[T, heads * head_dim]``."""
    q, k, v = qkv.view(batch, seq, 3, heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    ctx = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return ctx.transpose(1, 2).reshape(batch * seq, heads * head_dim)


# --------------------------------------------------------------------------------------------
# The autograd Functions.


class _ColumnParallelLinear(torch.autograd.Function):
    """``x @ w_r^T + b_r`` on a replicated ``x``. Backward: the input gradient is the all-reduced
    sum of the ranks' partials (overlapped with the weight-gradient matmul)."""

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
        gw = g.t() @ x if ctx.needs_input_grad[1] else None
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


@dataclass(frozen=True, slots=True)
class _EpilogueConfig:
    comm: Comm
    layout: TokenLayout
    dropout_p: float
    seed: int | None
    """None: no dropout (eval mode or p = 0)."""


class _RowParallelEpilogue(torch.autograd.Function):
    """Per overlap chunk: [fc1 + gelu, when ``w1`` is given] -> ``a @ w2_r^T`` (partial sum) ->
    async reduce-scatter -> ``(+ b2, dropout, + resid)`` on the owned rows -> async all-gather.

    Inputs: ``inp`` [T, i] (the MLP's replicated x, or attention's local context [T, h_r]),
    ``w1`` [f_r, h] and ``b1`` [f_r] or None, ``w2`` [h, f_r], ``b2`` [h] (replicated), ``resid``
    [T, h] (replicated). Output [T, h] replicated."""

    @staticmethod
    def forward(ctx, inp, w1, b1, w2, b2, resid, cfg: _EpilogueConfig):
        comm, layout = cfg.comm, cfg.layout
        rank = comm.group.rank
        tokens, width = resid.shape
        z = resid.new_empty(tokens, width)
        y = resid.new_empty(tokens, width)
        hpre = a = None
        if w1 is not None:
            hpre = inp.new_empty(tokens, w1.shape[0])
            a = torch.empty_like(hpre)
        keeps: list[torch.Tensor | None] = []
        gathers = []
        pending: deque = deque()

        def finish(c: int, rs) -> None:
            rs.wait()
            lo, hi = layout.owned[c][rank]
            scale = None
            if cfg.seed is not None:
                keep = dropout_keep(cfg.seed, lo, hi, width, cfg.dropout_p).to(resid.device)
                keeps.append(keep)
                scale = keep_scale(keep, cfg.dropout_p, resid.dtype)
            y[lo:hi] = epilogue(z[lo:hi], b2, scale, resid[lo:hi])
            c0, c1 = layout.chunks[c]
            gathers.append(comm.all_gather(y[c0:c1].view(-1), layout.element_bounds(c, width), async_op=True))

        for c, (c0, c1) in enumerate(layout.chunks):
            if w1 is not None:
                torch.addmm(b1, inp[c0:c1], w1.t(), out=hpre[c0:c1])
                a[c0:c1] = F.gelu(hpre[c0:c1])
                src = a[c0:c1]
            else:
                src = inp[c0:c1]
            torch.mm(src, w2.t(), out=z[c0:c1])
            pending.append((c, comm.reduce_scatter(z[c0:c1].view(-1), layout.element_bounds(c, width),
                                                   async_op=True)))
            if len(pending) > 1:
                finish(*pending.popleft())
        while pending:
            finish(*pending.popleft())
        for handle in gathers:
            handle.wait()
        ctx.cfg = cfg
        ctx.keeps = keeps
        ctx.save_for_backward(inp, w1, w2, hpre, a)
        return y

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        cfg: _EpilogueConfig = ctx.cfg
        comm, layout = cfg.comm, cfg.layout
        rank = comm.group.rank
        inp, w1, w2, hpre, a = ctx.saved_tensors
        need_inp, need_w1, need_b1, need_w2, need_b2, need_resid = ctx.needs_input_grad[:6]
        gy = gy.contiguous()
        tokens, width = gy.shape
        # gz: the gradient of (z + b2), the same for every rank's partial z; each rank fills its
        # rows and the all-gathers fill the rest (the reduce-scatter's backward).
        gz = gy.new_empty(tokens, width)
        gathers = []
        for c, (c0, c1) in enumerate(layout.chunks):
            lo, hi = layout.owned[c][rank]
            if cfg.seed is not None:
                torch.mul(gy[lo:hi], keep_scale(ctx.keeps[c], cfg.dropout_p, gy.dtype), out=gz[lo:hi])
            else:
                gz[lo:hi] = gy[lo:hi]
            gathers.append(comm.all_gather(gz[c0:c1].view(-1), layout.element_bounds(c, width), async_op=True))
        src = a if w1 is not None else inp
        g_inp = torch.empty_like(inp) if need_inp else None
        g_w1 = torch.zeros_like(w1) if w1 is not None and need_w1 else None
        g_b1 = w1.new_zeros(w1.shape[0]) if w1 is not None and need_b1 else None
        g_w2 = torch.zeros_like(w2) if need_w2 else None
        reduces = []
        for c, (c0, c1) in enumerate(layout.chunks):
            gathers[c].wait()
            gzc = gz[c0:c1]
            if g_w2 is not None:
                g_w2.addmm_(gzc.t(), src[c0:c1])
            if w1 is None:
                if g_inp is not None:
                    torch.mm(gzc, w2, out=g_inp[c0:c1])
                continue
            gh = torch.ops.aten.gelu_backward(gzc @ w2, hpre[c0:c1])
            if g_w1 is not None:
                g_w1.addmm_(gh.t(), inp[c0:c1])
            if g_b1 is not None:
                g_b1 += gh.sum(0)
            if g_inp is not None:
                torch.mm(gh, w1, out=g_inp[c0:c1])
                reduces.append(comm.all_reduce(g_inp[c0:c1].view(-1), async_op=True))
        g_b2 = gz.sum(0) if need_b2 else None
        for handle in reduces:
            handle.wait()
        return g_inp, g_w1, g_b1, g_w2, g_b2, (gy if need_resid else None), None


# --------------------------------------------------------------------------------------------
# The tensor-parallel blocks.


class _Linear(nn.Module):
    """A weight and a bias (so that parameter names match ``nn.Linear``'s: ``fc1.weight``...)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias)


def block_fingerprint(block: nn.Module) -> list[int]:
    """Three 16-bit numbers hashed from ``block``'s parameters (names, shapes, dtypes, bytes),
    its dropout p and its seed: equal blocks give equal numbers."""
    h = hashlib.blake2b(digest_size=6)
    h.update(repr((type(block).__name__, block.dropout_p, block.seeds.seed)).encode())
    for name, p in block.named_parameters():
        h.update(repr((name, tuple(p.shape), str(p.dtype))).encode())
        h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    d = h.digest()
    return [int.from_bytes(d[i:i + 2], "little") for i in (0, 2, 4)]


def verify_same_block(block: nn.Module, comm: Comm, what: str) -> None:
    """Raise ``ValueError`` on every rank unless every rank of ``comm.group`` holds the same
    ``block`` (by :func:`block_fingerprint`).

    One all-reduce of ``[f, f^2]`` per fingerprint number ``f``: the ranks' numbers are all equal
    exactly when ``t * sum(f^2) == sum(f)^2`` (Cauchy-Schwarz), and with 16-bit numbers every
    sum is an integer below 2**53, exact in float64. Every rank computes the same verdict."""
    t = comm.group.size
    device = next(block.parameters()).device  # the collectives' device (NCCL takes CUDA tensors only)
    f = torch.tensor(block_fingerprint(block), dtype=torch.float64, device=device)
    buf = torch.cat([f, f * f])
    comm.all_reduce(buf)
    n = f.numel()
    if t > 1 and not torch.equal(buf[n:] * t, buf[:n] * buf[:n]):
        raise ValueError(
            f"the {what} passed to from_module differs between the {t} ranks (weights, dropout_p or seed): each "
            f"rank would hold a shard of another block and the output would be wrong; build it with the same "
            f"arguments and seed=... on every rank (the seed fixes the weights) and load the same state, or pass "
            f"verify=False to skip this check")


def _check_chunks(chunks: int) -> None:
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks={chunks!r} must be an int >= 1 (1 = no overlap; k = k overlap chunks)")


class TensorParallelMLP(nn.Module):
    """The MLP block over the ranks of ``comm.group``: rank ``r`` holds fc1's rows and fc2's
    columns of its slice of the MLP width, and fc2's bias (replicated)."""

    def __init__(self, fc1: _Linear, fc2: _Linear, comm: Comm, *, dropout_p: float = 0.0, chunks: int = 1,
                 seed: int = 0) -> None:
        super().__init__()
        _check_p(dropout_p)
        _check_chunks(chunks)
        self.fc1, self.fc2 = fc1, fc2
        self.comm = comm
        self.dropout_p = dropout_p
        self.chunks = chunks
        self.seeds = _Seeds(seed)

    @staticmethod
    def shard_state(full: Mapping[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
        """Rank ``rank``'s slices of an :class:`MLPBlock`'s ``fc1.weight``, ``fc1.bias``,
        ``fc2.weight``, ``fc2.bias`` (parameters or their gradients), as views."""
        f = full["fc1.weight"].shape[0]
        lo, hi = split_range(f, size, rank, "the MLP width (ffn_hidden)", "use fewer ranks or a wider MLP")
        return {"fc1.weight": full["fc1.weight"][lo:hi], "fc1.bias": full["fc1.bias"][lo:hi],
                "fc2.weight": full["fc2.weight"][:, lo:hi], "fc2.bias": full["fc2.bias"]}

    @classmethod
    def from_module(cls, mlp: MLPBlock, comm: Comm, *, chunks: int = 1, verify: bool = True) -> "TensorParallelMLP":
        """This rank's shard of ``mlp`` (copies of its weights' slices; same dropout p and seed).

        ``verify``: first check that every rank passed the same block (:func:`verify_same_block`,
        one small all-reduce, so every rank must call this together); a rank holding another block
        would make the output wrong with no error."""
        if verify:
            verify_same_block(mlp, comm, "MLPBlock")
        with torch.no_grad():
            s = cls.shard_state(dict(mlp.named_parameters()), comm.group.rank, comm.group.size)
            s = {k: v.detach().clone() for k, v in s.items()}
        return cls(_Linear(s["fc1.weight"], s["fc1.bias"]), _Linear(s["fc2.weight"], s["fc2.bias"]), comm,
                   dropout_p=mlp.dropout_p, chunks=chunks, seed=mlp.seeds.seed)

    def forward(self, x: torch.Tensor, *, dropout_seed: int | None = None) -> torch.Tensor:
        width = self.fc2.weight.shape[0]
        if x.shape[-1] != width:
            raise ValueError(f"TensorParallelMLP: input's last dimension {x.shape[-1]} != hidden={width}")
        x2 = x.reshape(-1, width)
        cfg = self._config(x2.shape[0], dropout_seed)
        y = _RowParallelEpilogue.apply(x2, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias, x2, cfg)
        return y.reshape(x.shape)

    def _config(self, tokens: int, dropout_seed: int | None) -> _EpilogueConfig:
        seed = self.seeds.next(dropout_seed) if self.training and self.dropout_p > 0 else None
        return _EpilogueConfig(self.comm, TokenLayout.build(tokens, self.comm.group.size, self.chunks),
                               self.dropout_p, seed)


class TensorParallelAttention(nn.Module):
    """The attention block over the ranks of ``comm.group``: rank ``r`` holds the q, k, v rows of
    its heads and the out-projection's columns of its heads, and the out bias (replicated)."""

    def __init__(self, qkv: _Linear, out: _Linear, comm: Comm, *, heads: int, dropout_p: float = 0.0,
                 causal: bool = True, chunks: int = 1, seed: int = 0) -> None:
        super().__init__()
        _check_p(dropout_p)
        _check_chunks(chunks)
        hidden = out.weight.shape[0]
        if heads < 1 or hidden % heads:
            raise ValueError(f"TensorParallelAttention: hidden={hidden} must be a multiple of heads={heads}")
        self.qkv, self.out = qkv, out
        self.comm = comm
        self.heads = heads
        self.head_dim = hidden // heads
        self.local_heads = out.weight.shape[1] // self.head_dim
        self.dropout_p = dropout_p
        self.causal = causal
        self.chunks = chunks
        self.seeds = _Seeds(seed)

    @staticmethod
    def shard_state(full: Mapping[str, torch.Tensor], rank: int, size: int, heads: int) -> dict[str, torch.Tensor]:
        """Rank ``rank``'s slices of an :class:`AttentionBlock`'s parameters (or gradients)."""
        hidden = full["out.weight"].shape[0]
        d = hidden // heads
        lo, hi = split_range(heads, size, rank, "heads", "use fewer ranks or more heads")
        rows = [slice(j * hidden + lo * d, j * hidden + hi * d) for j in range(3)]
        return {"qkv.weight": torch.cat([full["qkv.weight"][s] for s in rows]),
                "qkv.bias": torch.cat([full["qkv.bias"][s] for s in rows]),
                "out.weight": full["out.weight"][:, lo * d:hi * d], "out.bias": full["out.bias"]}

    @classmethod
    def from_module(cls, block: AttentionBlock, comm: Comm, *, chunks: int = 1,
                    verify: bool = True) -> "TensorParallelAttention":
        """This rank's shard of ``block``; ``verify`` as in :meth:`TensorParallelMLP.from_module`."""
        if verify:
            verify_same_block(block, comm, "AttentionBlock")
        with torch.no_grad():
            s = cls.shard_state(dict(block.named_parameters()), comm.group.rank, comm.group.size, block.heads)
            s = {k: v.detach().clone() for k, v in s.items()}
        return cls(_Linear(s["qkv.weight"], s["qkv.bias"]), _Linear(s["out.weight"], s["out.bias"]), comm,
                   heads=block.heads, dropout_p=block.dropout_p, causal=block.causal, chunks=chunks,
                   seed=block.seeds.seed)

    def forward(self, x: torch.Tensor, *, dropout_seed: int | None = None) -> torch.Tensor:
        hidden = self.out.weight.shape[0]
        x2 = _flat_tokens(x, hidden)
        qkv = _ColumnParallelLinear.apply(x2, self.qkv.weight, self.qkv.bias, self.comm)
        ctx = _attend(qkv, x.shape[0], x.shape[1], self.local_heads, self.head_dim, self.causal)
        seed = self.seeds.next(dropout_seed) if self.training and self.dropout_p > 0 else None
        cfg = _EpilogueConfig(self.comm, TokenLayout.build(x2.shape[0], self.comm.group.size, self.chunks),
                              self.dropout_p, seed)
        y = _RowParallelEpilogue.apply(ctx, None, None, self.out.weight, self.out.bias, x2, cfg)
        return y.reshape(x.shape)
