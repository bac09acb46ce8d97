"""The pieces communication programs are made of (pure): layouts (:class:`Local`,
:class:`Replicated`, :class:`Sliced`), declarations (:class:`Decl`), ops (:class:`Op`), what
inference knows of a tensor (:class:`Info`), the shapes of the ranks' pieces, and the layout rules
of one op (:func:`infer_op`).

:mod:`virtualflow.plan.comm.ir` builds :class:`~virtualflow.plan.comm.ir.Program` on these (and
documents the model: layouts, stages, state); every other module of ``plan/comm`` that needs only
the pieces imports them from here, so the ledger and a program's text
(:mod:`virtualflow.plan.comm.ledger`), which ``Program.explain`` uses, sit below ``Program``.
Invariant: nothing here knows a whole program; a violated rule raises ``ValueError`` naming the
op, the tensor, its layout, the rule and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence, Union

import torch

# --------------------------------------------------------------------------------------------
# Layouts.


@dataclass(frozen=True, slots=True)
class Local:
    """Each rank holds its own value (same global shape on every rank)."""

    def __str__(self) -> str:
        return "Local"


@dataclass(frozen=True, slots=True)
class Replicated:
    """Every rank holds the same value."""

    def __str__(self) -> str:
        return "Replicated"


@dataclass(frozen=True, slots=True)
class Sliced:
    """Rank ``r`` holds piece ``r`` of ``shard_bounds(shape[dim], p)`` along ``dim``."""

    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or self.dim < 0:
            raise ValueError(f"Sliced(dim={self.dim!r}): dim must be a non-negative int (count from the front)")

    def __str__(self) -> str:
        return f"Sliced({self.dim})"


Layout = Union[Local, Replicated, Sliced]

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
POINTWISE = {  # name -> number of operands (tensor or scalar)
    "add": 2, "sub": 2, "mul": 2, "div": 2, "maximum": 2, "minimum": 2, "sqrt": 1, "neg": 1, "gelu": 1,
    "relu": 1, "dropout": 2,
}
LOCAL_KINDS = ("pointwise", "matmul", "sum_sq", "slice", "narrow", "concat", "fused")
"""Ops that need no communication."""
FUSABLE = ("pointwise", "slice")


# --------------------------------------------------------------------------------------------
# Declarations, ops, inferred facts.


@dataclass(frozen=True, slots=True)
class Decl:
    """A tensor the program reads: an input, or a state the program may ``update``."""

    name: str
    shape: tuple[int, ...]
    layout: Layout
    dtype: torch.dtype = torch.float32
    stage: int = 0
    state: bool = False
    shardable: bool = False
    """Only this program reads the state, so a rewrite may store it sliced (memory / p)."""

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"tensor name {self.name!r} must be an identifier")
        if any((not isinstance(s, int)) or s < 0 for s in self.shape):
            raise ValueError(f"tensor {self.name}: shape {self.shape} must be non-negative ints")
        if self.shardable and not self.state:
            raise ValueError(f"tensor {self.name}: shardable=True applies to a state (state=True) only")
        if self.stage < 0:
            raise ValueError(f"tensor {self.name}: stage={self.stage} must be non-negative")
        check_dim(self.name, self.layout, len(self.shape))


@dataclass(frozen=True, slots=True)
class Info:
    """What inference knows about a tensor."""

    shape: tuple[int, ...]
    layout: Layout
    dtype: torch.dtype
    stage: int


@dataclass(frozen=True)
class Op:
    """One operation. ``args`` are tensor names (str) or Python scalars (float); ``outs`` the names
    it defines (empty for ``update``). Collectives may carry several args (a bucket: one
    collective on their concatenation), one out per arg."""

    kind: str
    outs: tuple[str, ...]
    args: tuple[Any, ...]
    attrs: dict = field(default_factory=dict)

    @property
    def out(self) -> str:
        return self.outs[0]

    @property
    def tensor_args(self) -> tuple[str, ...]:
        return tuple(a for a in self.args if isinstance(a, str))

    def label(self) -> str:
        """How errors and explain name the op."""
        if self.kind == "update":
            return f"update({self.args[0]})"
        extra = ""
        if self.kind == "pointwise":
            extra = f"[{self.attrs['fn']}]"
        elif "dims" in self.attrs:
            extra = f"[dim={','.join(map(str, self.attrs['dims']))}]"
        elif self.kind == "broadcast":
            extra = f"[src={self.attrs['src']}]"
        elif self.kind == "send":
            extra = f"[->stage {self.attrs['stage']}]"
        elif self.kind == "fused":
            extra = f"[{len(self.attrs['body'])} ops]"
        elif self.kind in ("slice", "narrow", "concat"):
            extra = f"[dim={self.attrs['dim']}]"
        return f"{','.join(self.outs)} = {self.kind}{extra}({', '.join(map(_fmt_arg, self.args))})"


def _fmt_arg(a: Any) -> str:
    return a if isinstance(a, str) else f"{a:g}"


def check_dim(name: str, layout: Layout, ndim: int) -> None:
    """Raise ``ValueError`` unless ``layout`` is a layout that a tensor of ``ndim`` dims can have."""
    if not isinstance(layout, (Local, Replicated, Sliced)):
        raise ValueError(f"tensor {name}: layout {layout!r} is not Local(), Replicated() or Sliced(dim)")
    if isinstance(layout, Sliced) and layout.dim >= ndim:
        raise ValueError(f"tensor {name}: layout {layout} needs a tensor with more than {layout.dim} dims, "
                         f"it has {ndim}")


# --------------------------------------------------------------------------------------------
# Shapes of pieces.


def piece_bounds(shape: Sequence[int], layout: Layout, p: int, r: int) -> tuple[int, int] | None:
    """``(lo, hi)`` along the sliced dim of rank ``r``'s piece, or None for a whole tensor."""
    if isinstance(layout, Sliced):
        from virtualflow.plan.shards import shard_bounds
        return shard_bounds(shape[layout.dim], p)[r]
    return None


