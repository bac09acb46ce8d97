"""The two residual sub-layers of a transformer block, tensor-parallel: pre-norm attention and MLP.

Purpose: ``y = x + dropout(out(attention(qkv(norm(x)))))`` and
``y = x + dropout(proj(act(fc(norm(x)))))`` over the ``t`` ranks of a group, as functions of the
tensors a rank holds, so that :mod:`virtualflow.parallel.tensor` (virtualflow's own blocks) and
:mod:`virtualflow.parallel.convert` (nanoGPT's and Hugging Face's blocks, whatever their
parameter names) run the same code. Also :func:`attend` (the attention core with
attention-probability dropout), which the single-worker blocks call too.

Invariants:

- ``x`` is replicated; the norm (any module: ``nn.LayerNorm``, nanoGPT's ``LayerNorm``) runs on
  every rank on the whole ``x`` with replicated parameters (Megatron without sequence
  parallelism). The column-parallel projection's input gradient is all-reduced (bit-identical on
  every rank: the ring reduces each chunk on one rank and all-gathers it), so the norm's backward
  sees the same gradient on every rank and its parameter gradients are bit-identical everywhere.
- A :class:`Projection` is in ``nn.Linear``'s layout (``weight [out, in]``); a ``Conv1D``'s
  ``[in, out]`` weight is passed as its transposed view, so ``F.linear`` runs
  ``addmm(b, x, W)``, the ``Conv1D``'s own kernel.
- Dropout: the residual dropout follows the rows rule of :func:`virtualflow.parallel.seeds.dropout_keep`,
  the attention probabilities the (sample, global head) rule of
  :func:`virtualflow.parallel.seeds.attention_keep`; with no seed (eval mode, p = 0) the
  attention is ``F.scaled_dot_product_attention`` itself (what nanoGPT and Hugging Face's
  ``sdpa`` run), and with one it is the plain formula (softmax, mask, matmul).
- Every rank calls the same sub-layers in the same order with the same shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from virtualflow.parallel.collectives import ColumnParallelLinear, Comm, TokenLayout
from virtualflow.parallel.overlap import EpilogueConfig, RowParallelEpilogue
from virtualflow.parallel.seeds import attention_keep, keep_scale

GELU_KINDS = {"exact": "none", "tanh": "tanh", "none": "none"}
"""Block option -> ``F.gelu``'s ``approximate``."""

Norm = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class Projection:
    """A projection's weight in ``nn.Linear``'s layout ``[out, in]`` (maybe a transposed view) and
    its bias (None: none)."""

    weight: torch.Tensor
    bias: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class Heads:
    """The attention heads one rank computes: global heads ``[first, first + count)``."""

    first: int
    count: int
    head_dim: int
    causal: bool
    scale: float | None
    """Scores are ``q k^T * scale``; None: ``1 / sqrt(head_dim)``."""
    attn_p: float
    """Dropout on the attention probabilities (training only)."""


def attend(qkv: torch.Tensor, batch: int, seq: int, heads: Heads, seed: int | None) -> torch.Tensor:
    """``[T, 3 * count * head_dim]`` (q, k, v blocks, each ``count`` heads) -> the context
    ``[T, count * head_dim]``. ``seed`` None: no attention dropout."""
    q, k, v = qkv.view(batch, seq, 3, heads.count, heads.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    if seed is None or heads.attn_p == 0:
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=heads.causal, scale=heads.scale)
    else:
        scale = heads.scale if heads.scale is not None else heads.head_dim ** -0.5
        scores = (q @ k.transpose(-2, -1)) * scale
        if heads.causal:
            allowed = torch.ones(seq, seq, dtype=torch.bool, device=qkv.device).tril()
            scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        keep = attention_keep(seed, batch, heads.first, heads.count, seq, seq, heads.attn_p).to(qkv.device)
        ctx = (probs * keep_scale(keep, heads.attn_p, probs.dtype)) @ v
    return ctx.transpose(1, 2).reshape(batch * seq, heads.count * heads.head_dim)


