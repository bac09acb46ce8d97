"""A Python builder for communication programs: each op infers and checks its layout at once.

    b = Builder("dp_sgd")
    grad = b.input("grad", (n,), Local())
    w = b.state("w", (n,), Replicated())
    g = b.all_reduce(grad, name="g")
    b.update(w, w - g * lr)
    prog = b.build()

Values support ``+ - * /`` and unary ``-`` with other values and Python scalars.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from virtualflow.plan.comm.ir import Program
from virtualflow.plan.comm.ops import Decl, Info, Layout, Op, Sliced, check_dim, infer_op


class Value:
    """A handle on a tensor of the program being built."""

    __slots__ = ("b", "name")

    def __init__(self, b: "Builder", name: str) -> None:
        self.b = b
        self.name = name

    @property
    def info(self) -> Info:
        return self.b.env[self.name]

    @property
    def layout(self) -> Layout:
        return self.info.layout

    def __add__(self, o): return self.b.add(self, o)
    def __radd__(self, o): return self.b.add(o, self)
    def __sub__(self, o): return self.b.sub(self, o)
    def __rsub__(self, o): return self.b.sub(o, self)
    def __mul__(self, o): return self.b.mul(self, o)
    def __rmul__(self, o): return self.b.mul(o, self)
    def __truediv__(self, o): return self.b.div(self, o)
    def __rtruediv__(self, o): return self.b.div(o, self)
    def __neg__(self): return self.b.neg(self)
    def __matmul__(self, o): return self.b.matmul(self, o)

    def __repr__(self) -> str:
        i = self.info
        return f"Value({self.name}: {i.layout} {i.shape} stage {i.stage})"


Operand = Any  # Value | str | float


class Builder:
    """Builds a :class:`Program` op by op; a broken layout rule raises ``ValueError`` at the op."""

    def __init__(self, name: str = "program") -> None:
        self.name = name
        self.decls: list[Decl] = []
        self.ops: list[Op] = []
        self.outputs: list[str] = []
        self.env: dict[str, Info] = {}
        self._updated: set[str] = set()
        self._n = 0

    # -- declarations ---------------------------------------------------------------------------

    def input(self, name: str, shape: Sequence[int], layout: Layout, *, dtype: torch.dtype = torch.float32,
              stage: int = 0) -> Value:
        return self._declare(Decl(name, tuple(shape), layout, dtype, stage))

    def state(self, name: str, shape: Sequence[int], layout: Layout, *, dtype: torch.dtype = torch.float32,
              stage: int = 0, shardable: bool = False) -> Value:
        """A tensor the program may ``update`` once (weights, optimizer state); ``shardable``: only
        this program reads it, so a rewrite may keep it sliced."""
        return self._declare(Decl(name, tuple(shape), layout, dtype, stage, state=True, shardable=shardable))

    def _declare(self, d: Decl) -> Value:
        if d.name in self.env:
            raise ValueError(f"{self.name}: tensor {d.name} is already defined")
        check_dim(d.name, d.layout, len(d.shape))
        self.decls.append(d)
        self.env[d.name] = Info(d.shape, d.layout, d.dtype, d.stage)
        return Value(self, d.name)

    # -- emission -------------------------------------------------------------------------------

    def _ref(self, x: Operand) -> Any:
        if isinstance(x, Value):
            if x.b is not self:
                raise ValueError(f"{self.name}: {x.name} belongs to another builder ({x.b.name})")
            return x.name
        if isinstance(x, str):
            if x not in self.env:
                raise ValueError(f"{self.name}: no tensor named {x!r}")
            return x
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            return float(x)
        raise ValueError(f"{self.name}: operand {x!r} is neither a program tensor nor a number")

    def _fresh(self, name: str | None) -> str:
        if name is not None:
            if name in self.env:
                raise ValueError(f"{self.name}: tensor {name} is already defined")
            return name
        while True:
            self._n += 1
            cand = f"t{self._n}"
            if cand not in self.env:
                return cand

    def emit(self, kind: str, args: Sequence[Operand], attrs: dict | None = None, name: str | None = None) -> Value:
        op = Op(kind, (self._fresh(name),), tuple(self._ref(a) for a in args), dict(attrs or {}))
        self._check_reads(op)
        (info,) = infer_op(op, self.env, self.name)
        self.ops.append(op)
        self.env[op.out] = info
        return Value(self, op.out)

    # -- pointwise ------------------------------------------------------------------------------

    def _pw(self, fn: str, *args: Operand, name: str | None = None) -> Value:
        return self.emit("pointwise", args, {"fn": fn}, name)

    def add(self, a: Operand, b: Operand, name: str | None = None) -> Value: return self._pw("add", a, b, name=name)
    def sub(self, a: Operand, b: Operand, name: str | None = None) -> Value: return self._pw("sub", a, b, name=name)
    def mul(self, a: Operand, b: Operand, name: str | None = None) -> Value: return self._pw("mul", a, b, name=name)
    def div(self, a: Operand, b: Operand, name: str | None = None) -> Value: return self._pw("div", a, b, name=name)
    def maximum(self, a: Operand, b: Operand, name: str | None = None) -> Value:
        return self._pw("maximum", a, b, name=name)

    def minimum(self, a: Operand, b: Operand, name: str | None = None) -> Value:
        return self._pw("minimum", a, b, name=name)

    def sqrt(self, a: Operand, name: str | None = None) -> Value: return self._pw("sqrt", a, name=name)
    def neg(self, a: Operand, name: str | None = None) -> Value: return self._pw("neg", a, name=name)
    def gelu(self, a: Operand, name: str | None = None) -> Value: return self._pw("gelu", a, name=name)
    def relu(self, a: Operand, name: str | None = None) -> Value: return self._pw("relu", a, name=name)

    def dropout(self, x: Operand, mask: Operand, p: float, name: str | None = None) -> Value:
        """``x * mask / (1 - p)``: the keep-mask (0/1, drawn from an explicit seed by the caller)
        is an input, so every layout of the program drops the same elements."""
        if not 0.0 <= p < 1.0:
            raise ValueError(f"{self.name}: dropout p={p} must be in [0, 1)")
        return self.emit("pointwise", (x, mask), {"fn": "dropout", "scale": 1.0 / (1.0 - p)}, name)

    # -- other local ops ------------------------------------------------------------------------

    def matmul(self, a: Operand, b: Operand, name: str | None = None) -> Value:
        return self.emit("matmul", (a, b), None, name)

    def sum_sq(self, x: Operand, name: str | None = None) -> Value:
        """Sum of squares: Local when ``x`` is Sliced (a partial sum: all_reduce it)."""
        return self.emit("sum_sq", (x,), None, name)

    def l2_norm(self, x: Operand, name: str | None = None) -> Value:
        """``sqrt(sum of squares)``, with the all_reduce a sliced ``x`` needs."""
        s = self.sum_sq(x)
        if isinstance(self.env[self._ref(x)].layout, Sliced):
            s = self.all_reduce(s)
        return self.sqrt(s, name=name)

    def slice(self, x: Operand, dim: int, name: str | None = None) -> Value:
        """Replicated -> Sliced(dim): each rank keeps its piece (no communication)."""
        return self.emit("slice", (x,), {"dim": dim}, name)

    def narrow(self, x: Operand, dim: int, start: int, length: int, name: str | None = None) -> Value:
        return self.emit("narrow", (x,), {"dim": dim, "start": start, "length": length}, name)

    def concat(self, parts: Sequence[Operand], dim: int, name: str | None = None) -> Value:
        return self.emit("concat", tuple(parts), {"dim": dim}, name)

    # -- communication --------------------------------------------------------------------------

    def all_reduce(self, x: Operand, name: str | None = None) -> Value:
        """Local -> Replicated (sum over ranks)."""
        return self.emit("all_reduce", (x,), None, name)

    def reduce_scatter(self, x: Operand, dim: int = 0, name: str | None = None) -> Value:
        """Local -> Sliced(dim): rank r gets piece r of the sum."""
        return self.emit("reduce_scatter", (x,), {"dims": (dim,)}, name)

    def all_gather(self, x: Operand, dim: int = 0, name: str | None = None) -> Value:
        """Sliced(dim) -> Replicated."""
        return self.emit("all_gather", (x,), {"dims": (dim,)}, name)

    def broadcast(self, x: Operand, src: int = 0, name: str | None = None) -> Value:
        """Local -> Replicated: every rank gets rank ``src``'s value."""
        if src < 0:
            raise ValueError(f"{self.name}: broadcast src={src} must be a rank (>= 0)")
        return self.emit("broadcast", (x,), {"src": src}, name)

    def send(self, x: Operand, stage: int, name: str | None = None) -> Value:
        """Move ``x`` to stage ``stage``: rank r of its stage sends its piece to rank r of ``stage``."""
        return self.emit("send", (x,), {"stage": stage}, name)

    # -- state and outputs ----------------------------------------------------------------------

    def update(self, target: Operand, value: Operand) -> None:
        """Give state ``target`` its new value (once; no op may read ``target`` afterwards)."""
        t, v = self._ref(target), self._ref(value)
        if not any(d.name == t and d.state for d in self.decls):
            raise ValueError(f"{self.name}: update({t}): {t} is not a declared state; declare it with state(...)")
        if t in self._updated:
            raise ValueError(f"{self.name}: state {t} is updated twice; update it once with the final value")
        op = Op("update", (), (t, v), {})
        self._check_reads(Op("update", (), (v,), {}))
        infer_op(op, self.env, self.name)
        self._updated.add(t)
        self.ops.append(op)

    def _check_reads(self, op: Op) -> None:
        for a in op.tensor_args:
            if a in self._updated:
                raise ValueError(f"{self.name}: `{op.label()}` reads state {a} after its update; read the new value "
                                 f"(the update's argument) instead")

    def output(self, *values: Operand) -> None:
        for v in values:
            self.outputs.append(self._ref(v))

    def build(self) -> Program:
        return Program(tuple(self.decls), tuple(self.ops), tuple(self.outputs), self.name)
