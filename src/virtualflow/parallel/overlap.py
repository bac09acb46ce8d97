"""The fused, chunked and overlapped row-parallel epilogue of the tensor-parallel blocks (CoCoNeT).

Purpose: per overlap chunk of the token rows, [fc1 + gelu] -> the row-parallel matmul (a partial
sum per rank) -> an asynchronous reduce-scatter -> bias, dropout and residual on the rank's own
rows -> an asynchronous all-gather; chunk ``c``'s reduce-scatter runs while chunk ``c + 1``
computes, and backward overlaps the same way (see :mod:`virtualflow.parallel.tensor`).

Invariants: every chunk is a complete reduce-scatter over the ``t`` ranks (:class:`TokenLayout`),
so the result is the same tensor for every number of chunks; the overlapped and the serial
schedule of the same chunks run the same matmuls (bit-identical); the bias gradient is summed
locally from the all-gathered gradient, as the single worker sums it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from virtualflow.parallel.collectives import Comm, Precision, TokenLayout
from virtualflow.parallel.seeds import dropout_keep, keep_scale


def epilogue(z: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None,
             resid: torch.Tensor) -> torch.Tensor:
    """``(z + bias) * keep_scale + resid``: the pointwise work between the collectives (``bias``
    None: already in ``z``, or the projection has none)."""
    v = z if bias is None else z + bias
    if scale is not None:
        v = v * scale
    return v + resid


@dataclass(frozen=True, slots=True)
class EpilogueConfig:
    comm: Comm
    layout: TokenLayout
    dropout_p: float
    seed: int | None
    """None: no dropout (eval mode or p = 0)."""
    gelu: str = "none"
    """``F.gelu``'s ``approximate`` for the fused fc1 + gelu: ``"none"`` (exact) or ``"tanh"``."""


