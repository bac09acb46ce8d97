"""Communication programs: named tensors with layouts, collectives and local computation (pure).

A :class:`Program` is a straight-line list of :class:`Op` over named tensors, run by every rank of
a group of ``p`` ranks (or by the ranks of several *stages*, see below). Every tensor has a
*global* shape and a *layout* that says what each rank holds:

* :class:`Local` -- each rank its own value of the global shape (a gradient before its reduction,
  the partial sums of a row-parallel matmul);
* :class:`Replicated` -- the same value on every rank;
* :class:`Sliced` ``(dim)`` -- rank ``r`` holds the ``r``-th contiguous piece along ``dim``, the
  pieces cut by :func:`virtualflow.plan.shards.shard_bounds` ``(shape[dim], p)``.

Layouts are inferred op by op and checked (:func:`infer_op`); a violation raises ``ValueError``
naming the op, the tensor, its layout, the rule and the fix. A :class:`Program` validates itself
when it is built, so every program (a rewrite's output included) is well formed.

Stages: a pipeline boundary is modelled as several groups of the same size ``p`` (one per stage,
``stages * p`` ranks in all; global rank ``stage * p + r``). Every tensor lives on one stage;
ops run on the stage of their inputs, collectives within that stage's group, and ``send`` moves a
tensor to another stage, rank ``r`` of one stage to rank ``r`` of the other, layout unchanged.

State: tensors declared with ``state=True`` (weights, optimizer state) may be given a new value
by ``update`` once, after which no op reads them; outputs of a program are its ``outputs`` and
the final values of its states. ``shardable=True`` says only this program reads a state, so a
rewrite may store it sliced (optimizer moments, not the weights the forward pass reads).

This module holds :class:`Program` and whole-program inference; the pieces (layouts, ``Decl``,
``Op``, ``Info``, piece shapes, per-op rules) live in :mod:`virtualflow.plan.comm.ops` and are
re-exported here, and a program's text and ledgers in :mod:`virtualflow.plan.comm.ledger` (below
``Program``, which only calls it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from virtualflow.plan.comm.ledger import explain as explain_program
from virtualflow.plan.comm.ops import (  # noqa: F401 - re-exported: the IR's pieces, defined below Program
    COLLECTIVES, FUSABLE, LOCAL_KINDS, POINTWISE, Decl, Info, Layout, Local, Op, Replicated, Sliced, check_dim,
    infer_op, numel, piece_bounds, piece_shape,
)

@dataclass(frozen=True)
class Program:
    """A validated program: declarations, ops in execution order, named outputs."""

    decls: tuple[Decl, ...]
    ops: tuple[Op, ...]
    outputs: tuple[str, ...] = ()
    name: str = "program"
    info: dict = field(init=False, repr=False, compare=False)
    """Every tensor's inferred :class:`Info` (filled by validation)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "info", infer(self))

    def decl(self, name: str) -> Decl:
        for d in self.decls:
            if d.name == name:
                return d
        raise ValueError(f"program {self.name}: no declared tensor {name!r}")

    @property
    def states(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.decls if d.state)

    @property
    def stages(self) -> int:
        return 1 + max([i.stage for i in self.info.values()], default=0)

    def producer(self, name: str) -> Op:
        for op in self.ops:
            if name in op.outs:
                return op
        known = ", ".join(o for op in self.ops for o in op.outs)
        raise ValueError(f"program {self.name}: no op produces {name!r} (ops produce: {known})")

    def consumers(self, name: str) -> list[Op]:
        return [op for op in self.ops if name in op.tensor_args]

    def layout(self, name: str) -> Layout:
        return self.info[name].layout

    def explain(self, ranks: int) -> str:
        """The program as text on ``ranks`` ranks per stage (:func:`virtualflow.plan.comm.ledger.explain`)."""
        return explain_program(self, ranks)




def infer(prog: Program) -> dict[str, Info]:
    """Every tensor's :class:`Info`; raises ``ValueError`` on the first rule a program breaks."""
    env: dict[str, Info] = {}
    states: dict[str, Decl] = {}
    for d in prog.decls:
        if d.name in env:
            raise ValueError(f"program {prog.name}: tensor {d.name} is declared twice")
        env[d.name] = Info(tuple(d.shape), d.layout, d.dtype, d.stage)
        if d.state:
            states[d.name] = d
    updated: dict[str, int] = {}
    for i, op in enumerate(prog.ops):
        for a in op.tensor_args:
            if a in updated:
                raise ValueError(f"program {prog.name}: op {i} `{op.label()}` reads state {a} after its update at "
                                 f"op {updated[a]}; read the new value (the update's argument) instead")
        if op.kind == "update":
            target = op.args[0]
            if target not in states:
                raise ValueError(f"program {prog.name}: `{op.label()}`: {target} is not a declared state; "
                                 f"declare it with state(...)")
            if target in updated:
                raise ValueError(f"program {prog.name}: state {target} is updated twice (ops {updated[target]} "
                                 f"and {i}); update it once with the final value")
            updated[target] = i
        for name, info in zip(op.outs, infer_op(op, env, prog.name)):
            if name in env:
                raise ValueError(f"program {prog.name}: op {i} `{op.label()}` redefines {name}; names are "
                                 f"defined once")
            env[name] = info
    for name in prog.outputs:
        if name not in env:
            raise ValueError(f"program {prog.name}: output {name} is not defined by any op or declaration")
    return env
