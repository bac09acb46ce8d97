"""The process driver of a pipelined job's stage: its point-to-point wire format and :func:`drive`.

:func:`drive` answers a :class:`~virtualflow.runtime.pipeline.StageEngine` generator's requests
with real communication over the generation's group (activations and gradients) and the stage
groups (gradient reductions).

Message format (point to point): a fixed-size int64 header (a flag, the tensor count, then per
tensor its dtype code, rank and shape) and one packed payload; tags are unique per (direction,
piece, micro-batch, part), so messages between the same two workers can never be confused.
Headers come from a peer of the same job but are still parsed defensively: a malformed one is a
:class:`PeerFailure` (the generation is formed again), never an exception in the job. On a link
whose shapes are known (:class:`Links`) a message is one buffer.

Deterministic mode's per-stage reduction over the replicas (:class:`StageTree`, and each job
stage's after a Bamboo failover) runs the exchange :class:`~virtualflow.runtime.step.exchange.ExchangeChoice`
picks for the stage's vector (or the one the ``deterministic_exchange`` knob names), the VN
engine's choice: :class:`StageExchanges`. Both give every replica the same root, bit for bit. A
streamed step (:mod:`.tree_fold`) opens the ``owners`` exchange at its first folded VN
(:class:`TreeOpen`: the receives are posted) and sends each partial sum as soon as it is final
(:class:`TreePart`), while its remaining micro-batches compute; the :class:`StageTree` finishes it.

Measured (``bench/pipeline/``): the first protocol, a header then one blocking receive per
tensor, each posted only when needed, cost 2-3 round trips per hop (1.4-2.0x torch.distributed.
pipelining's step time at p = 2); posting receives ahead and packing the payload removed them.
What a hop still cost beyond a hand-written pipeline's, and what the driver does about it:

- A thread per receive (:class:`Arrival`): its start and two more context switches per hop.
  Receives are now waited for on the driver's own thread; one watcher thread per process reads
  the abort flag meanwhile (:func:`~.receive_wait.wait_receive`).
- The step's stats all-reduce: gloo hands it to its worker thread and runs several rounds (2-3 ms
  at the step's end on 2 loaded cores). Small sums are one round of point-to-point messages
  (:func:`_sum_over`).
- Both directions of a link share one TCP connection of the group, with one lock and one gloo I/O
  thread per pair: when both ranks send at once (1F1B and interleaved do, every micro-batch) the
  calls stall each other for milliseconds (the I/O thread spins on the lock the sending thread
  holds). A group built with two gloo devices per address (``--interface ADDR,ADDR``) has two
  connections per pair, and a tag's parity (:func:`_tag`) puts each direction on its own.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, Generator

import torch

from virtualflow.comm.exchange import OwnerExchange
from virtualflow.comm.groups import Arrival, Group, PeerFailure
from virtualflow.comm.reduce import tree_exchange
from virtualflow.plan.pipeline.geometry import Grid
from virtualflow.plan.vnmap import TreePlan
from virtualflow.runtime.pipeline.receive_wait import wait_receive
from virtualflow.runtime.pipeline.requests import (AllSum, Expect, Poll, Recv, Send, StageGather, StageScatter,
                                                   StageSum, StageTree, StepResult, TreeOpen, TreePart)
from virtualflow.runtime.step.exchange import ExchangeChoice, owner_exchange

__all__ = ["Links", "Metas", "StageExchanges", "drive", "exchange_choice"]

log = logging.getLogger(__name__)


_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool)
_HEADER = 128
_ALIGN = 16
# tag parts of one message: 0 header, 1 payload of the link's reference shapes, 2 payload of new shapes
_PARTS = 4
_SAME, _NEW, _CHANGED = 0, 1, 2
_FLAGS = {f: torch.tensor([f, 0], dtype=torch.int64) for f in (_SAME, _NEW, _CHANGED)}
"""A payload's first ``_ALIGN`` bytes per flag (the flag, then zeros)."""


