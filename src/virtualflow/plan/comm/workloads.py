"""The three shipped programs, each a few lines of the builder, and example inputs for them.

* :func:`dp_adam` -- a data-parallel Adam step: each rank's (already loss-weighted) gradient is
  summed by an all-reduce, and every rank runs the same Adam update on the whole replicated
  weights and moments. ``split`` + ``reorder`` turn it into reduce-scatter -> Adam on 1/p of the
  elements (moments stored sliced) -> all-gather of the weights (ZeRO-style sharding).
* :func:`tp_mlp` -- a Megatron-style tensor-parallel MLP: column-parallel fc1, gelu, row-parallel
  fc2 (partial sums), then all-reduce + bias + dropout + residual.
* :func:`pipeline_boundary` -- a tensor-parallel MLP stage whose output is sent to the next
  stage (t ranks each), which runs a column-parallel matmul on it.

:func:`example_inputs` draws inputs for any of them from a seed (dropout masks included).
"""

from __future__ import annotations

from typing import Callable

import torch

from virtualflow.plan.comm.build import Builder
from virtualflow.plan.comm.ir import Local, Program, Replicated, Sliced


def dp_adam(shapes: tuple[tuple[int, ...], ...] = ((64, 8), (8,)), *, lr: float = 1e-3, beta1: float = 0.9,
            beta2: float = 0.999, eps: float = 1e-8, step: int = 1, clip: float | None = None) -> Program:
    """A data-parallel Adam step over parameters of ``shapes`` (one all-reduce each); ``clip``:
    scale the gradients by ``clip / max(norm, clip)`` first (``norm``: their global L2 norm)."""
    b = Builder("dp_adam")
    c1, c2 = 1.0 / (1.0 - beta1 ** step), 1.0 / (1.0 - beta2 ** step)
    grads = [b.input(f"grad{i}", shape, Local()) for i, shape in enumerate(shapes)]
    gs = [b.all_reduce(grad, name=f"g{i}") for i, grad in enumerate(grads)]  # all gradients are ready
    if clip is not None:
        sq = [b.sum_sq(g, name=f"sq{i}") for i, g in enumerate(gs)]
        total = sq[0]
        for x in sq[1:]:
            total = total + x
        scale = clip / b.maximum(b.sqrt(total, name="norm"), clip)
        gs = [b.mul(g, scale, name=f"g{i}_clipped") for i, g in enumerate(gs)]
    for i, (shape, g) in enumerate(zip(shapes, gs)):
        w = b.state(f"w{i}", shape, Replicated())
        m = b.state(f"m{i}", shape, Replicated(), shardable=True)  # optimizer state: only this program reads it
        v = b.state(f"v{i}", shape, Replicated(), shardable=True)
        m2 = b.add(m * beta1, g * (1.0 - beta1), name=f"m{i}_new")
        v2 = b.add(v * beta2, g * g * (1.0 - beta2), name=f"v{i}_new")
        w2 = b.sub(w, (m2 * c1) / (b.sqrt(v2 * c2) + eps) * lr, name=f"w{i}_new")
        b.update(m, m2)
        b.update(v, v2)
        b.update(w, w2)
    return b.build()


def _mlp_block(b: Builder, x, seq: int, hidden: int, ffn: int, p_drop: float, stage: int, tag: str = ""):
    w1 = b.input(f"w1{tag}", (hidden, ffn), Sliced(1), stage=stage)   # column parallel
    b1 = b.input(f"b1{tag}", (ffn,), Sliced(0), stage=stage)
    w2 = b.input(f"w2{tag}", (ffn, hidden), Sliced(0), stage=stage)   # row parallel
    b2 = b.input(f"b2{tag}", (hidden,), Replicated(), stage=stage)
    mask = b.input(f"mask{tag}", (seq, hidden), Replicated(), stage=stage)
    h = b.gelu(b.matmul(x, w1) + b1, name=f"h{tag}")                # Sliced(1)
    z = b.matmul(h, w2, name=f"z{tag}")                             # Local: partial sums
    y = b.all_reduce(z, name=f"y_sum{tag}")
    return b.add(b.dropout(y + b2, mask, p_drop), x, name=f"y{tag}")


def tp_mlp(seq: int = 8, hidden: int = 16, ffn: int = 64, p_drop: float = 0.1) -> Program:
    """One Megatron MLP layer over t ranks: ``y = x + dropout(gelu(x W1 + b1) W2 + b2)``."""
    b = Builder("tp_mlp")
    x = b.input("x", (seq, hidden), Replicated())
    b.output(_mlp_block(b, x, seq, hidden, ffn, p_drop, 0))
    return b.build()


def pipeline_boundary(seq: int = 8, hidden: int = 16, ffn: int = 64, p_drop: float = 0.1) -> Program:
    """Stage 0: a tensor-parallel MLP layer; its output crosses to stage 1 (t ranks each), which
    multiplies it by a column-parallel weight."""
    b = Builder("pipeline_boundary")
    x = b.input("x", (seq, hidden), Replicated())
    y = _mlp_block(b, x, seq, hidden, ffn, p_drop, 0)
    x1 = b.send(y, 1, name="x1")
    w3 = b.input("w3", (hidden, ffn), Sliced(1), stage=1)
    b.output(b.gelu(b.matmul(x1, w3), name="h1"))
    return b.build()


WORKLOADS: dict[str, Callable[[], Program]] = {
    "dp_adam": dp_adam, "tp_mlp": tp_mlp, "pipeline_boundary": pipeline_boundary,
}
"""Name -> builder with default sizes (what ``virtualflow explain`` runs)."""

DEFAULT_REWRITES: dict[str, tuple[str, ...]] = {
    "dp_adam": ("split", "reorder", "fuse"),
    "tp_mlp": ("split", "reorder", "fuse", "overlap"),
    "pipeline_boundary": ("split", "reorder", "boundary"),
}


def example_inputs(prog: Program, p: int, seed: int = 0) -> dict[str, object]:
    """Inputs for ``prog`` on ``p`` ranks from ``seed``: ``N(0, 1)`` values (scaled by 0.1 for
    names starting with ``w``), non-negative second moments (``v*``), 0/1 keep-masks (``mask*``,
    keep probability 0.9), and p independent values per Local input."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, object] = {}
    for d in prog.decls:
        def draw() -> torch.Tensor:
            if d.name.startswith("mask"):
                return (torch.rand(d.shape, generator=gen) < 0.9).to(d.dtype)
            t = torch.randn(d.shape, generator=gen, dtype=d.dtype)
            if d.name.startswith("v"):
                return t.abs() * 0.01
            return t * 0.1 if d.name.startswith("w") else t
        out[d.name] = [draw() for _ in range(p)] if isinstance(d.layout, Local) else draw()
    return out
