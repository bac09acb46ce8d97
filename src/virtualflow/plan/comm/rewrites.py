"""Rewrites of communication programs: each a pure ``Program -> Program`` function.

Each checks that it applies (raising ``ValueError`` naming the op, the rule and what to do
otherwise) and returns a new :class:`Program`, which validates itself, so a rewrite can never
produce a program whose layouts do not check. Tensor names a program exports (its outputs, the
states) keep their meaning; new tensors get fresh names derived from the ones they replace.

* :func:`split`: ``all_reduce`` -> ``reduce_scatter`` + ``all_gather`` (same bytes, two halves).
* :func:`reorder`: pointwise ops and updates that consume an all-gather's output run on the
  slices before it; replicated operands are sliced locally; a *shardable* state updated from a
  slice is stored sliced (memory / p); a sum of squares becomes the slices' partial sums and a
  scalar all-reduce; values still needed whole are all-gathered where first used.
* :func:`fuse`: independent collectives of one kind, stage and dtype -> one bucketed collective
  on their concatenation (ops that depend on them wait after it); runs of consecutive pointwise
  ops -> one ``fused`` node (intermediates never materialised as program tensors).
* :func:`overlap`: a matmul feeding a collective is cut into ``chunks`` pieces along a dim the
  collective does not slice; each piece's collective is issued while the next piece computes.
  The only rewrite that changes a matmul's shape: BLAS picks kernels by shape, so the result is
  within float tolerance of the original (bit-identical on some CPUs, not on others), and
  bit-identical on every CPU to :func:`overlap_reference` (the same matmul cut the same way).
* :func:`boundary`: a Replicated tensor sent to another stage is sent as slices (each rank 1/t)
  and all-gathered on the receiving stage; an all-reduce or all-gather in front of the send
  becomes a reduce-scatter, or moves behind it.

:func:`apply` runs a comma-separated list of them with their default targets (the CLI's form).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Sequence

from virtualflow.plan.comm.ir import (
    FUSABLE, Decl, Op, Program, Replicated, Sliced, numel,
)
from virtualflow.plan.shards import shard_bounds

REWRITES = ("split", "reorder", "fuse", "overlap", "boundary")


class _Names:
    """Fresh names: ``base``, else ``base_2``, ``base_3``..."""

    def __init__(self, prog: Program) -> None:
        self.used = set(prog.info)

    def __call__(self, base: str) -> str:
        name, i = base, 1
        while name in self.used:
            i += 1
            name = f"{base}_{i}"
        self.used.add(name)
        return name


def _program(prog: Program, ops: Iterable[Op], decls: Sequence[Decl] | None = None) -> Program:
    return Program(tuple(decls if decls is not None else prog.decls), tuple(ops), prog.outputs, prog.name)


def _producer_or_none(prog: Program, name: str) -> Op | None:
    for op in prog.ops:
        if name in op.outs:
            return op
    return None


# --------------------------------------------------------------------------------------------
# split


def split(prog: Program, name: str | None = None, dim: int = 0) -> Program:
    """Replace the all-reduce producing ``name`` by a reduce-scatter along ``dim`` and an
    all-gather (``name=None``: every all-reduce of a tensor with at least ``dim + 1`` dims)."""
    if name is None:
        targets = [op.out for op in prog.ops if op.kind == "all_reduce" and len(op.outs) == 1
                   and len(prog.info[op.out].shape) > dim]
        if not targets:
            raise ValueError(f"split: program {prog.name} has no unbucketed all_reduce of a tensor with a dim {dim}")
        for t in targets:
            prog = split(prog, t, dim)
        return prog
    op = prog.producer(name)
    if op.kind != "all_reduce":
        raise ValueError(f"split({name}): {name} is produced by `{op.label()}`; split applies to an all_reduce")
    if len(op.outs) != 1:
        raise ValueError(f"split({name}): `{op.label()}` is a bucket of {len(op.outs)} tensors; split before fuse")
    shape = prog.info[name].shape
    if dim >= len(shape):
        raise ValueError(f"split({name}): {name} has shape {shape}, no dim {dim} to scatter along"
                         + ("; a 0-d tensor cannot be split, keep its all_reduce" if not shape else ""))
    fresh = _Names(prog)
    sl = fresh(f"{name}_slice")
    ops: list[Op] = []
    for o in prog.ops:
        if o is op:
            ops.append(Op("reduce_scatter", (sl,), op.args, {"dims": (dim,)}))
            ops.append(Op("all_gather", (name,), (sl,), {"dims": (dim,)}))
        else:
            ops.append(o)
    return _program(prog, ops)


# --------------------------------------------------------------------------------------------
# reorder


def reorder(prog: Program, name: str | None = None) -> Program:
    """Move the pointwise ops and updates that consume all-gather output ``name`` onto its slices
    (``name=None``: every all-gather with such consumers)."""
    if name is None:
        targets = [op.out for op in prog.ops if op.kind == "all_gather" and len(op.outs) == 1]
        done = 0
        for t in targets:
            try:
                prog = reorder(prog, t)
                done += 1
            except _NothingToMove:
                continue
        if not done:
            raise ValueError(f"reorder: no all_gather of program {prog.name} has pointwise consumers to move; "
                             f"split an all_reduce first")
        return prog
    op = prog.producer(name)
    if op.kind != "all_gather" or len(op.outs) != 1:
        raise ValueError(f"reorder({name}): {name} is produced by `{op.label()}`; reorder applies to a single "
                         f"all_gather (split an all_reduce into reduce_scatter + all_gather first)")
    at = prog.ops.index(op)
    info = prog.info
    dim_of: dict[str, int] = {name: op.attrs["dims"][0]}  # full name -> its sliced dim (moved values)
    moved: set[int] = set()
    norms: set[int] = set()  # sums of squares of a moved value: partial sums + a scalar all_reduce
    need_slice: dict[tuple[int, str], int] = {}
    # Pass 1: which pointwise ops can run on slices.
    for j in range(at + 1, len(prog.ops)):
        o = prog.ops[j]
        if o.kind == "sum_sq" and o.args[0] in dim_of:
            norms.add(j)
            continue
        if o.kind != "pointwise" or not any(a in dim_of for a in o.tensor_args):
            continue
        out = info[o.out].shape
        n = len(out)
        aligned = {dim_of[a] + n - len(info[a].shape) for a in o.tensor_args if a in dim_of}
        if len(aligned) != 1:
            continue
        d = aligned.pop()
        if any(info[a].shape[dim_of[a]] != out[d] for a in o.tensor_args if a in dim_of):
            continue  # a moved operand broadcast along its sliced dim
        slices = {}
        for a in o.tensor_args:
            if a in dim_of:
                continue
            if not isinstance(info[a].layout, Replicated):
                break  # a Local or Sliced operand: this op stays after the gather
            jd = d - (n - len(info[a].shape))
            if jd >= 0 and info[a].shape[jd] != 1:
                slices[a] = jd
        else:
            moved.add(j)
            dim_of[o.out] = d
            for a, jd in slices.items():
                need_slice[(j, a)] = jd
    # Pass 1b: a pointwise op on Replicated operands only whose every reader is a moved op that
    # slices it runs on slices too (``m * beta1`` in Adam), so its operands (a state) are read
    # only by moved ops and may be stored sliced. Reverse order: readers come after producers.
    for j in range(len(prog.ops) - 1, at, -1):
        o = prog.ops[j]
        if (j in moved or o.kind != "pointwise" or o.out in prog.outputs
                or not all(isinstance(info[a].layout, Replicated) for a in o.tensor_args)):
            continue
        readers = [k for k, c in enumerate(prog.ops) if o.out in c.tensor_args]
        dims = {need_slice.get((k, o.out)) for k in readers}
        if not readers or len(dims) != 1 or None in dims or not all(k in moved for k in readers):
            continue
        d = dims.pop()
        n = len(info[o.out].shape)
        moved.add(j)
        dim_of[o.out] = d
        for k in readers:
            del need_slice[(k, o.out)]
        for a in o.tensor_args:
            jd = d - (n - len(info[a].shape))
            if jd >= 0 and info[a].shape[jd] != 1:
                need_slice[(j, a)] = jd
    if not moved and not norms:
        raise _NothingToMove(f"reorder({name}): no pointwise op consumes {name} with Replicated operands only "
                             f"(consumers: {[c.label() for c in prog.consumers(name)]}); nothing to move before "
                             f"the all_gather")
    # Pass 2: shardable states updated from a slice and read only by moved ops are stored sliced.
    sharded: dict[str, int] = {}
    for j, o in enumerate(prog.ops):
        if o.kind != "update" or o.args[1] not in dim_of:
            continue
        t = o.args[0]
        d = prog.decl(t)
        readers = [k for k, c in enumerate(prog.ops) if t in c.tensor_args and c.kind != "update"]
        if (d.shardable and isinstance(d.layout, Replicated) and all(k in moved for k in readers)
                and all(need_slice.get((k, t)) == dim_of[o.args[1]] for k in readers)):
            sharded[t] = dim_of[o.args[1]]
    # Pass 3: emit.
    fresh = _Names(prog)
    sl_name: dict[str, str] = {name: op.args[0]}
    gathered: set[str] = set()
    slice_of: dict[tuple[str, int], str] = {}
    ops: list[Op] = list(prog.ops[:at])

    def need_full(a: str) -> None:
        if a in sl_name and a not in gathered:
            ops.append(Op("all_gather", (a,), (sl_name[a],), {"dims": (dim_of[a],)}))
            gathered.add(a)

    for j in range(at + 1, len(prog.ops)):
        o = prog.ops[j]
        if j in moved:
            args = []
            for a in o.args:
                if not isinstance(a, str):
                    args.append(a)
                elif a in sl_name:
                    args.append(sl_name[a])
                elif a in sharded:
                    args.append(a)
                elif (j, a) in need_slice:
                    key = (a, need_slice[(j, a)])
                    if key not in slice_of:
                        slice_of[key] = fresh(f"{a}_slice")
                        ops.append(Op("slice", (slice_of[key],), (a,), {"dim": key[1]}))
                    args.append(slice_of[key])
                else:
                    args.append(a)
            sl_name[o.out] = fresh(f"{o.out}_s")
            ops.append(Op(o.kind, (sl_name[o.out],), tuple(args), dict(o.attrs)))
        elif j in norms:
            part = fresh(f"{o.out}_part")
            ops.append(Op("sum_sq", (part,), (sl_name[o.args[0]],), {}))
            ops.append(Op("all_reduce", (o.out,), (part,), {}))
        elif o.kind == "update" and o.args[0] in sharded:
            ops.append(Op("update", (), (o.args[0], sl_name[o.args[1]]), {}))
        else:
            for a in o.tensor_args:
                need_full(a)
            ops.append(o)
    for a in prog.outputs:
        need_full(a)
    decls = [replace(d, layout=Sliced(sharded[d.name])) if d.name in sharded else d for d in prog.decls]
    return _program(prog, ops, decls)


class _NothingToMove(ValueError):
    pass


# --------------------------------------------------------------------------------------------
# fuse


def fuse(prog: Program, *, pointwise: bool = True, buckets: bool = True,
         bucket_cap_bytes: int | None = None) -> Program:
    """Bucket independent collectives, then fuse runs of consecutive pointwise ops."""
    before = prog
    if buckets:
        prog = _bucket_all(prog, bucket_cap_bytes)
    if pointwise:
        prog = _fuse_pointwise(prog)
    if prog.ops == before.ops:
        raise ValueError(f"fuse: program {prog.name} has no two independent collectives of one kind, stage and "
                         f"dtype and no run of two or more consecutive pointwise ops; nothing to fuse")
    return prog


def _bucket_key(prog: Program, op: Op):
    if op.kind not in ("all_reduce", "reduce_scatter", "all_gather") or op.attrs.get("overlap"):
        return None
    i = prog.info[op.tensor_args[0]]
    return op.kind, i.stage, i.dtype


def _bytes(prog: Program, op: Op) -> int:
    return sum(numel(prog.info[a].shape) for a in op.tensor_args)  # elements; dtype is one per bucket


def _bucket_all(prog: Program, cap_bytes: int | None) -> Program:
    changed = True
    while changed:
        changed = False
        for i, first in enumerate(prog.ops):
            key = _bucket_key(prog, first)
            if key is None:
                continue
            ops = _bucket_from(prog, i, key, cap_bytes)
            if ops is not None:
                prog = _program(prog, ops)
                changed = True
                break
    return prog


def _bucket_from(prog: Program, i: int, key, cap_bytes: int | None) -> list[Op] | None:
    ops = prog.ops
    members = [i]
    tainted: set[str] = set(ops[i].outs)  # outputs of members and of deferred ops
    deferred: list[int] = []
    size = _bytes(prog, ops[i]) * _itemsize(key[2])
    for j in range(i + 1, len(ops)):
        o = ops[j]
        reads = set(o.tensor_args)
        if reads & tainted or (o.kind == "update" and any(o.args[0] in ops[k].tensor_args for k in deferred)):
            deferred.append(j)
            tainted.update(o.outs)
        elif _bucket_key(prog, o) == key:
            extra = _bytes(prog, o) * _itemsize(key[2])
            if cap_bytes is not None and size + extra > cap_bytes:
                break
            members.append(j)
            size += extra
            tainted.update(o.outs)
    if len(members) < 2:
        return None
    last = members[-1]
    mem = [ops[k] for k in members]
    bucket = Op(mem[0].kind, tuple(o for m in mem for o in m.outs), tuple(a for m in mem for a in m.args),
                {"dims": tuple(d for m in mem for d in m.attrs["dims"])} if mem[0].kind != "all_reduce" else {})
    deferred_before = [k for k in deferred if k < last]
    out = [o for k, o in enumerate(ops[:last]) if k not in members and k not in deferred_before]
    out.append(bucket)
    out.extend(ops[k] for k in deferred_before)
    out.extend(ops[last + 1:])
    return out


def _itemsize(dtype) -> int:
    import torch
    return torch.empty((), dtype=dtype).element_size()


def _fuse_pointwise(prog: Program) -> Program:
    ops = list(prog.ops)
    out: list[Op] = []
    j = 0
    while j < len(ops):
        k = j
        while k < len(ops) and ops[k].kind in FUSABLE and prog.info[ops[k].out].stage == prog.info[ops[j].out].stage:
            k += 1
        if k - j < 2:
            out.append(ops[j])
            j += 1
            continue
        run = ops[j:k]
        inside = {o for r in run for o in r.outs}
        later = {a for r in ops[k:] for a in r.tensor_args} | set(prog.outputs)
        exported = tuple(o for r in run for o in r.outs if o in later)
        args: list[str] = []
        for r in run:
            for a in r.tensor_args:
                if a not in inside and a not in args:
                    args.append(a)
        if exported:
            out.append(Op("fused", exported, tuple(args), {"body": tuple(run)}))
        j = k
    return _program(prog, out)


# --------------------------------------------------------------------------------------------
# overlap


def overlap(prog: Program, name: str | None = None, chunks: int = 2, dim: int | None = None) -> Program:
    """Cut the matmul producing ``name`` (consumed only by an all_reduce or reduce_scatter) into
    ``chunks`` pieces along output dim ``dim`` (0: rows of the left operand; last: columns of the
    right one; default: rows unless the collective scatters along them), one collective each, then
    concatenate (``name=None``: every such matmul).

    Result: the pieces' matmuls need not give the bits of the whole one (BLAS picks kernels by
    shape: MKL's AVX-512 path happens to keep them for the shipped ``tp_mlp`` but not for larger
    sizes, its AVX2 path does not, nor does an AMD EPYC), so the program agrees with the original
    within float tolerance (``tests/e2e/test_comm_program.py``: 1e-6; docs/coconet.md has the measured
    differences). Cutting columns keeps each element's ring chunk, so the result is bit-identical
    to :func:`overlap_reference` (the original with the matmul computed in the same pieces);
    cutting rows under an all-reduce moves elements between the ring's flat chunks (bit-identical
    to it only on 2 ranks, where ``a + b == b + a``)."""
    if name is None:
        targets = [op.out for op in prog.ops if op.kind == "matmul" and _overlap_consumer(prog, op.out) is not None]
        if not targets:
            raise ValueError(f"overlap: no matmul of program {prog.name} feeds only an all_reduce or reduce_scatter")
        for t in targets:
            prog = overlap(prog, t, chunks, dim)
        return prog
    op = prog.producer(name)
    if op.kind != "matmul":
        raise ValueError(f"overlap({name}): {name} is produced by `{op.label()}`; overlap chunks a matmul")
    coll = _overlap_consumer(prog, name)
    if coll is None:
        raise ValueError(f"overlap({name}): {name} must be read by exactly one op, an unbucketed all_reduce or "
                         f"reduce_scatter; its readers are {[c.label() for c in prog.consumers(name)]}")
    if chunks < 2:
        raise ValueError(f"overlap({name}): chunks={chunks} must be at least 2")
    a, b = op.args
    ia, ib, io = prog.info[a], prog.info[b], prog.info[name]
    last = len(io.shape) - 1
    scatter = coll.attrs["dims"][0] if coll.kind == "reduce_scatter" else None

    def legal(d: int) -> str | None:
        if d == scatter:
            return f"the {coll.kind} scatters along dim {d}"
        if d == last:
            return f"{b} is {ib.layout}: its columns are cut across ranks" if ib.layout == Sliced(1) else None
        if d == 0 and last >= 1:
            return f"{a} is {ia.layout}: its rows are cut across ranks" if ia.layout == Sliced(0) else None
        return f"dim {d} is neither the rows (0) nor the last dim ({last})"

    if dim is None:
        dim = 0 if last >= 1 and legal(0) is None else last
    why = legal(dim)
    if why is not None:
        raise ValueError(f"overlap({name}): cannot chunk output dim {dim}: {why}; pick "
                         + ("the other dim" if last >= 1 else "a 2-D product"))
    size = io.shape[dim]
    if chunks > size:
        raise ValueError(f"overlap({name}): chunks={chunks} exceeds {name}'s size {size} along dim {dim}")
    fresh = _Names(prog)
    seq: list[Op] = []
    parts: list[str] = []
    for c, (lo, hi) in enumerate(shard_bounds(size, chunks)):
        piece = fresh(f"{a if dim == 0 else b}_c{c}")
        if dim == 0:
            seq.append(Op("narrow", (piece,), (a,), {"dim": 0, "start": lo, "length": hi - lo}))
            mm = (piece, b)
        else:
            seq.append(Op("narrow", (piece,), (b,), {"dim": 1, "start": lo, "length": hi - lo}))
            mm = (a, piece)
        prod = fresh(f"{name}_c{c}")
        seq.append(Op("matmul", (prod,), mm, {}))
        part = fresh(f"{coll.out}_c{c}")
        seq.append(Op(coll.kind, (part,), (prod,), {**coll.attrs, "overlap": True}))
        parts.append(part)
    ops: list[Op] = []
    for o in prog.ops:
        if o is op:
            ops.extend(seq)
        elif o is coll:
            ops.append(Op("concat", (coll.out,), tuple(parts), {"dim": dim}))
        else:
            ops.append(o)
    return _program(prog, ops)


def overlap_reference(before: Program, after: Program) -> Program:
    """``before`` with every matmul that ``after`` (``overlap`` of ``before``) cut computed in the
    same pieces (the same narrow, matmul and concat ops), its collective left whole.

    The program to compare ``after`` with bit for bit: its matmuls have ``after``'s shapes, so the
    same kernels run on every CPU, and with a column cut every element stays in its ring chunk, so
    every sum keeps its order (a row cut under an all-reduce keeps it only on 2 ranks). ``before``
    itself agrees with ``after`` only within float tolerance (see :func:`overlap`)."""
    products = {op.outs[0]: op.args[0] for op in after.ops if op.attrs.get("overlap")}  # chunk result -> product
    if not products:
        raise ValueError(f"overlap_reference: program {after.name} has no overlapped collective; pass the output of "
                         f"overlap(before, ...)")
    ops: list[Op] = []
    for op in after.ops:
        if op.attrs.get("overlap"):
            continue  # the chunk's own collective
        if op.kind == "concat" and op.args and all(a in products for a in op.args):
            coll = before.producer(op.outs[0])  # the collective overlap cut, as it was
            ops.append(Op("concat", (coll.args[0],), tuple(products[a] for a in op.args), op.attrs))
            ops.append(coll)
        else:
            ops.append(op)
    return Program(after.decls, tuple(ops), after.outputs, f"{after.name}-same-cuts")


def _overlap_consumer(prog: Program, name: str) -> Op | None:
    readers = prog.consumers(name)
    if name in prog.outputs or len(readers) != 1:
        return None
    c = readers[0]
    if c.kind in ("all_reduce", "reduce_scatter") and len(c.outs) == 1:
        return c
    return None


# --------------------------------------------------------------------------------------------
# boundary


def boundary(prog: Program, name: str | None = None, dim: int = 0) -> Program:
    """Send the Replicated tensor behind send-output ``name`` as slices along ``dim`` and
    all-gather it on the receiving stage (``name=None``: every send of a Replicated tensor)."""
    if name is None:
        targets = [op.out for op in prog.ops if op.kind == "send" and isinstance(prog.info[op.args[0]].layout, Replicated)]
        if not targets:
            raise ValueError(f"boundary: program {prog.name} sends no Replicated tensor between stages")
        for t in targets:
            prog = boundary(prog, t, dim)
        return prog
    op = prog.producer(name)
    if op.kind != "send":
        raise ValueError(f"boundary({name}): {name} is produced by `{op.label()}`; boundary rewrites a send")
    x = op.args[0]
    xi = prog.info[x]
    if not isinstance(xi.layout, Replicated):
        raise ValueError(f"boundary({name}): {x} is {xi.layout}; a send of a Local or Sliced tensor already sends "
                         f"only each rank's own piece; the rewrite applies to a Replicated one")
    src = _producer_or_none(prog, x)
    only_send = prog.consumers(x) == [op] and x not in prog.outputs
    fresh = _Names(prog)
    sent = fresh(f"{name}_slice")
    pre: list[Op] = []
    drop: Op | None = None
    if src is not None and src.kind == "all_gather" and len(src.outs) == 1:
        dim = src.attrs["dims"][0]
        xs = src.args[0]
        drop = src if only_send else None
    elif src is not None and src.kind == "all_reduce" and len(src.outs) == 1 and only_send:
        if dim >= len(xi.shape):
            raise ValueError(f"boundary({name}): {x} has shape {xi.shape}, no dim {dim}")
        xs = fresh(f"{x}_slice")
        pre.append(Op("reduce_scatter", (xs,), src.args, {"dims": (dim,)}))
        drop = src
    else:
        if dim >= len(xi.shape):
            raise ValueError(f"boundary({name}): {x} has shape {xi.shape}, no dim {dim} to slice")
        xs = fresh(f"{x}_slice")
        pre.append(Op("slice", (xs,), (x,), {"dim": dim}))
    ops: list[Op] = []
    for o in prog.ops:
        if o is drop:
            if src.kind == "all_reduce":
                ops.extend(pre)
            continue
        if o is op:
            if drop is None or src.kind != "all_reduce":
                ops.extend(pre)
            ops.append(Op("send", (sent,), (xs,), dict(op.attrs)))
            ops.append(Op("all_gather", (name,), (sent,), {"dims": (dim,)}))
        else:
            ops.append(o)
    return _program(prog, ops)


# --------------------------------------------------------------------------------------------
# apply


def apply(prog: Program, rewrites: str | Sequence[str], *, chunks: int = 2) -> Program:
    """Run rewrites by name in order, each on its default targets (``"split,reorder,fuse"``)."""
    names = [r.strip() for r in rewrites.split(",")] if isinstance(rewrites, str) else list(rewrites)
    for r in names:
        if not r:
            continue
        if r not in REWRITES:
            raise ValueError(f"unknown rewrite {r!r}; choose from {', '.join(REWRITES)}")
        if r == "overlap":
            prog = overlap(prog, chunks=chunks)
        else:
            prog = {"split": split, "reorder": reorder, "fuse": fuse, "boundary": boundary}[r](prog)
    return prog