class RowParallelEpilogue(torch.autograd.Function):
    """Per overlap chunk: [fc1 + gelu, when ``w1`` is given] -> ``a @ w2_r^T`` (partial sum) ->
    async reduce-scatter -> ``(+ b2, dropout, + resid)`` on the owned rows -> async all-gather.

    Inputs: ``inp`` [T, i] (the MLP's replicated (normalised) x, or a local activation [T, i_r]
    such as attention's context), ``w1`` [f_r, h] and ``b1`` [f_r] or None, ``w2`` [h, f_r],
    ``b2`` [h] (replicated) or None, ``resid`` [T, h] (replicated). Output [T, h] replicated.

    On one rank the bias is folded into the matmul (``addmm``, what ``F.linear`` runs), so one
    rank with one chunk runs the single worker's kernels, bit for bit; on ``t > 1`` ranks it is
    added once, after the reduce-scatter."""

    @staticmethod
    def forward(ctx, inp, w1, b1, w2, b2, resid, cfg: EpilogueConfig):
        prec = Precision.of(resid)
        ctx.prec = prec
        ctx.dtypes = tuple(None if t is None else t.dtype for t in (inp, w1, b1, w2, b2))
        with prec.off():
            return RowParallelEpilogue._forward(ctx, *(prec.cast(t) for t in (inp, w1, b1, w2, b2)), resid, cfg)

    @staticmethod
    def _forward(ctx, inp, w1, b1, w2, b2, resid, cfg: EpilogueConfig):
        """The forward with the operands in the compute dtype ``w2.dtype`` (see :class:`Precision`)."""
        comm, layout = cfg.comm, cfg.layout
        rank = comm.group.rank
        fold = b2 is not None and comm.group.size == 1
        # The partial sums z: float32 for a low-precision compute dtype on t > 1 ranks (rounded
        # once, after the reduce-scatter and the bias); one rank runs the single worker's addmm.
        sums = w2.dtype if comm.group.size == 1 else ctx.prec.sum_dtype(w2.dtype)
        w2_sums = w2.to(sums)
        tokens, width = resid.shape
        z = resid.new_empty(tokens, width, dtype=sums)
        y = resid.new_empty(tokens, width, dtype=torch.promote_types(w2.dtype, resid.dtype))
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
                scale = keep_scale(keep, cfg.dropout_p, w2.dtype)
            v = z[lo:hi] if fold or b2 is None else z[lo:hi] + b2
            y[lo:hi] = epilogue(v.to(w2.dtype), None, scale, resid[lo:hi])
            c0, c1 = layout.chunks[c]
            gathers.append(comm.all_gather(y[c0:c1].view(-1), layout.element_bounds(c, width), async_op=True))

        for c, (c0, c1) in enumerate(layout.chunks):
            if w1 is not None:
                if b1 is not None:
                    torch.addmm(b1, inp[c0:c1], w1.t(), out=hpre[c0:c1])
                else:
                    torch.mm(inp[c0:c1], w1.t(), out=hpre[c0:c1])
                a[c0:c1] = F.gelu(hpre[c0:c1], approximate=cfg.gelu)
                src = a[c0:c1]
            else:
                src = inp[c0:c1]
            if fold:
                torch.addmm(b2, src, w2.t(), out=z[c0:c1])
            else:
                torch.mm(src.to(sums), w2_sums.t(), out=z[c0:c1])
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
        ctx.sums = sums
        ctx.save_for_backward(inp, w1, w2, hpre, a)
        return y

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        with ctx.prec.off():
            return RowParallelEpilogue._backward(ctx, gy)

    @staticmethod
    def _backward(ctx, gy: torch.Tensor):
        """Every matmul in the forward's compute dtype ``w2.dtype``; the gradients of the inputs
        in the inputs' own dtypes (as autocast's casts pass them back)."""
        cfg: EpilogueConfig = ctx.cfg
        comm, layout = cfg.comm, cfg.layout
        rank = comm.group.rank
        inp, w1, w2, hpre, a = ctx.saved_tensors
        inp_dtype, w1_dtype, b1_dtype, w2_dtype, b2_dtype = ctx.dtypes
        need_inp, need_w1, need_b1, need_w2, need_b2, need_resid = ctx.needs_input_grad[:6]
        gy = gy.contiguous()
        tokens, width = gy.shape
        # gz: the gradient of (z + b2), the same for every rank's partial z; each rank fills its
        # rows and the all-gathers fill the rest (the reduce-scatter's backward).
        gz = gy.new_empty(tokens, width, dtype=w2.dtype)
        gathers = []
        for c, (c0, c1) in enumerate(layout.chunks):
            lo, hi = layout.owned[c][rank]
            if cfg.seed is not None:
                torch.mul(gy[lo:hi].to(w2.dtype), keep_scale(ctx.keeps[c], cfg.dropout_p, w2.dtype), out=gz[lo:hi])
            else:
                gz[lo:hi] = gy[lo:hi]
            gathers.append(comm.all_gather(gz[c0:c1].view(-1), layout.element_bounds(c, width), async_op=True))
        src = a if w1 is not None else inp
        # The input gradient of the MLP's fc1 is a row-parallel sum (all-reduced in ctx.sums);
        # attention's context is local to the rank.
        g_inp = torch.empty_like(inp, dtype=ctx.sums if w1 is not None else w2.dtype) if need_inp else None
        g_w1 = torch.zeros_like(w1, dtype=w1_dtype) if w1 is not None and need_w1 else None
        g_b1 = w1.new_zeros(w1.shape[0], dtype=b1_dtype) if w1 is not None and need_b1 else None
        g_w2 = torch.zeros_like(w2, dtype=w2_dtype) if need_w2 else None
        reduces = []
        for c, (c0, c1) in enumerate(layout.chunks):
            gathers[c].wait()
            gzc = gz[c0:c1]
            if g_w2 is not None:
                _add_mm(g_w2, gzc.t(), src[c0:c1])
            if w1 is None:
                if g_inp is not None:
                    torch.mm(gzc, w2, out=g_inp[c0:c1])
                continue
            gh = torch.ops.aten.gelu_backward(gzc @ w2, hpre[c0:c1], approximate=cfg.gelu)
            if g_w1 is not None:
                _add_mm(g_w1, gh.t(), inp[c0:c1])
            if g_b1 is not None:
                g_b1 += gh.sum(0)
            if g_inp is not None:
                torch.mm(gh.to(g_inp.dtype), w1.to(g_inp.dtype), out=g_inp[c0:c1])
                reduces.append(comm.all_reduce(g_inp[c0:c1].view(-1), async_op=True))
        g_b2 = gz.sum(0).to(b2_dtype) if need_b2 else None
        for handle in reduces:
            handle.wait()
        if g_inp is not None:
            g_inp = g_inp.to(w2.dtype).to(inp_dtype)  # the sum rounded once to the compute dtype
        return g_inp, g_w1, g_b1, g_w2, g_b2, (gy if need_resid else None), None


def _add_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b``: fused (``addmm_``) when the dtypes agree; else the product in the compute
    dtype, rounded as the single worker's weight gradient is, then added to the parameter-dtype
    accumulator (exact for one chunk)."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    else:
        acc += (a @ b).to(acc.dtype)