def _tag(key: tuple[str, int, int], n_pieces: int, part: int, src: int, dst: int) -> int:
    """The gloo tag of part ``part`` of message ``key`` from rank ``src`` to rank ``dst``. Its
    parity is the direction between the two ranks (``src > dst``): a group built with two gloo
    devices (``bind=[addr, addr]``, the launch option ``--interface ADDR,ADDR``) picks the context,
    so the TCP connection and I/O thread, of a point-to-point operation by its tag modulo two, so
    the two directions of a link never share a connection; with one device the parity changes
    nothing."""
    direction, piece, mb = key
    if direction == "R":  # a replica update (one per step and link; steps are sequential)
        base = 2 ** 29 + (piece * _PARTS + part) % 2 ** 27
    elif direction == "T":  # a tied weight's message (one per step and link): ``piece`` is the link
        base = 2 ** 29 + 2 ** 27 + (piece * _PARTS + part) % 2 ** 27
    else:
        base = (((mb * n_pieces + piece) * 2 + (direction == "B")) * _PARTS + part) % 2 ** 29
    return 2 * base + (src > dst)


Metas = tuple[tuple[torch.dtype, tuple[int, ...]], ...]


def _metas(tensors: list[torch.Tensor]) -> Metas:
    return tuple((t.dtype, tuple(t.shape)) for t in tensors)


def _header(flag: int, metas: Metas) -> torch.Tensor:
    h = [flag, len(metas)]
    for dtype, shape in metas:
        h += [_DTYPES.index(dtype), len(shape), *shape]
    if len(h) > _HEADER:
        raise ValueError(f"a pipeline message of {len(metas)} tensors {[m[1] for m in metas]} does not fit the "
                         f"{_HEADER}-entry header; pass fewer, lower-rank tensors between stages")
    return torch.tensor(h + [0] * (_HEADER - len(h)), dtype=torch.int64)


def _parse(header: torch.Tensor) -> tuple[int, Metas]:
    h = header.tolist()
    flag, n = int(h[0]), int(h[1])
    if flag not in (_SAME, _NEW, _CHANGED) or not 0 <= n <= _HEADER:
        raise ValueError(f"malformed pipeline message header {h[:16]}")
    out, i = [], 2
    for _ in range(n):
        if i + 2 > _HEADER:
            raise ValueError(f"malformed pipeline message header {h[:16]}")
        code, ndim = int(h[i]), int(h[i + 1])
        if not (0 <= code < len(_DTYPES)) or not (0 <= ndim <= 16) or i + 2 + ndim > _HEADER:
            raise ValueError(f"malformed pipeline message header {h[:16]}")
        shape = tuple(int(x) for x in h[i + 2: i + 2 + ndim])
        if any(d < 0 for d in shape):
            raise ValueError(f"malformed pipeline message header {h[:16]}")
        out.append((_DTYPES[code], shape))
        i += 2 + ndim
    return flag, tuple(out)


