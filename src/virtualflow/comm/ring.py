"""Reduce-scatter and all-gather of a flat vector, asynchronous, with a ledger of bytes and time.

Purpose: the sharded reduction (reduce-scatter the gradients, update each rank's slice of the
parameters, all-gather the slices) needs a reduce-scatter that really sends half of an
all-reduce's bytes. gloo's ``reduce_scatter`` is an all-reduce in disguise (twice the traffic),
so on gloo this module runs its own bandwidth-optimal ring over point-to-point messages; on CUDA
tensors it uses NCCL's native collectives (``_reduce_scatter_base`` / ``_allgather_base``, chunks
padded to one size when they are uneven).

Layout: ``bounds`` are ``p`` contiguous ``(lo, hi)`` chunks covering ``[0, numel)`` in rank order
(:func:`virtualflow.plan.shards.check_bounds`); rank ``r`` owns chunk ``r``; chunks may be uneven
or empty. Both ops work **in place** on a 1-D contiguous tensor:

* reduce-scatter: afterwards rank ``r``'s ``flat[lo_r:hi_r]`` is the sum over ranks of their
  ``flat[lo_r:hi_r]``; the rest of ``flat`` is scratch (partial sums).
* all-gather: rank ``r``'s ``flat[lo_r:hi_r]`` is its input; afterwards every rank's ``flat``
  holds every rank's chunk.

Invariants:

* Ops issued on one :class:`Collectives` run strictly in issue order (one FIFO queue, one
  background thread on gloo), so every rank runs the same op at the same time as long as all
  ranks issue the same sequence. Each message's tag is derived from (op sequence number, step,
  segment), so no message of one op or step can be matched by another's receive. Use one
  ``Collectives`` per group: two over the same group would share tags.
* Ring schedule (``p`` ranks, ``right = r+1``, ``left = r-1`` mod ``p``), ``p - 1`` steps:
  reduce-scatter step ``k`` sends chunk ``(r-k-1) mod p`` to ``right`` and receives chunk
  ``(r-k-2) mod p`` from ``left``, adding it into ``flat``; after the last step chunk ``r`` is
  complete. All-gather step ``k`` sends chunk ``(r-k) mod p`` and receives chunk ``(r-k-1) mod p``
  straight into ``flat``. Receives are posted before sends. A chunk is sent as segments of at
  most ``segment_bytes`` (so adding one segment overlaps receiving the next); an empty chunk sends
  no message at all, which both sides know from ``bounds``.
* Receive scratch (reduce-scatter only) is one buffer per dtype, grown to the largest chunk and
  reused: no large allocation per step or per op (fresh pages cost page faults, see NOTES).
* A failure (a peer died, a gloo error or timeout) is raised as :class:`PeerFailure` from
  ``Handle.wait()`` (and from a synchronous call); the object is broken from then on: queued ops
  fail with the same cause and new ones are refused. No wait outlasts the group's timeout, and
  ``Handle.wait()`` reads the group's ``abort_check`` between short slices, as ``Group`` does, so
  a generation the coordinator declared broken ends the wait at once.

Bytes per rank (``n_i`` elements in chunk ``i``, ``N = sum n_i``, ``b`` bytes per element), the
closed forms of the schedule above (:func:`ring_traffic` computes them from the schedule):

* reduce-scatter: sends ``(N - n_r) * b`` (every chunk but its own), receives
  ``(N - n_{r-1}) * b`` (every chunk but its left neighbour's);
* all-gather: sends ``(N - n_{r+1}) * b``, receives ``(N - n_r) * b``;
* all-reduce (= both): sends ``(2N - n_r - n_{r+1}) * b``; for even chunks ``2 (p-1)/p N b``.

Messages sent: one per segment of every non-empty chunk sent.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, fields
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from virtualflow.comm.groups import WAIT_SLICE_S, Group, PeerFailure
from virtualflow.plan.exchange import Traffic
from virtualflow.plan.shards import check_bounds, shard_bounds

log = logging.getLogger(__name__)

DEFAULT_SEGMENT_BYTES = 8 * 1024 * 1024
"""Largest message of the gloo ring: a chunk is sent in segments of at most this many bytes so
the add of one segment overlaps the arrival of the next."""

_TAG_BASE = 1 << 30
_TAG_STEPS = 64      # steps of an op that can be told apart (steps are sequential, so wrap is safe)
_TAG_SEGMENTS = 1024  # segments of a step that can be told apart
_TAG_OPS = 16        # ops in flight that can be told apart (ops are sequential, so wrap is safe)

OPS = ("reduce_scatter", "all_gather", "all_reduce")


# --------------------------------------------------------------------------------------------
# Ledger.


@dataclass(slots=True)
class LedgerEntry:
    """One collective as this rank saw it."""

    op: str
    bytes_sent: int = 0
    bytes_received: int = 0
    messages: int = 0
    """Messages this rank sent."""
    wall_s: float = 0.0
    """Launch (issue) to done."""
    wait_s: float = 0.0
    """Time the caller spent blocked in ``Handle.wait()`` (the exposed part of the collective)."""
    numel: int = 0
    ranks: int = 1


_NUMERIC = tuple(f.name for f in fields(LedgerEntry) if f.name not in ("op", "ranks"))


class Ledger:
    """Per-collective records: op name, bytes sent, bytes received, messages sent, wall seconds
    (launch -> done), exposed wait seconds (time the caller spent blocked in wait())."""

    def __init__(self) -> None:
        self.entries: list[LedgerEntry] = []
        self._lock = threading.Lock()

    def _add(self, entry: LedgerEntry) -> None:
        with self._lock:
            self.entries.append(entry)

    def totals(self) -> dict[str, float]:
        """Every numeric field summed over the entries, and ``count``."""
        with self._lock:
            return _sum(self.entries)

    def by_op(self) -> dict[str, dict[str, float]]:
        """:meth:`totals` per op name."""
        with self._lock:
            ops: dict[str, list[LedgerEntry]] = {}
            for e in self.entries:
                ops.setdefault(e.op, []).append(e)
            return {op: _sum(es) for op, es in ops.items()}

    def clear(self) -> None:
        with self._lock:
            self.entries.clear()


def _sum(entries: Sequence[LedgerEntry]) -> dict[str, float]:
    out = {name: 0.0 for name in _NUMERIC}
    for e in entries:
        for name in _NUMERIC:
            out[name] += getattr(e, name)
    out["count"] = float(len(entries))
    return out


# --------------------------------------------------------------------------------------------
# The ring schedule and its traffic (pure).


def rs_schedule(rank: int, size: int) -> list[tuple[int, int]]:
    """Reduce-scatter: (chunk sent to the right, chunk received from the left) per step."""
    return [((rank - k - 1) % size, (rank - k - 2) % size) for k in range(size - 1)]


def ag_schedule(rank: int, size: int) -> list[tuple[int, int]]:
    """All-gather: (chunk sent to the right, chunk received from the left) per step."""
    return [((rank - k) % size, (rank - k - 1) % size) for k in range(size - 1)]


def _segments(n: int, seg: int) -> int:
    return -(-n // seg) if n > 0 else 0


def ring_traffic(op: str, bounds: Sequence[tuple[int, int]], rank: int, itemsize: int,
                 segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> Traffic:
    """What rank ``rank`` sends and receives in ``op`` over the gloo ring, from the schedule."""
    if op not in OPS:
        raise ValueError(f"ring_traffic: op={op!r} is not one of {OPS}")
    size = len(bounds)
    seg = _segment_elems(segment_bytes, itemsize)
    steps = {"reduce_scatter": rs_schedule(rank, size), "all_gather": ag_schedule(rank, size),
             "all_reduce": rs_schedule(rank, size) + ag_schedule(rank, size)}[op]
    n = [hi - lo for lo, hi in bounds]
    sent = sum(n[s] for s, _ in steps)
    recv = sum(n[c] for _, c in steps)
    msent = sum(_segments(n[s], seg) for s, _ in steps)
    mrecv = sum(_segments(n[c], seg) for _, c in steps)
    return Traffic(sent * itemsize, recv * itemsize, msent, mrecv)


def _segment_elems(segment_bytes: int, itemsize: int) -> int:
    return max(1, segment_bytes // itemsize)


_TAG_SPAN = _TAG_OPS * _TAG_STEPS * _TAG_SEGMENTS
"""Tags one :class:`Collectives` uses above its base (a second one on the same group starts its
base this far up: ``lane=1``)."""


def _tag(seq: int, step: int, segment: int, lane: int = 0) -> int:
    return _TAG_BASE + lane * _TAG_SPAN + ((seq % _TAG_OPS) * _TAG_STEPS + step % _TAG_STEPS) * _TAG_SEGMENTS + segment % _TAG_SEGMENTS


# --------------------------------------------------------------------------------------------
# Handles.


class Handle:
    """One issued collective. ``wait()`` blocks until it is done (its result is in ``flat``).
    The caller must leave ``flat`` alone (neither read nor write it) until then."""

    def __init__(self, entry: LedgerEntry, generation: int, t_launch: float,
                 native: tuple[object, Callable[[], None] | None] | None = None) -> None:
        self._entry = entry
        self._generation = generation
        self._t_launch = t_launch
        self._event = threading.Event()
        self._finish_lock = threading.Lock()
        self._error: BaseException | None = None
        self._native = native  # (torch Work, copy-back) for NCCL ops
        self._thread: threading.Thread | None = None
        self._on_failure: Callable[[BaseException], None] | None = None
        self._abort_check: Callable[[], Callable[[], bool] | None] | None = None

    # Called by the worker thread.
    def _finish(self, error: BaseException | None) -> None:
        with self._finish_lock:
            if self._event.is_set():  # already ended (aborted by the caller, then the thread gave up)
                return
            self._finish_locked(error)

    def _finish_locked(self, error: BaseException | None) -> None:
        self._entry.wall_s = time.perf_counter() - self._t_launch
        self._error = error
        if error is not None and self._on_failure is not None:
            self._on_failure(error)
        self._event.set()

    def done(self) -> bool:
        """The collective has finished (no wait would block). Read ``flat`` only after
        :meth:`wait`: a native op over uneven chunks copies its result back there."""
        if self._native is not None:
            return self._event.is_set() or bool(self._native[0].is_completed())
        return self._event.is_set()

    def wait(self) -> None:
        """Block until done; raise :class:`PeerFailure` if the collective failed. The time
        blocked here is added to the ledger entry's ``wait_s``."""
        t0 = time.perf_counter()
        try:
            if self._native is not None:
                self._wait_native()
            else:
                # Sliced, like Group's collective waits: between slices the coordinator's abort
                # flag is read, so a generation declared broken ends the wait at once (the thread
                # itself may stay blocked in a receive until the group is closed or times out).
                # A thread that ended without finishing us (a bug) is noticed too.
                while not self._event.wait(WAIT_SLICE_S):
                    abort_check = self._abort_check() if self._abort_check is not None else None
                    if abort_check is not None and abort_check():
                        self._finish(PeerFailure(self._generation, "the coordinator declared the generation "
                                                                   "broken (a member failed)"))
                    elif self._thread is not None and not self._thread.is_alive() and not self._event.is_set():
                        self._finish(RuntimeError("the collectives thread ended without finishing this op"))
        finally:
            self._entry.wait_s += time.perf_counter() - t0
        if self._error is not None:
            if isinstance(self._error, PeerFailure):
                raise PeerFailure(self._generation, _strip(str(self._error))) from self._error
            raise self._error

    def _wait_native(self) -> None:
        if self._event.is_set():
            return
        work, finish = self._native
        try:
            work.wait()
            if finish is not None:
                finish()
        except RuntimeError as exc:
            self._finish(PeerFailure(self._generation, _first_line(str(exc))))
            return
        self._finish(None)


