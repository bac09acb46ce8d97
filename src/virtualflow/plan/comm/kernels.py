"""The local (communication-free) ops of a program on one rank's tensors, shared by the
simulator and the executor so both compute the same bits, and the ring's traffic and summation
order (pure).

Fused pointwise chains run as one composed Python function over the chain's ops (the same torch
calls in the same order as the unfused ops, hence bit-identical). ``compile=True`` wraps it in
``torch.compile``; on this project's CPU machines compiling costs tens of seconds per chain and
may contract multiply-adds (not bit-identical), so it is off by default.

The ring (``virtualflow.comm.ring``, p ranks, rank r sends to r+1): reduce-scatter step k sends
chunk ``(r-k-1) mod p``; chunk c starts at rank c+1 and every rank it passes adds its own value,
so the sum of chunk c is ``x_c + (x_{c-1} + (... + (x_{c+2} + x_{c+1})))``. All-gather step k
sends chunk ``(r-k) mod p``. Messages are segments of at most ``segment_bytes``; an empty chunk
sends none. :func:`ring_reduce` and :func:`ring_traffic` restate that schedule here (the planning
layer does not import ``comm/``); tests hold the two to the same numbers.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from virtualflow.plan.comm.ops import Op
from virtualflow.plan.shards import shard_bounds

DEFAULT_SEGMENT_BYTES = 8 * 1024 * 1024
"""The ring's largest message (equal to ``virtualflow.comm.ring.DEFAULT_SEGMENT_BYTES``)."""


def pointwise(fn: str, args: Sequence, attrs: dict) -> torch.Tensor:
    if fn == "add":
        return args[0] + args[1]
    if fn == "sub":
        return args[0] - args[1]
    if fn == "mul":
        return args[0] * args[1]
    if fn == "div":
        return args[0] / args[1]
    if fn in ("maximum", "minimum"):
        a, b = args
        if not isinstance(a, torch.Tensor):
            a, b = b, a  # both are symmetric
        if not isinstance(b, torch.Tensor):
            return torch.clamp(a, min=b) if fn == "maximum" else torch.clamp(a, max=b)
        return torch.maximum(a, b) if fn == "maximum" else torch.minimum(a, b)
    if fn == "sqrt":
        return torch.sqrt(args[0])
    if fn == "neg":
        return -args[0]
    if fn == "gelu":
        return F.gelu(args[0])
    if fn == "relu":
        return torch.relu(args[0])
    if fn == "dropout":
        return args[0] * args[1] * attrs["scale"]
    raise ValueError(f"unknown pointwise function {fn!r}")


def run_local(op: Op, args: Sequence, p: int, r: int, *, compile: bool = False) -> list[torch.Tensor]:
    """Outputs of a local op on rank ``r`` of ``p`` (args: tensors and scalars in op order)."""
    k = op.kind
    if k == "pointwise":
        return [pointwise(op.attrs["fn"], args, op.attrs)]
    if k == "matmul":
        return [torch.matmul(args[0], args[1])]
    if k == "sum_sq":
        x = args[0]
        return [torch.sum(x * x)]
    if k == "slice":
        x, dim = args[0], op.attrs["dim"]
        lo, hi = shard_bounds(x.shape[dim], p)[r]
        return [x.narrow(dim, lo, hi - lo).clone()]  # never a view: the executor updates states in place
    if k == "narrow":
        return [args[0].narrow(op.attrs["dim"], op.attrs["start"], op.attrs["length"]).clone()]
    if k == "concat":
        return [torch.cat(list(args), op.attrs["dim"])]
    if k == "fused":
        return list(fused_fn(op, p, r, compile=compile)(*args))
    raise ValueError(f"run_local: {op.kind} is not a local op")


def fused_fn(op: Op, p: int, r: int, *, compile: bool = False) -> Callable:
    """One function computing a fused node's exported outputs from its args."""
    body: tuple[Op, ...] = op.attrs["body"]
    names = op.tensor_args
    outs = op.outs

    def run(*vals):
        env = dict(zip(names, vals))
        for inner in body:
            a = [env[x] if isinstance(x, str) else x for x in inner.args]
            for o, v in zip(inner.outs, run_local(inner, a, p, r)):
                env[o] = v
        return tuple(env[o] for o in outs)

    if compile:
        return torch.compile(run, dynamic=False)
    return run


# --------------------------------------------------------------------------------------------
# The ring: summation order and traffic.


def ring_reduce(flats: Sequence[torch.Tensor], bounds: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The sum over ranks of 1-D tensors ``flats``, each chunk added in the ring's order."""
    p = len(flats)
    out = torch.empty_like(flats[0])
    for c, (lo, hi) in enumerate(bounds):
        if hi == lo:
            continue
        acc = flats[(c + 1) % p][lo:hi].clone()
        for j in range(2, p + 1):
            acc = flats[(c + j) % p][lo:hi] + acc
        out[lo:hi] = acc
    return out


def chunks_sent(kind: str, r: int, p: int) -> list[int]:
    """The chunks rank ``r`` sends in a ring ``kind`` (``reduce_scatter``, ``all_gather``,
    ``all_reduce``)."""
    rs = [(r - k - 1) % p for k in range(p - 1)]
    ag = [(r - k) % p for k in range(p - 1)]
    return {"reduce_scatter": rs, "all_gather": ag, "all_reduce": rs + ag}[kind]


def ring_traffic(kind: str, chunk_elems: Sequence[int], itemsize: int, r: int,
                 segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> tuple[int, int]:
    """``(bytes sent, messages sent)`` by rank ``r`` in a ring collective whose chunk ``c`` holds
    ``chunk_elems[c]`` elements."""
    p = len(chunk_elems)
    seg = max(1, segment_bytes // itemsize)
    sent = chunks_sent(kind, r, p)
    nbytes = sum(chunk_elems[c] for c in sent) * itemsize
    msgs = sum(-(-chunk_elems[c] // seg) for c in sent if chunk_elems[c] > 0)
    return nbytes, msgs