def piece_shape(shape: Sequence[int], layout: Layout, p: int, r: int) -> tuple[int, ...]:
    """The shape rank ``r`` holds."""
    b = piece_bounds(shape, layout, p, r)
    if b is None:
        return tuple(shape)
    out = list(shape)
    out[layout.dim] = b[1] - b[0]
    return tuple(out)


def numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# --------------------------------------------------------------------------------------------
# Inference, op by op.


def _need(env: dict[str, Info], name: Any, op: Op, where: str) -> Info:
    if not isinstance(name, str):
        raise ValueError(f"{where}: `{op.label()}` needs a tensor, got the scalar {name!r}")
    if name not in env:
        raise ValueError(f"{where}: `{op.label()}` reads {name}, which is not defined before it")
    return env[name]


def _one_stage(infos: Sequence[tuple[str, Info]], op: Op, where: str) -> int:
    stages = {i.stage for _, i in infos}
    if len(stages) > 1:
        desc = ", ".join(f"{n} on stage {i.stage}" for n, i in infos)
        raise ValueError(f"{where}: `{op.label()}` mixes stages ({desc}); send the tensor to one stage first")
    return stages.pop() if stages else 0


def infer_op(op: Op, env: dict[str, Info], where: str = "program") -> list[Info]:
    """The :class:`Info` of each of ``op``'s outputs (``[]`` for ``update``)."""
    k = op.kind
    ins = [(a, _need(env, a, op, where)) for a in op.tensor_args]
    stage = _one_stage(ins, op, where)
    if k == "pointwise":
        return [_pointwise(op, ins, stage, where)]
    if k == "fused":
        sub = dict(env)
        for inner in op.attrs["body"]:
            for name, info in zip(inner.outs, infer_op(inner, sub, where)):
                sub[name] = info
        return [sub[o] for o in op.outs]
    if k == "matmul":
        return [_matmul(op, ins, stage, where)]
    if k == "sum_sq":
        (a, x), = ins
        lay = Replicated() if isinstance(x.layout, Replicated) else Local()
        return [Info((), lay, x.dtype, stage)]
    if k == "slice":
        (a, x), = ins
        dim = op.attrs["dim"]
        if not isinstance(x.layout, Replicated):
            raise ValueError(f"{where}: `{op.label()}`: slice takes a Replicated tensor (each rank keeps its piece, "
                             f"no communication); {a} is {x.layout}"
                             + ("; reduce_scatter it instead" if isinstance(x.layout, Local) else ""))
        check_dim(a, Sliced(dim), len(x.shape))
        return [Info(x.shape, Sliced(dim), x.dtype, stage)]
    if k == "narrow":
        (a, x), = ins
        dim, start, length = op.attrs["dim"], op.attrs["start"], op.attrs["length"]
        if dim >= len(x.shape) or start < 0 or length < 0 or start + length > x.shape[dim]:
            raise ValueError(f"{where}: `{op.label()}`: [{start}, {start + length}) along dim {dim} is outside "
                             f"{a}'s shape {x.shape}")
        if isinstance(x.layout, Sliced) and x.layout.dim == dim:
            raise ValueError(f"{where}: `{op.label()}`: {a} is {x.layout}; narrowing its sliced dim would cut "
                             f"across ranks; narrow another dim")
        shape = list(x.shape)
        shape[dim] = length
        return [Info(tuple(shape), x.layout, x.dtype, stage)]
    if k == "concat":
        dim = op.attrs["dim"]
        first = ins[0][1]
        for a, x in ins:
            if x.layout != first.layout or x.dtype != first.dtype or len(x.shape) != len(first.shape) or any(
                    s != t for j, (s, t) in enumerate(zip(x.shape, first.shape)) if j != dim):
                raise ValueError(f"{where}: `{op.label()}`: parts must share layout, dtype and shape except along "
                                 f"dim {dim}; {a} is {x.layout} {x.shape}, {ins[0][0]} is {first.layout} {first.shape}")
        if isinstance(first.layout, Sliced) and first.layout.dim == dim:
            raise ValueError(f"{where}: `{op.label()}`: parts are {first.layout}; concatenating along the sliced "
                             f"dim would interleave ranks' pieces; concatenate along another dim")
        shape = list(first.shape)
        shape[dim] = sum(x.shape[dim] for _, x in ins)
        return [Info(tuple(shape), first.layout, first.dtype, stage)]
    if k in ("all_reduce", "reduce_scatter", "all_gather", "broadcast"):
        if len(op.outs) != len(ins) or not ins:
            raise ValueError(f"{where}: `{op.label()}`: a collective has one out per tensor arg")
        if len({x.dtype for _, x in ins}) > 1:
            raise ValueError(f"{where}: `{op.label()}`: a bucket holds one dtype, got "
                             f"{sorted({str(x.dtype) for _, x in ins})}")
        dims = op.attrs.get("dims", (None,) * len(ins))
        if len(dims) != len(ins):
            raise ValueError(f"{where}: `{op.label()}`: one dim per tensor arg, got dims={dims}")
        return [_collective(op, a, x, d, stage, where) for (a, x), d in zip(ins, dims)]
    if k == "send":
        (a, x), = ins
        dst = op.attrs["stage"]
        if dst == x.stage or dst < 0:
            raise ValueError(f"{where}: `{op.label()}`: {a} is on stage {x.stage}; send it to another stage")
        return [Info(x.shape, x.layout, x.dtype, dst)]
    if k == "update":
        (t, target), (v, value) = ins
        if target.shape != value.shape or target.dtype != value.dtype:
            raise ValueError(f"{where}: `{op.label()}`: new value {v} is {value.shape} {value.dtype}, state {t} is "
                             f"{target.shape} {target.dtype}")
        if target.layout != value.layout:
            fix = {("Replicated", "Local"): "all_reduce (or broadcast) the value first",
                   ("Replicated", "Sliced"): "all_gather the value first",
                   ("Sliced", "Replicated"): "slice the value first"}.get(
                (type(target.layout).__name__, type(value.layout).__name__), "make the layouts equal")
            raise ValueError(f"{where}: `{op.label()}`: state {t} is {target.layout} but its new value {v} is "
                             f"{value.layout}; an update keeps the state's layout: {fix}")
        return []
    raise ValueError(f"{where}: unknown op kind {k!r} in `{op.label()}`")