@functools.lru_cache(maxsize=256)
def _layout(metas: Metas) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """Byte offset and byte size of each tensor in a packed payload (aligned), and the payload's
    size. Cached: a link sends the same shapes message after message."""
    offsets, sizes, size = [], [], 0
    for dtype, shape in metas:
        offsets.append(size)
        n = math.prod(shape) * dtype.itemsize
        sizes.append(n)
        size += -(-n // _ALIGN) * _ALIGN
    return tuple(offsets), tuple(sizes), size


def _pack(tensors: list[torch.Tensor], metas: Metas, device: torch.device, flag: int | None = None) -> torch.Tensor:
    """One buffer: [flag (``_ALIGN`` bytes, when given) | each tensor's bytes, aligned]."""
    offsets, sizes, size = _layout(metas)
    start = _ALIGN if flag is not None else 0
    buf = torch.empty(start + size, dtype=torch.uint8, device=device)
    if flag is not None:
        buf[:_ALIGN].view(torch.int64).copy_(_FLAGS[flag])
    for t, off, n in zip(tensors, offsets, sizes):
        buf[start + off: start + off + n].copy_(t.detach().reshape(-1).view(torch.uint8))
    return buf


def _unpack(buf: torch.Tensor, metas: Metas, start: int = 0) -> list[torch.Tensor]:
    offsets, sizes, _ = _layout(metas)
    return [buf[start + off: start + off + n].view(dtype).view(shape)
            for (dtype, shape), off, n in zip(metas, offsets, sizes)]


class Links:
    """Per link (direction, sending piece): the shapes of its last message in the previous drive
    (step or window). Sender and receiver keep the same table (they see the same messages in the
    same order), so a receiver can post a message's payload before it arrives, and the sender
    knows whether that posted buffer fits. Reset with every generation."""

    def __init__(self) -> None:
        self.ref: dict[tuple[str, int], Metas] = {}
        self.last: dict[tuple[str, int], Metas] = {}

    def end_of_drive(self) -> None:
        self.ref.update(self.last)
        self.last = {}


class StageExchanges:
    """Per generation: which deterministic exchange each stage group's tree reduction runs, and
    the ``owners`` exchanges kept from step to step (their buffers and alternating tags).

    ``asked``: the ``deterministic_exchange`` knob (``"auto"``: :class:`ExchangeChoice` decides per
    vector, as for the VN engine; ``"owners"`` / ``"slots"``: always that one). :attr:`choices` holds, per job stage
    (``None``: the worker's one stage group), the exchange and the reason; a new choice is logged.
    Reset with every generation (new groups)."""

    def __init__(self, asked: str = "auto") -> None:
        self.choice = ExchangeChoice(asked)  # (checks the knob's value now)
        self.choices: dict[int | None, tuple[str, str]] = {}
        self._chosen: dict[tuple[Any, ...], tuple[str, str]] = {}
        self._owners: dict[tuple[Any, ...], OwnerExchange] = {}
        self._open: dict[int, OwnerExchange] = {}
        """The exchanges a streamed step opened (:meth:`open`) and has not finished yet."""
        self._sent: list[torch.Tensor] = []
        """The partials a streamed step sent early (:meth:`part`), until its exchanges finish."""
        self._failed: PeerFailure | None = None
        """An early post or send that failed (a member lost mid-step): raised at the step's
        :class:`StageTree`, where an unstreamed step would have failed. Raising it at once would
        leave this worker's pipeline peers waiting for the messages the rest of its micro-batches
        send (an abort releases them in a worker process; ranks run as threads cannot shut their
        connections down)."""

    def choose(self, stage: int | None, plan: TreePlan, like: torch.Tensor) -> str:
        """The exchange for stage group ``stage``'s vector shaped like ``like`` (remembered)."""
        key = (stage, plan, like.numel(), like.dtype)
        if key not in self._chosen:
            self._chosen[key] = self.choice.choose(plan, like)
        name, reason = self._chosen[key]
        if self.choices.get(stage) != (name, reason):
            where = "this worker's stage group" if stage is None else f"job stage {stage}"
            log.info("pipeline deterministic exchange over the replicas (%s): %s (%s)", where, name, reason)
            self.choices[stage] = (name, reason)
        return name

    def _owners_of(self, req: StageTree, group: Group) -> OwnerExchange | None:
        """The ``owners`` exchange of ``req``'s vector over ``group`` (made once), or ``None`` where
        it runs as ``slots`` or alone."""
        like = req.like
        if group.size == 1 or self.choose(req.stage, req.plan, like) == "slots":
            return None
        key = (req.stage, req.plan, like.numel(), like.dtype, req.bounds, req.gather)
        ex = self._owners.get(key)
        if ex is None:  # (req.bounds, reduction="sharded": each owner keeps its chunk, the gather goes to all)
            ex = self._owners[key] = owner_exchange(req.plan, group, like.numel(), dtype=like.dtype, device=like.device,
                                                    bounds=req.bounds,
                                                    gather=list(req.gather) if req.bounds is not None else None)
        return ex

    def open(self, req: TreeOpen, group: Group) -> None:
        """A streamed step (:mod:`.tree_fold`): post the receives of ``req.tree``'s exchange now,
        before this worker's first partial goes out (``slots``: nothing to do before the sum)."""
        ex = self._owners_of(req.tree, group)
        if ex is not None and self._failed is None:
            self._open[id(ex)] = ex
            try:
                ex.begin()
            except PeerFailure as exc:
                self._failed = exc

    def part(self, req: TreePart, group: Group) -> None:
        """Send the final partial ``req.node`` to its owners now (the opened exchange's)."""
        ex = self._owners_of(req.tree, group)
        if ex is not None and self._failed is None:
            self._sent.append(req.vec)
            try:
                ex.send(req.node, req.vec)
            except PeerFailure as exc:
                self._failed = exc

    def run(self, req: StageTree, group: Group) -> torch.Tensor:
        """The root of ``req``'s tree over ``group`` (every member gets the same bits); an exchange
        opened by :meth:`open` sends what is not sent yet and finishes."""
        if self._failed is not None:
            raise self._failed
        ex = self._owners_of(req, group)
        if ex is None:
            return tree_exchange(req.plan, group, req.nodes, like=req.like)
        if self._open.pop(id(ex), None) is None:
            ex.begin()
            for node, vec in req.nodes.items():
                ex.send(node, vec)
        root = ex.finish(req.nodes).clone()  # the exchange's root buffer is reused next step
        if not self._open:  # every early send of the step is complete
            self._sent = []
        return root

    def abandon(self) -> None:
        """A drive failed: forget the steps its exchanges had open (the partials already sent are
        kept alive: gloo may still read them)."""
        _ABANDONED.append(self._sent)
        del _ABANDONED[:-256]
        self._open, self._sent, self._failed = {}, [], None
        for ex in self._owners.values():
            ex.abandon()


def exchange_choice(exchanges: StageExchanges, stage: Any, stage_rank: int) -> tuple[str, str] | None:
    """The exchange ``stage`` (a :class:`~.engine.StageEngine` of stage-rank ``stage_rank``) runs
    over the replicas in this generation, and why (each stage chooses for its own vector; after a
    Bamboo failover one per job stage it runs). ``None`` without a stage or its tree."""
    if stage is None or stage.tree is None:
        return None
    numel, dtype = stage.tree_vector()
    like = torch.empty(numel, dtype=dtype, device="meta")
    if stage.job_stages is None:
        name = exchanges.choose(None, stage.tree, like)
        return name, f"stage {stage_rank}: {exchanges.choices[None][1]}"
    names, reasons = [], []  # Bamboo: one reduction per job stage this worker runs
    is_last = stage.last in stage.pieces
    with_bn = bool(stage.bn_numel) and stage.batchnorm == "mean"
    for s, idx in stage.reducer.stage_slices(True, with_bn, is_last):
        names.append(exchanges.choose(s, stage.tree, like[: idx.numel()]))
        reasons.append(f"job stage {s}: {exchanges.choices[s][1]}")
    return "/".join(dict.fromkeys(names)), "; ".join(reasons)


_ABANDONED: list[Any] = []
"""Sends a failed drive left unfinished, with their buffers: kept alive (gloo's transport may still
read a buffer) instead of waited on - a send to a live peer that has stopped receiving would block
until the group's timeout."""


_SUM_TAG = 2 ** 31 - 4
"""The tag of :func:`_sum_over`'s messages, plus the direction (no message key maps to it, see
:func:`_tag`)."""
_DIRECT_SUM_MEMBERS = 8
_DIRECT_SUM_NUMEL = 1 << 12


def _sum_over(group: Group, vector: torch.Tensor) -> None:
    """Sum ``vector`` over ``group`` in place (an :class:`AllSum`: the step's stats, metric sums).

    A small vector over a few members (CPU): one round of point-to-point messages on this thread:
    every member posts its receives, sends its vector to every other member, and adds the
    vectors in rank order, so every member gets the same bits. gloo's all-reduce hands the work
    to its worker thread and runs several rounds, which cost the step's end 2-3 ms on this
    2-core machine under load (``bench/pipeline``). Receives are waited for as the pipeline's
    (:func:`~.receive_wait.wait_receive`); a member's sends complete once its receives did (every peer posted
    its receive before sending). Larger vectors or groups: the all-reduce."""
    size = group.size
    if size == 1 or group.pg is None:
        return
    if size > _DIRECT_SUM_MEMBERS or vector.numel() > _DIRECT_SUM_NUMEL or vector.device.type != "cpu":
        group.all_reduce(vector)
        return
    mine = vector.clone()
    parts: list[torch.Tensor] = [mine if r == group.rank else torch.empty_like(vector) for r in range(size)]
    recvs: list[Any] = []
    sends: list[Any] = []
    try:
        me = group.rank
        recvs = [group.irecv(parts[r], r, _SUM_TAG + (r > me)) for r in range(size) if r != me]
        sends = [group.isend(mine, r, _SUM_TAG + (me > r)) for r in range(size) if r != me]
        for work in recvs:
            wait_receive(group, work)
        for work in sends:
            work.wait()
    except BaseException:
        _ABANDONED.append((recvs + sends, parts))  # kept alive: gloo may still touch the buffers
        raise
    vector.copy_(parts[0])
    for part in parts[1:]:
        vector.add_(part)


def drive(gen: Generator, *, group: Group, stage_group: Group, grid: Grid, n_pieces: int,
          device: torch.device, links: Links | None = None,
          stage_groups: dict[int, Group] | None = None,
          exchanges: StageExchanges | None = None) -> list[StepResult]:
    """Answer a :class:`StageEngine` generator's requests with real communication.

    Receives are posted when the engine announces them (:class:`Expect`), so a message moves as
    soon as it is sent. On a link whose shapes are known (its reference, see :class:`Links`), a
    message is ONE buffer on tag part 1: a flag, then every tensor of the message (generator state
    included) packed; the receiver posted exactly that size. On a new link, or when the shapes
    change, the sender sends a header (flag and shapes) on part 0 and the packed payload on part
    2 (after, on a known link, a part-1 buffer flagged ``_CHANGED`` to complete the posted
    receive). So the common case costs one message per hop, as hand-written pipelines do.

    A :class:`StageSum` / :class:`StageTree` naming a job stage goes over that stage's group in
    ``stage_groups`` (a worker running several stages after a Bamboo failover), else over
    ``stage_group``; a :class:`StageTree` runs the exchange ``exchanges`` picks (default: a fresh
    :class:`StageExchanges` with ``"auto"``).
    """
    links = links if links is not None else Links()
    exchanges = exchanges if exchanges is not None else StageExchanges()
    wire = _Wire(group, grid, n_pieces, device, links)
    stages = _StageAnswers(group, stage_group, stage_groups, exchanges)
    failed = False
    try:
        req = next(gen)
        while True:
            answer = wire.answer(req) if isinstance(req, (Expect, Send, Poll, Recv)) else stages.answer(req)
            req = gen.send(answer)
    except StopIteration as stop:
        results = stop.value
    except BaseException:
        failed = True
        exchanges.abandon()
        raise
    finally:
        stages.close(failed)
        wire.finish(failed)
    if wire.posted:
        raise RuntimeError(f"pipeline receives announced but never taken: {sorted(wire.posted)[:4]}")
    links.end_of_drive()
    return results


class _Wire:
    """One :func:`drive`'s point-to-point messages over the generation's group: receives posted
    ahead (:class:`Expect`), sends in flight until the drive ends."""

    def __init__(self, group: Group, grid: Grid, n_pieces: int, device: torch.device, links: Links) -> None:
        self.group, self.grid, self.n_pieces, self.device, self.links = group, grid, n_pieces, device, links
        self.pending: list[tuple[Any, list[torch.Tensor]]] = []
        self.posted: dict[tuple[str, int, int], tuple[Any, torch.Tensor, Metas | None]] = {}
        self.arrivals: dict[tuple[str, int, int], Arrival] = {}

    def answer(self, req: Any) -> Any:
        """The engine's answer to a point-to-point request."""
        if isinstance(req, Expect):
            self.post(self.grid.rank_of(self.grid.replica, req.peer), req.key)
            return None
        if isinstance(req, Send):
            self.send(req)
            return None
        if isinstance(req, Poll):
            if req.key not in self.posted:
                self.post(self.grid.rank_of(self.grid.replica, req.peer), req.key)
            if req.key not in self.arrivals:
                self.arrivals[req.key] = Arrival(self.posted[req.key][0])
            return self.arrivals[req.key].done.is_set()
        return self.recv(req)

    def post(self, peer_rank: int, key: tuple[str, int, int]) -> None:
        group, device = self.group, self.device
        ref = self.links.ref.get((key[0], key[1]))
        if ref is None:  # a new link: the header comes first
            buf = torch.empty(_HEADER, dtype=torch.int64, device=device)
            work = group.irecv(buf, peer_rank, _tag(key, self.n_pieces, 0, peer_rank, group.rank))
        else:
            buf = torch.empty(_ALIGN + _layout(ref)[2], dtype=torch.uint8, device=device)
            work = group.irecv(buf, peer_rank, _tag(key, self.n_pieces, 1, peer_rank, group.rank))
        self.posted[key] = (work, buf, ref)

    def header_then_payload(self, src: int, key: tuple[str, int, int],
                            header: torch.Tensor | None) -> list[torch.Tensor]:
        group, device, n_pieces = self.group, self.device, self.n_pieces
        if header is None:
            header = torch.empty(_HEADER, dtype=torch.int64, device=device)
            group.recv(header, src, _tag(key, n_pieces, 0, src, group.rank))
        try:
            flag, metas = _parse(header.cpu())
        except ValueError as exc:
            raise PeerFailure(group.generation, str(exc)) from None
        payload = torch.empty(_layout(metas)[2], dtype=torch.uint8, device=device)
        group.recv(payload, src, _tag(key, n_pieces, 2, src, group.rank))
        self.links.last[(key[0], key[1])] = metas
        return _unpack(payload, metas)

    def send(self, req: Send) -> None:
        group, device, n_pieces, links = self.group, self.device, self.n_pieces, self.links
        dst = self.grid.rank_of(self.grid.replica, req.peer)
        link = (req.key[0], req.key[1])
        metas = _metas(req.tensors)
        ref = links.ref.get(link)
        if ref is not None and metas == ref:
            buf = _pack(req.tensors, metas, device, flag=_SAME)
            works, keep = [group.isend(buf, dst, _tag(req.key, n_pieces, 1, group.rank, dst))], [buf]
        else:
            works, keep = [], []
            if ref is not None:  # complete the receive posted for the reference's size
                filler = torch.zeros(_ALIGN + _layout(ref)[2], dtype=torch.uint8, device=device)
                filler[:8].view(torch.int64).fill_(_CHANGED)
                works.append(group.isend(filler, dst, _tag(req.key, n_pieces, 1, group.rank, dst)))
                keep.append(filler)
            header = _header(_NEW if ref is None else _CHANGED, metas).to(device)
            payload = _pack(req.tensors, metas, device)
            works.append(group.isend(header, dst, _tag(req.key, n_pieces, 0, group.rank, dst)))
            works.append(group.isend(payload, dst, _tag(req.key, n_pieces, 2, group.rank, dst)))
            keep += [header, payload]
        links.last[link] = metas
        self.pending.append((works, keep))

    def recv(self, req: Recv) -> list[torch.Tensor]:
        group = self.group
        src = self.grid.rank_of(self.grid.replica, req.peer)
        if req.key not in self.posted:
            self.post(src, req.key)
        work, buf, ref = self.posted.pop(req.key)
        arrival = self.arrivals.pop(req.key, None)
        if arrival is not None:  # polled before (eager forwards): its thread owns the wait
            arrival.wait(group)
        else:
            wait_receive(group, work)
        if ref is None:
            return self.header_then_payload(src, req.key, buf)
        flag = int(buf[:8].view(torch.int64).item())
        if flag == _SAME:
            self.links.last[(req.key[0], req.key[1])] = ref
            return _unpack(buf, ref, start=_ALIGN)
        if flag == _CHANGED:
            return self.header_then_payload(src, req.key, None)
        raise PeerFailure(group.generation, f"pipeline message with unknown flag {flag}")

    def finish(self, failed: bool) -> None:
        """The drive's end: wait for its sends; after a failure leave them (the caller closes the
        group; the peers may not be receiving any more)."""
        if failed:
            _ABANDONED.extend(self.pending)
            del _ABANDONED[:-256]
            return
        for works, _keep in self.pending:
            for w in works:
                try:
                    w.wait()
                except PeerFailure:
                    pass


class _StageAnswers:
    """One :func:`drive`'s answers to the step's collectives: the stage groups' reductions and
    the generation's stats all-reduce."""

    def __init__(self, group: Group, stage_group: Group, stage_groups: dict[int, Group] | None,
                 exchanges: StageExchanges) -> None:
        self.group, self.stage_group, self.stage_groups, self.exchanges = group, stage_group, stage_groups, exchanges
        self.stage_comm: Any = None
        """The stage group's ring (reduction="sharded"), made on first use."""

    def answer(self, req: Any) -> Any:
        if isinstance(req, StageSum):
            self.over(req.stage).all_reduce(req.vector)
            return req.vector
        if isinstance(req, StageTree):
            return self.exchanges.run(req, self.over(req.stage))
        if isinstance(req, TreeOpen):  # (a streamed step, .tree_fold)
            return self.exchanges.open(req, self.over(req.tree.stage))
        if isinstance(req, TreePart):
            return self.exchanges.part(req, self.over(req.tree.stage))
        if isinstance(req, (StageScatter, StageGather)):  # reduction="sharded" (.stage_shard)
            if self.stage_comm is None:
                from virtualflow.comm.ring import Collectives
                self.stage_comm = Collectives(self.stage_group)
            op = self.stage_comm.reduce_scatter if isinstance(req, StageScatter) else self.stage_comm.all_gather
            op(req.vector, req.bounds)
            return req.vector
        if isinstance(req, AllSum):
            _sum_over(self.group, req.vector)
            return req.vector
        raise TypeError(f"unknown pipeline request {req!r}")

    def over(self, stage: int | None) -> Group:
        """The group a reduction of job stage ``stage`` runs over (``None``: the stage group)."""
        return self.stage_group if stage is None else self.stage_groups[stage]

    def close(self, failed: bool) -> None:
        if self.stage_comm is not None:
            self.stage_comm.close(timeout_s=1.0 if failed else None)
