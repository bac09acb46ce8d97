"""Run a communication program (``virtualflow.plan.comm``) on one rank over torch.distributed.

Every rank of a stage runs the same op list (ops of other stages are skipped): local ops through
the same kernels as the p-rank simulator (:mod:`virtualflow.plan.comm.kernels`), collectives
through :class:`virtualflow.comm.ring.Collectives` (on gloo its own ring reduce-scatter and
all-gather over point-to-point messages; NCCL's native ones on CUDA tensors), broadcast through
the group's own broadcast, and ``send`` as ``isend``/``irecv`` between rank ``r`` of one stage and
rank ``r`` of the other over a group of all ``stages * p`` ranks (global rank ``stage * p + r``).

Invariants:

* Asynchrony: every collective and every send/receive is *issued* where the program has it and
  *waited on* only when an op reads its result (or at the end), so an ``overlap``-rewritten
  program computes chunk ``c+1`` while chunk ``c``'s collective is in flight. Collectives run in
  issue order (the ring's FIFO), the same order on every rank.
* Layout of a collective along a dim ``d``: each member is viewed with ``d`` moved to the front
  (``movedim``) and made contiguous, and a bucket packs its members *rank-major* (chunk ``c`` of
  the flat buffer is every member's piece ``c``), so one ring op carries the bucket and every
  element sits in the chunk of the rank that owns it. An all-reduce bucket is a reduce-scatter
  then an all-gather over the per-member ``shard_bounds(numel, p)`` chunks. Hence each element is
  summed in the same order as in the simulator, and every local op runs the simulator's kernel on
  the same shapes: values equal the simulator's bit for bit on gloo, on every CPU. (A rewrite that
  changes a matmul's shape, ``overlap``, is another program: see ``plan/comm/simulate.py``.)
* Ledger: one :class:`OpTraffic` per communicating op with the bytes and messages this rank sent
  (from the ring's own :class:`~virtualflow.comm.ring.Ledger` for collectives; counted at the
  call for sends; the simulator's flat-tree formula for broadcast, whose traffic gloo does not
  report), wall time (issue to done) and exposed wait time. Its bytes equal the simulator's.
* States are updated in place (``copy_`` into this rank's buffer of the state).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from virtualflow.comm.groups import Group
from virtualflow.comm.ring import Collectives, Ledger
from virtualflow.plan.comm.ir import LOCAL_KINDS, Local, Program, Sliced, piece_shape
from virtualflow.plan.comm.kernels import fused_fn, run_local
from virtualflow.plan.shards import shard_bounds

_SEND_TAG = 4096  # send tags: _SEND_TAG + op index (far below the ring's tags, on another group anyway)


@dataclass
class OpTraffic:
    """One communicating op as this rank ran it."""

    op: str
    kind: str
    bytes_sent: int = 0
    messages: int = 0
    wall_s: float = 0.0
    wait_s: float = 0.0
    _entries: list = field(default_factory=list, repr=False)
    _t0: float = field(default=0.0, repr=False)


@dataclass
class ExecResult:
    values: dict[str, torch.Tensor]
    """This rank's values of the program's outputs and states (final) that live on its stage."""
    ledger: list[OpTraffic]

    def bytes_sent(self) -> int:
        return sum(t.bytes_sent for t in self.ledger)

    def messages(self) -> int:
        return sum(t.messages for t in self.ledger)


class _Pending:
    """Issued work whose result some names are waiting for."""

    def __init__(self, handles: list, finish, traffic: OpTraffic | None) -> None:
        self.handles = handles
        self.finish = finish  # () -> dict[name, tensor]
        self.traffic = traffic
        self.result: dict[str, torch.Tensor] | None = None

    def wait(self) -> dict[str, torch.Tensor]:
        if self.result is None:
            t0 = time.perf_counter()
            for h in self.handles:
                if h is not None:
                    h.wait()
            if self.traffic is not None and not self.traffic._entries:  # p2p: we time it
                self.traffic.wait_s += time.perf_counter() - t0
                self.traffic.wall_s = time.perf_counter() - self.traffic._t0
            self.result = self.finish()
        return self.result


def execute(prog: Program, inputs: Mapping[str, object], group: Group, *, stage: int = 0,
            p2p: Group | None = None, collectives: Collectives | None = None,
            compile_fused: bool = False, trace: list | None = None) -> ExecResult:
    """Run ``prog`` as rank ``group.rank`` of stage ``stage``.

    ``inputs``: each declared tensor of this stage by its global value (as for the simulator; a
    Local one: this rank's tensor, or the sequence of all ranks' from which this rank's is taken).
    ``group``: this stage's group (``p`` ranks). ``p2p``: a group of all ``stages * p`` ranks
    (needed when the program sends). ``collectives``: reuse one (its ledger keeps growing);
    default: a fresh one, closed at the end. ``compile_fused``: run fused nodes through
    ``torch.compile`` (see :mod:`virtualflow.plan.comm.kernels`). ``trace``: a list to which
    ``("issue", name)``, ``("wait", name)`` and ``("run", name)`` events are appended in the order
    they happen (a test of the overlap's asynchrony).
    """
    events = trace
    p, r = group.size, group.rank
    if prog.stages > 1 and p2p is None:
        raise ValueError(f"execute: program {prog.name} has {prog.stages} stages; pass p2p=, a group of all "
                         f"{prog.stages * p} ranks (global rank = stage * {p} + rank)")
    if p2p is not None and p2p.size != prog.stages * p:
        raise ValueError(f"execute: p2p has {p2p.size} ranks, the program needs {prog.stages} stages x {p}")
    if not 0 <= stage < prog.stages:
        raise ValueError(f"execute: stage={stage} is not a stage of program {prog.name} (0..{prog.stages - 1})")
    own = collectives is None
    coll = collectives if collectives is not None else Collectives(group, Ledger())
    env: dict[str, torch.Tensor] = {}
    for d in prog.decls:
        if d.stage != stage:
            continue
        if d.name not in inputs:
            raise ValueError(f"execute: input {d.name} (stage {stage}) is missing")
        env[d.name] = _piece(d, inputs[d.name], p, r)
    pending: dict[str, _Pending] = {}
    sends: list[_Pending] = []
    ledger: list[OpTraffic] = []
    fused_cache: dict[int, object] = {}

    def get(a):
        if not isinstance(a, str):
            return a
        if a in pending:
            if events is not None:
                events.append(("wait", a))
            env.update(pending.pop(a).wait())
        return env[a]

    try:
        for i, op in enumerate(prog.ops):
            k = op.kind
            if k == "send":
                _send(prog, op, i, stage, p, r, p2p, get, pending, sends, ledger)
                continue
            op_stage = prog.info[op.tensor_args[0]].stage
            if op_stage != stage:
                continue
            if k == "update":
                target, value = op.args
                env[target].copy_(get(value))
                continue
            if k in LOCAL_KINDS:
                args = [get(a) for a in op.args]
                if k == "fused":
                    fn = fused_cache.setdefault(i, fused_fn(op, p, r, compile=compile_fused))
                    outs = list(fn(*args))
                else:
                    outs = run_local(op, args, p, r)
                env.update(zip(op.outs, outs))
                if events is not None:
                    events.append(("run", op.out))
                continue
            traffic = OpTraffic(op.label(), k, _t0=time.perf_counter())
            ledger.append(traffic)
            if k == "broadcast":
                x = get(op.args[0]).clone()
                for name in list(pending):  # the ring's thread must not share the group with it
                    get(name)
                t0 = time.perf_counter()
                group.broadcast(x, op.attrs["src"])
                traffic.wall_s = traffic.wait_s = time.perf_counter() - t0
                if r == op.attrs["src"]:
                    traffic.bytes_sent, traffic.messages = (p - 1) * x.numel() * x.element_size(), p - 1
                env[op.out] = x
                continue
            members = [get(a) for a in op.tensor_args]
            n0 = len(coll.ledger.entries)
            pend = _collective(prog, op, members, coll, p, r, traffic)
            traffic._entries = coll.ledger.entries[n0:]
            for name in op.outs:
                pending[name] = pend
            if events is not None:
                events.append(("issue", op.out))
        for name in list(pending):
            if name in pending:
                env.update(pending.pop(name).wait())
        for s in sends:
            s.wait()
    finally:
        if own:
            coll.close()
    for t in ledger:
        if t._entries:
            t.bytes_sent = sum(e.bytes_sent for e in t._entries)
            t.messages = sum(e.messages for e in t._entries)
            t.wall_s = max(e.wall_s for e in t._entries)
            t.wait_s = sum(e.wait_s for e in t._entries)
    names = [n for n in (*prog.outputs, *prog.states) if prog.info[n].stage == stage]
    return ExecResult({n: env[n] for n in names}, ledger)


def _piece(d, value, p: int, r: int) -> torch.Tensor:
    if isinstance(d.layout, Local) and not isinstance(value, torch.Tensor):
        value = value[r]
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != d.shape or value.dtype != d.dtype:
        raise ValueError(f"execute: input {d.name} must be a {d.dtype} tensor of shape {d.shape} (its global value), "
                         f"got {getattr(value, 'dtype', type(value).__name__)} {tuple(getattr(value, 'shape', ()))}")
    if isinstance(d.layout, Sliced):
        lo, hi = shard_bounds(d.shape[d.layout.dim], p)[r]
        return value.narrow(d.layout.dim, lo, hi - lo).clone()  # a copy: states are updated in place
    return value.clone()


def _send(prog: Program, op, i: int, stage: int, p: int, r: int, p2p: Group, get, pending, sends, ledger) -> None:
    src_stage = prog.info[op.args[0]].stage
    dst_stage = op.attrs["stage"]
    if stage == src_stage:
        x = get(op.args[0]).contiguous()
        traffic = OpTraffic(op.label(), "send", x.numel() * x.element_size(), 1, _t0=time.perf_counter())
        ledger.append(traffic)
        work = p2p.isend(x, dst_stage * p + r, _SEND_TAG + i)
        sends.append(_Pending([work], lambda x=x: {}, traffic))
    elif stage == dst_stage:
        info = prog.info[op.out]
        buf = torch.empty(piece_shape(info.shape, info.layout, p, r), dtype=info.dtype)
        work = p2p.irecv(buf, src_stage * p + r, _SEND_TAG + i)
        pending[op.out] = _Pending([work], lambda buf=buf, name=op.out: {name: buf}, None)


def _collective(prog: Program, op, members: Sequence[torch.Tensor], coll: Collectives, p: int, r: int,
                traffic: OpTraffic) -> _Pending:
    k = op.kind
    infos = [prog.info[a] for a in op.tensor_args]
    if k == "all_reduce":
        if len(members) == 1:
            flat = members[0].reshape(-1).clone()
            h = coll.all_reduce(flat, async_op=True)
            shape = members[0].shape
            return _Pending([h], lambda: {op.out: flat.view(shape)}, traffic)
        # A bucket: rank-major chunks of each member's flat shard_bounds(numel, p), RS then AG.
        flats = [m.reshape(-1) for m in members]
        pieces = [[f[lo:hi] for lo, hi in shard_bounds(f.numel(), p)] for f in flats]
        flat, bounds, offsets = _pack_rank_major(pieces, p)
        hs = [coll.reduce_scatter(flat, bounds, async_op=True), coll.all_gather(flat, bounds, async_op=True)]

        def finish():
            out = {}
            for i, (name, m) in enumerate(zip(op.outs, members)):
                parts = [flat[bounds[c][0] + offsets[c][i]: bounds[c][0] + offsets[c][i] + pieces[i][c].numel()]
                         for c in range(p)]
                out[name] = torch.cat(parts).view(m.shape)
            return out
        return _Pending(hs, finish, traffic)
    dims = op.attrs["dims"]
    if k == "reduce_scatter":
        moved = [m.movedim(d, 0).contiguous() for m, d in zip(members, dims)]
        rows = [shard_bounds(m.shape[0], p) for m in moved]
        pieces = [[m[lo:hi].reshape(-1) for lo, hi in rw] for m, rw in zip(moved, rows)]
        flat, bounds, offsets = _pack_rank_major(pieces, p)
        h = coll.reduce_scatter(flat, bounds, async_op=True)

        def finish():
            out = {}
            for i, (name, m, d) in enumerate(zip(op.outs, moved, dims)):
                lo, hi = rows[i][r]
                a = bounds[r][0] + offsets[r][i]
                piece = flat[a:a + pieces[i][r].numel()].view((hi - lo,) + tuple(m.shape[1:]))
                out[name] = piece.movedim(0, d).contiguous()
            return out
        return _Pending([h], finish, traffic)
    # all_gather: members are this rank's pieces; the full shapes come from the program.
    full = [i.shape for i in infos]
    moved_shapes = [(s[d],) + tuple(x for j, x in enumerate(s) if j != d) for s, d in zip(full, dims)]
    rows = [shard_bounds(ms[0], p) for ms in moved_shapes]
    rests = [int(torch.Size(ms[1:]).numel()) for ms in moved_shapes]
    sizes = [[(hi - lo) * rest for lo, hi in rw] for rw, rest in zip(rows, rests)]
    bounds, offsets = _rank_major_bounds(sizes, p)
    flat = torch.empty(bounds[-1][1] if bounds else 0, dtype=members[0].dtype, device=members[0].device)
    for i, (m, d) in enumerate(zip(members, dims)):
        a = bounds[r][0] + offsets[r][i]
        flat[a:a + sizes[i][r]].copy_(m.movedim(d, 0).reshape(-1))
    h = coll.all_gather(flat, bounds, async_op=True)

    def finish():
        out = {}
        for i, (name, ms, d) in enumerate(zip(op.outs, moved_shapes, dims)):
            parts = [flat[bounds[c][0] + offsets[c][i]: bounds[c][0] + offsets[c][i] + sizes[i][c]] for c in range(p)]
            out[name] = torch.cat(parts).view(ms).movedim(0, d).contiguous()
        return out
    return _Pending([h], finish, traffic)


def _rank_major_bounds(sizes: Sequence[Sequence[int]], p: int):
    """Chunk c = every member's piece c in member order: bounds per chunk and member offsets."""
    bounds, offsets, at = [], [], 0
    for c in range(p):
        offs, lo = [], at
        for s in sizes:
            offs.append(at - lo)
            at += s[c]
        bounds.append((lo, at))
        offsets.append(offs)
    return bounds, offsets


def _pack_rank_major(pieces: Sequence[Sequence[torch.Tensor]], p: int):
    sizes = [[x.numel() for x in per] for per in pieces]
    bounds, offsets = _rank_major_bounds(sizes, p)
    flat = torch.cat([pieces[i][c].reshape(-1) for c in range(p) for i in range(len(pieces))])
    return flat, bounds, offsets