def _normed(x: torch.Tensor, norm: Norm | None, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    x2 = x.reshape(-1, hidden)
    if norm is None:
        return x2, x2
    return x2, norm(x).reshape(-1, hidden)


def attention_sublayer(x: torch.Tensor, norm: Norm | None, qkv: Projection, out: Projection, heads: Heads,
                       comm: Comm, *, chunks: int, resid_p: float, resid_seed: int | None,
                       attn_seed: int | None) -> torch.Tensor:
    """``x + dropout(out(attend(qkv(norm(x)))))`` on ``x [batch, seq, hidden]``: qkv
    column-parallel (this rank's heads), out row-parallel, reduce-scatter, epilogue, all-gather."""
    if x.dim() != 3:
        raise ValueError(f"attention input must be [batch, seq, hidden], got {tuple(x.shape)}")
    batch, seq, hidden = x.shape
    x2, a2 = _normed(x, norm, hidden)
    local = column_parallel(a2, qkv.weight, qkv.bias, comm)
    ctx = attend(local, batch, seq, heads, attn_seed)
    return row_parallel(ctx, None, None, out.weight, out.bias, x2, comm, chunks, resid_p, resid_seed,
                        "none").reshape(x.shape)


def mlp_sublayer(x: torch.Tensor, norm: Norm | None, fc: Projection, proj: Projection,
                 act: str | Callable[[torch.Tensor], torch.Tensor], comm: Comm, *, chunks: int, resid_p: float,
                 resid_seed: int | None) -> torch.Tensor:
    """``x + dropout(proj(act(fc(norm(x)))))`` on ``x [..., hidden]``. ``act``: ``"none"`` or
    ``"tanh"`` (``F.gelu``'s ``approximate``: fc + gelu fused into the chunked epilogue, so the
    whole MLP overlaps with communication) or any element-wise callable (a module such as
    Hugging Face's ``NewGELUActivation``, run by autograd between the two projections)."""
    hidden = x.shape[-1]
    x2, a2 = _normed(x, norm, hidden)
    if isinstance(act, str):
        y = row_parallel(a2, fc.weight, fc.bias, proj.weight, proj.bias, x2, comm, chunks, resid_p, resid_seed, act)
    else:
        h = act(column_parallel(a2, fc.weight, fc.bias, comm))
        y = row_parallel(h, None, None, proj.weight, proj.bias, x2, comm, chunks, resid_p, resid_seed, "none")
    return y.reshape(x.shape)


# The two calls that communicate, opaque to torch.compile: dynamo runs each as one eager call
# (a graph break before and after it) and compiles the rest of the block (norms, attention,
# activations, residuals). The communicator is read only inside them, so dynamo neither traces
# the ring collectives nor guards on the communicator object: a new generation's communicator
# (virtualflow.runtime.pipeline.tensor_grid.rebind_comm) recompiles nothing.


@torch.compiler.disable
def column_parallel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, comm: Comm) -> torch.Tensor:
    """:class:`ColumnParallelLinear` (this rank's output features of a replicated input)."""
    return ColumnParallelLinear.apply(x, weight, bias, comm)


@torch.compiler.disable
def row_parallel(inp: torch.Tensor, w1: torch.Tensor | None, b1: torch.Tensor | None, w2: torch.Tensor,
                 b2: torch.Tensor | None, resid: torch.Tensor, comm: Comm, chunks: int, resid_p: float,
                 resid_seed: int | None, gelu: str) -> torch.Tensor:
    """:class:`RowParallelEpilogue` over ``chunks`` overlap chunks of the token rows (with fc1 +
    ``gelu`` fused in when ``w1`` is given)."""
    cfg = EpilogueConfig(comm, TokenLayout.build(resid.shape[0], comm.group.size, chunks), resid_p, resid_seed,
                         gelu=gelu)
    return RowParallelEpilogue.apply(inp, w1, b1, w2, b2, resid, cfg)