class _DoneHandle(Handle):
    def __init__(self, entry: LedgerEntry) -> None:
        super().__init__(entry, 0, time.perf_counter())
        self._finish(None)


def _strip(text: str) -> str:
    prefix = "collective of generation "
    if text.startswith(prefix) and ": " in text:
        return text.split(": ", 1)[1]
    return text


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else text
    return line[:300]


# --------------------------------------------------------------------------------------------
# Collectives.


class Collectives:
    """Collectives of one Group, run in order on one background thread (gloo) so that they overlap
    with the caller's compute; NCCL: native async ops.

    ``link``: optional emulated-link hook called with the byte count of every message before it
    is sent (a benchmark or test passes one that sleeps ``alpha + bytes / beta``); None = the real
    link only. ``segment_bytes``: the gloo ring's largest message. ``native``: use the backend's own
    collectives (None: for CUDA tensors only, i.e. NCCL; True on gloo runs gloo's own
    ``_reduce_scatter_base`` / ``_allgather_base`` / ``allreduce``, a baseline for benchmarks and
    tests; ``link`` is not applied to them).
    """

    def __init__(self, group: Group, ledger: Ledger | None = None, *, link: Callable[[int], None] | None = None,
                 segment_bytes: int = DEFAULT_SEGMENT_BYTES, native: bool | None = None, lane: int = 0) -> None:
        if segment_bytes < 1:
            raise ValueError(f"Collectives: segment_bytes={segment_bytes} must be positive")
        self.group = group
        self.ledger = ledger if ledger is not None else Ledger()
        self.link = link
        self.segment_bytes = segment_bytes
        self.native = native
        self.lane = lane
        """Two Collectives of one group run side by side (each in its own order) on different
        lanes: their messages' tags never meet (``reduction="fsdp"``: gathers and reductions)."""
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._seq = 0
        self._closed = False
        self._failure: BaseException | None = None
        self._scratch: dict[torch.dtype, torch.Tensor] = {}

    # -- public ops ---------------------------------------------------------------------------

    def reduce_scatter(self, flat: torch.Tensor, bounds: Sequence[tuple[int, int]], *,
                       async_op: bool = False) -> Handle | None:
        """In place: afterwards ``flat[lo_r:hi_r]`` holds the sum over ranks of their
        ``flat[lo_r:hi_r]`` (``r`` = this rank); the rest of ``flat`` is scratch."""
        return self._issue("reduce_scatter", flat, list(bounds), async_op)

    def all_gather(self, flat: torch.Tensor, bounds: Sequence[tuple[int, int]], *,
                   async_op: bool = False) -> Handle | None:
        """In place: ``flat[lo_r:hi_r]`` is this rank's input; afterwards ``flat`` holds every
        rank's chunk."""
        return self._issue("all_gather", flat, list(bounds), async_op)

    def all_reduce(self, flat: torch.Tensor, *, async_op: bool = False) -> Handle | None:
        """In place sum: a ring reduce-scatter then a ring all-gather over even chunks."""
        return self._issue("all_reduce", flat, None, async_op)

    def close(self, timeout_s: float | None = None) -> None:
        """Finish the queued ops, then stop the thread (idempotent). After a failure the thread
        may still be blocked in a receive from a silent peer: closing our own Group does not
        release it (measured, torch 2.13), the peer's sockets closing (it died or was fenced) or
        the group's timeout does. ``timeout_s`` bounds the join; the daemon thread is then left
        to end on its own."""
        with self._lock:
            if not self._closed:
                self._closed = True
                if self._thread is not None:
                    self._queue.put(None)
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    @property
    def broken(self) -> BaseException | None:
        """The failure that broke this object, or None."""
        return self._failure

    # -- issue --------------------------------------------------------------------------------

    def _issue(self, op: str, flat: torch.Tensor, bounds: list[tuple[int, int]] | None,
               async_op: bool) -> Handle | None:
        size = self.group.size
        if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or not flat.is_contiguous():
            raise ValueError(f"{op}: flat must be a 1-D contiguous tensor, got "
                             f"{type(flat).__name__} {tuple(getattr(flat, 'shape', ()))}; use .reshape(-1).contiguous()")
        if bounds is None:
            bounds = shard_bounds(flat.numel(), size)
        if len(bounds) != size:
            raise ValueError(f"{op}: {len(bounds)} bounds for a group of {size} ranks; pass one (lo, hi) per rank "
                             f"(plan.shards.shard_bounds(numel, {size}))")
        check_bounds(bounds, flat.numel())
        entry = LedgerEntry(op, numel=flat.numel(), ranks=size)
        if size == 1:
            self.ledger._add(entry)
            return _DoneHandle(entry) if async_op else None
        if self.group.pg is None:  # Group.close() dropped it: never skip a collective silently
            raise PeerFailure(self.group.generation, f"{op} refused: the group of {size} ranks was closed")
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{op}: this Collectives was closed; build a new one")
            if self._failure is not None:
                raise PeerFailure(self.group.generation,
                                  f"{op} refused: an earlier collective on this Collectives failed "
                                  f"({_strip(str(self._failure))}); regroup and build a new Collectives")
            seq = self._seq
            self._seq += 1
            self.ledger._add(entry)
            t_launch = time.perf_counter()
            if self.native if self.native is not None else flat.device.type == "cuda":
                handle = self._native_op(op, flat, bounds, entry, t_launch)
            else:
                handle = Handle(entry, self.group.generation, t_launch)
                handle._on_failure = self._mark_failed
                handle._abort_check = lambda: self.group.abort_check
                self._ensure_thread()
                handle._thread = self._thread
                self._queue.put((handle, op, flat, bounds, seq))
        if async_op:
            return handle
        handle.wait()
        return None

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"vf-collectives-g{self.group.generation}",
                                            daemon=True)
            self._thread.start()

    # -- the gloo thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            handle, op, flat, bounds, seq = item
            if self._failure is not None:
                handle._finish(PeerFailure(self.group.generation,
                                           f"{op} not run: an earlier collective failed ({_strip(str(self._failure))})"))
                continue
            error: BaseException | None = None
            try:
                if op in ("reduce_scatter", "all_reduce"):
                    self._ring_reduce_scatter(flat, bounds, seq, 0, handle._entry)
                if op in ("all_gather", "all_reduce"):
                    self._ring_all_gather(flat, bounds, seq, self.group.size - 1 if op == "all_reduce" else 0,
                                          handle._entry)
            except PeerFailure as exc:
                error = exc
            except RuntimeError as exc:  # a gloo error outside a wait
                error = PeerFailure(self.group.generation, _first_line(str(exc)))
            except BaseException as exc:  # noqa: BLE001 - a bug: the ranks are out of step now
                log.exception("collectives thread: %s failed", op)
                error = exc
            if error is not None:
                self._mark_failed(error)
            handle._finish(error)

    def _scratch_for(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        buf = self._scratch.get(dtype)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype)
            self._scratch[dtype] = buf
        return buf[:numel]

    def _send_chunk(self, flat: torch.Tensor, lo: int, hi: int, dst: int, seq: int, step: int,
                    entry: LedgerEntry) -> list:
        seg = _segment_elems(self.segment_bytes, flat.element_size())
        works = []
        for j, a in enumerate(range(lo, hi, seg)):
            piece = flat[a:min(hi, a + seg)]
            nbytes = piece.numel() * piece.element_size()
            if self.link is not None:
                self.link(nbytes)
            works.append(self.group.isend(piece, dst, _tag(seq, step, j, self.lane)))
            entry.bytes_sent += nbytes
            entry.messages += 1
        return works

    def _ring_reduce_scatter(self, flat: torch.Tensor, bounds: list[tuple[int, int]], seq: int, step0: int,
                             entry: LedgerEntry) -> None:
        g = self.group
        right, left = (g.rank + 1) % g.size, (g.rank - 1) % g.size
        seg = _segment_elems(self.segment_bytes, flat.element_size())
        biggest = max(hi - lo for lo, hi in bounds)
        scratch = self._scratch_for(flat.dtype, biggest) if biggest else None
        for k, (cs, cr) in enumerate(rs_schedule(g.rank, g.size)):
            rlo, rhi = bounds[cr]
            recvs = []
            for j, a in enumerate(range(rlo, rhi, seg)):
                b = min(rhi, a + seg)
                recvs.append((a, b, g.irecv(scratch[a - rlo:b - rlo], left, _tag(seq, step0 + k, j, self.lane))))
            sends = self._send_chunk(flat, *bounds[cs], right, seq, step0 + k, entry)
            for a, b, w in recvs:
                w.wait()
                flat[a:b].add_(scratch[a - rlo:b - rlo])
                entry.bytes_received += (b - a) * flat.element_size()
            for w in sends:
                w.wait()

    def _ring_all_gather(self, flat: torch.Tensor, bounds: list[tuple[int, int]], seq: int, step0: int,
                         entry: LedgerEntry) -> None:
        g = self.group
        right, left = (g.rank + 1) % g.size, (g.rank - 1) % g.size
        seg = _segment_elems(self.segment_bytes, flat.element_size())
        for k, (cs, cr) in enumerate(ag_schedule(g.rank, g.size)):
            rlo, rhi = bounds[cr]
            recvs = [g.irecv(flat[a:min(rhi, a + seg)], left, _tag(seq, step0 + k, j, self.lane))
                     for j, a in enumerate(range(rlo, rhi, seg))]
            sends = self._send_chunk(flat, *bounds[cs], right, seq, step0 + k, entry)
            for w in recvs:
                w.wait()
            entry.bytes_received += (rhi - rlo) * flat.element_size()
            for w in sends:
                w.wait()

    # -- NCCL ---------------------------------------------------------------------------------

    def _native_op(self, op: str, flat: torch.Tensor, bounds: list[tuple[int, int]], entry: LedgerEntry,
                   t_launch: float) -> Handle:
        """Launch the backend's own collective (NCCL: async on its stream); copy-backs run in
        ``wait()``. Bytes are recorded as a ring over chunks padded to the largest one moves them
        (what NCCL's ring does; gloo's emulated reduce-scatter really moves an all-reduce's)."""
        g = self.group
        p, r = g.size, g.rank
        sizes = [hi - lo for lo, hi in bounds]
        m = max(sizes)
        even = all(s == m for s in sizes)
        itemsize = flat.element_size()
        lo_r, hi_r = bounds[r]
        try:
            if op == "all_reduce":
                opts = dist.AllreduceOptions()
                opts.reduceOp = dist.ReduceOp.SUM
                work = g.pg.allreduce([flat], opts)
                finish = None
                nbytes = 2 * (p - 1) * m * itemsize
                entry.messages = 2 * (p - 1)
            elif op == "reduce_scatter":
                if even:
                    inp = flat
                else:  # pad every chunk to m elements
                    inp = flat.new_zeros(p * m)
                    for i, (lo, hi) in enumerate(bounds):
                        inp[i * m:i * m + hi - lo].copy_(flat[lo:hi])
                out = flat.new_empty(m)
                opts = dist.ReduceScatterOptions()
                opts.reduceOp = dist.ReduceOp.SUM
                work = g.pg._reduce_scatter_base(out, inp, opts)
                n_r = hi_r - lo_r

                def finish(out=out, inp=inp) -> None:  # keeps inp alive until done
                    flat[lo_r:hi_r].copy_(out[:n_r])
                nbytes = (p - 1) * m * itemsize
                entry.messages = p - 1
            else:  # all_gather
                opts = dist.distributed_c10d.AllgatherOptions()
                if even:
                    work = g.pg._allgather_base(flat, flat[lo_r:hi_r], opts)  # in place (NCCL allows it)
                    finish = None
                else:
                    inp = flat.new_zeros(m)
                    inp[:hi_r - lo_r].copy_(flat[lo_r:hi_r])
                    out = flat.new_empty(p * m)
                    work = g.pg._allgather_base(out, inp, opts)

                    def finish(out=out, inp=inp) -> None:
                        for i, (lo, hi) in enumerate(bounds):
                            if i != r:
                                flat[lo:hi].copy_(out[i * m:i * m + hi - lo])
                nbytes = (p - 1) * m * itemsize
                entry.messages = p - 1
        except RuntimeError as exc:
            self._failure = PeerFailure(g.generation, _first_line(str(exc)))
            raise self._failure from exc
        entry.bytes_sent = entry.bytes_received = nbytes
        handle = Handle(entry, g.generation, t_launch, native=(work, finish))
        handle._on_failure = self._mark_failed
        return handle

    def _mark_failed(self, error: BaseException) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = error