def _pointwise(op: Op, ins: list[tuple[str, Info]], stage: int, where: str) -> Info:
    fn = op.attrs["fn"]
    if fn not in POINTWISE:
        raise ValueError(f"{where}: `{op.label()}`: unknown pointwise function {fn!r}; one of {sorted(POINTWISE)}")
    if len(op.args) != POINTWISE[fn]:
        raise ValueError(f"{where}: `{op.label()}`: {fn} takes {POINTWISE[fn]} operands, got {len(op.args)}")
    if not ins:
        raise ValueError(f"{where}: `{op.label()}`: a pointwise op needs at least one tensor operand")
    if fn == "dropout" and not all(isinstance(a, str) for a in op.args):
        raise ValueError(f"{where}: `{op.label()}`: dropout takes a tensor and its mask tensor")
    try:
        shape = tuple(torch.broadcast_shapes(*[x.shape for _, x in ins]))
    except RuntimeError as exc:
        desc = ", ".join(f"{a} {x.shape}" for a, x in ins)
        raise ValueError(f"{where}: `{op.label()}`: shapes do not broadcast ({desc})") from exc
    dtypes = {x.dtype for _, x in ins}
    if len(dtypes) > 1:
        raise ValueError(f"{where}: `{op.label()}`: mixed dtypes {sorted(map(str, dtypes))}; cast first")
    n = len(shape)
    local = [a for a, x in ins if isinstance(x.layout, Local)]
    sliced = [(a, x, x.layout.dim + n - len(x.shape)) for a, x in ins if isinstance(x.layout, Sliced)]
    if local and sliced:
        a, x, _ = sliced[0]
        raise ValueError(f"{where}: `{op.label()}`: {local[0]} is Local but {a} is {x.layout}; a pointwise op "
                         f"needs matching layouts: reduce_scatter {local[0]} (or all_gather {a} and reduce "
                         f"{local[0]}) first")
    if sliced:
        a0, x0, d = sliced[0]
        for a, x, dd in sliced[1:]:
            if dd != d or x.shape[x.layout.dim] != shape[d]:
                raise ValueError(f"{where}: `{op.label()}`: {a0} is {x0.layout} {x0.shape} and {a} is {x.layout} "
                                 f"{x.shape}: they are sliced along different dims of the result; slice both "
                                 f"along the same dim")
        if x0.shape[x0.layout.dim] != shape[d]:
            raise ValueError(f"{where}: `{op.label()}`: {a0} is {x0.layout} but broadcast along its sliced dim")
        for a, x in ins:
            if isinstance(x.layout, Replicated):
                j = d - (n - len(x.shape))
                if j >= 0 and x.shape[j] != 1:
                    raise ValueError(f"{where}: `{op.label()}`: {a} is Replicated {x.shape} but {a0} is {x0.layout}; "
                                     f"a pointwise op on a slice needs the slice of every full operand: "
                                     f"slice({a}, dim={j}) first")
        return Info(shape, Sliced(d), ins[0][1].dtype, stage)
    return Info(shape, Local() if local else Replicated(), ins[0][1].dtype, stage)


def _matmul(op: Op, ins: list[tuple[str, Info]], stage: int, where: str) -> Info:
    if len(ins) != 2:
        raise ValueError(f"{where}: `{op.label()}`: matmul takes two tensors")
    (an, a), (bn, b) = ins
    if len(b.shape) != 2 or len(a.shape) < 1 or a.shape[-1] != b.shape[0]:
        raise ValueError(f"{where}: `{op.label()}`: shapes {an} {a.shape} @ {bn} {b.shape} do not multiply "
                         f"(b must be 2-D with b.shape[0] == a.shape[-1])")
    if a.dtype != b.dtype:
        raise ValueError(f"{where}: `{op.label()}`: mixed dtypes {a.dtype} and {b.dtype}")
    shape = tuple(a.shape[:-1]) + (b.shape[1],)
    last = len(a.shape) - 1
    la, lb = a.layout, b.layout
    R, L = Replicated, Local
    if isinstance(la, R) and isinstance(lb, R):
        lay: Layout = R()
    elif isinstance(la, (R, L)) and isinstance(lb, (R, L)):
        lay = L()
    elif isinstance(la, R) and lb == Sliced(1):
        lay = Sliced(len(shape) - 1)  # column parallel
    elif la == Sliced(last) and lb == Sliced(0):
        lay = L()  # row parallel: partial sums, reduce them
    elif isinstance(la, Sliced) and la.dim < last and isinstance(lb, R):
        lay = la  # rows of a sliced: rows of the result sliced
    else:
        raise ValueError(
            f"{where}: `{op.label()}`: no matmul rule for {an} {la} @ {bn} {lb}; legal: Replicated @ Replicated "
            f"-> Replicated, Replicated @ Sliced(1) -> Sliced(last) (column parallel), Sliced(last) @ Sliced(0) -> "
            f"Local partial sums (row parallel; reduce them), Sliced(d<last) @ Replicated -> Sliced(d), Local with "
            f"Local/Replicated -> Local; all_gather or slice an operand to reach one of them")
    return Info(shape, lay, a.dtype, stage)


def _collective(op: Op, a: str, x: Info, dim: int | None, stage: int, where: str) -> Info:
    k = op.kind
    if k in ("all_reduce", "reduce_scatter", "broadcast") and not isinstance(x.layout, Local):
        fix = ("it is already the same on every rank; summing would multiply it by p"
               if isinstance(x.layout, Replicated) else "all_gather it to make it Replicated")
        raise ValueError(f"{where}: `{op.label()}`: {k} takes a Local tensor, {a} is {x.layout}: {fix}")
    if k == "all_reduce":
        return Info(x.shape, Replicated(), x.dtype, stage)
    if k == "broadcast":
        return Info(x.shape, Replicated(), x.dtype, stage)
    if dim is None or dim >= len(x.shape):
        raise ValueError(f"{where}: `{op.label()}`: dim={dim} is not a dim of {a} {x.shape}"
                         + ("; a 0-d tensor cannot be sliced: all_reduce it" if not x.shape else ""))
    if k == "reduce_scatter":
        return Info(x.shape, Sliced(dim), x.dtype, stage)
    if x.layout != Sliced(dim):
        raise ValueError(f"{where}: `{op.label()}`: all_gather along dim {dim} takes a Sliced({dim}) tensor, "
                         f"{a} is {x.layout}")
    return Info(x.shape, Replicated(), x.dtype, stage)
