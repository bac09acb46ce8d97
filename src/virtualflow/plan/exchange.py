"""The deterministic exchange: who sends which part of which partial sum to whom. Pure code.

In deterministic mode every worker reduces the per-VN vectors of its own VN block along the fixed
tree (:mod:`virtualflow.plan.vnmap`) into a few *partial sums*: the maximal tree nodes inside its
block, ``O(log V)`` of them. The partials of all workers (the tree's *slots*) are then combined
into the root sum in the fixed tree order, so the result does not depend on the worker count.
Two ways to bring the slots together are implemented:

``owners`` (the default)
    The vector (``numel`` elements: gradients, then the few numbers that ride with them) is cut
    into one contiguous chunk per worker (``bounds``; worker ``r`` *owns* chunk ``r``). Each worker
    sends chunk ``o`` of each of its partials to owner ``o`` only (nothing is sent that is zero);
    owner ``o`` combines its chunk of every slot in the fixed tree order and sends its chunk of the
    root to every other worker (``gather``: the ranges everybody needs whole; the sharded
    reduction needs only the tail, each owner keeps and updates its own chunk). Per worker ``r``
    with ``k_r`` partials, chunk sizes ``n_o`` and ``S`` slots in all::

        sent     = k_r * (numel - n_r) + (W - 1) * g_r
        received = (S - k_r) * n_r     + (G - g_r)

    (``g_o``: the part of chunk ``o`` inside ``gather``, ``G = sum g_o``.) With even chunks and
    everything gathered that is ``(k_r + 1)(W - 1)/W * numel`` sent: it does not grow with ``W``
    at a fixed number of VNs per worker. Memory: the partials (``k_r`` vectors) and the slices of
    the other workers' partials for the own chunk (``(S - k_r) * n_r`` elements, about ``S / W``
    vectors), besides the root.

``slots`` (the first algorithm)
    One buffer of ``S x numel`` in which each slot has a single non-zero writer, all-reduced:
    per worker ``2 (W - 1)/W * S * numel`` on a ring, ``O(W)`` times the gradient. Measured slower
    than ``owners`` at every size from 1 KB to 4 MB and W = 2..4 (one gloo all-reduce of a tiny
    buffer is not cheaper than a few point-to-point messages), so ``auto`` never picks it; it is
    kept, selected by name, as the reference the benchmark compares against.

A *unit* is one message of the ``owners`` exchange: the part of one *piece* of the vector (a
gradient bucket, in the order the last backward completes them, or the tail) inside one owner's
chunk, cut into *segments*: at most :data:`SEGMENT` elements, and each owner's chunk into at
least :data:`DEPTH` of them where they stay :data:`MIN_SEGMENT` long (:func:`segment_for`); when
every worker of the group shares one machine's network stack, :data:`LOCAL_DEPTH` of them
(:func:`depth_for`). Every partial is sent as the same units, so a receiver knows every message
it will get.

The second phase is pipelined per unit: an owner combines a unit of its chunk and sends that
unit's root to everyone as soon as every slot's message for it has arrived, while the later units
are still arriving. Senders send in launch order (piece by piece, segment by segment), each
starting with the next owner after itself (:meth:`OwnerSchedule.send_order`), so the owners'
chunks fill up together and no owner is everyone's first destination. :func:`owners_seconds` is
the time model of this schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from virtualflow.plan.shards import check_bounds, shard_bounds
from virtualflow.plan.vnmap import Node, TreePlan

EXCHANGES = ("auto", "owners", "slots")
SEGMENT = 1 << 20
"""Elements per message of the ``owners`` exchange at most (4 MiB of float32): a unit of an owner's
chunk larger than that is sent as several segments, so the owner's second phase starts after the
first segment of its chunk, not after the whole chunk (the pipeline's drain costs one segment,
:func:`owners_seconds`), while the messages stay few (a 25 MiB bucket of float32 gradients inside
one owner's chunk is 7 messages; each costs a Python call and gloo's rendezvous, tens of µs)."""
DEPTH = 4
"""Segments an owner's chunk is cut into at least, while each stays at least :data:`MIN_SEGMENT`
long: the pipeline's drain is then a quarter of the chunk's second phase, not all of it. Measured on
4 hosts at 100 Mbit/s (``bench.hosts``, six runs each): with a chunk of 78 K elements as one
message, 1.09-1.21x the model; cut into 4, 1.09-1.14x. The senders' TCP flows share the links
unevenly, so the owners' chunks do not complete together, and an owner whose whole chunk is one
message cannot start its second phase until its slowest sender is done."""
LOCAL_DEPTH = 1
"""Segments an owner's chunk is cut into at least when every worker of the group reached the
rendezvous over loopback (:attr:`virtualflow.comm.groups.Group.local`): a message is then a copy
by this machine's kernel, not a transfer over a link, so there is no link time for the second
phase to overlap, and every extra message costs its Python call and gloo's rendezvous on cores
the workers share. Measured on a 2-core machine (``bench.deterministic``, the 2.6 M MLP, gloo over
loopback): the ``owners`` exchange alone at W = 3 cost 32.0-32.1 ms of CPU uncut against
33.8-35.5 ms cut in 4, its point-to-point floor being 30.2-31.8 ms; the deterministic step at W = 3
61.5-62.6 ms against 64.0-64.7 ms, at W = 4 67.3-75.4 ms against 76.5-78.7 ms, at W = 2 even."""
MIN_SEGMENT = 1 << 14
"""Elements (64 KiB of float32) below which :data:`DEPTH` cuts no further: a smaller message's
Python call and rendezvous cost more than the pipelining saves, even on a fast link."""

@dataclass(frozen=True, slots=True)
class Unit:
    """One message of the exchange: elements ``[lo, hi)`` of a partial, for ``owner``, inside
    piece number ``piece`` (in launch order)."""

    owner: int
    lo: int
    hi: int
    piece: int = 0


@dataclass(frozen=True, slots=True)
class Traffic:
    """Bytes and messages one worker sends and receives in one exchange or collective (also
    :func:`virtualflow.comm.ring.ring_traffic`'s)."""

    bytes_sent: int
    bytes_received: int
    messages_sent: int
    messages_received: int


def depth_for(local: bool) -> int:
    """Segments an owner's chunk is cut into at least: :data:`LOCAL_DEPTH` when every worker of the
    group shares this machine's network stack, else :data:`DEPTH`."""
    return LOCAL_DEPTH if local else DEPTH


def units(bounds: Sequence[tuple[int, int]], pieces: Sequence[tuple[int, int]] | None = None,
          segment: int | None = None, depth: int = DEPTH) -> list[Unit]:
    """The messages every partial is cut into: each piece (in launch order) split by the owners'
    chunks, empty parts dropped, each part cut into as few near-even segments of at most
    :func:`segment_for` its owner's chunk elements as it takes (``segment`` None: not cut).
    ``pieces`` must cover ``[0, numel)`` exactly once (any order); None: the whole vector as one
    piece."""
    numel = bounds[-1][1] if bounds else 0
    if pieces is None:
        pieces = [(0, numel)]
    if segment is not None and segment < 1:
        raise ValueError(f"owner exchange: segment={segment} elements per message must be at least 1")
    if depth < 1:
        raise ValueError(f"owner exchange: depth={depth} segments per owner's chunk must be at least 1")
    covered = sorted(pieces)
    at = 0
    for lo, hi in covered:
        if lo != at or hi < lo:
            raise ValueError(f"exchange pieces {list(pieces)} do not cover [0, {numel}) exactly once")
        at = hi
    if at != numel:
        raise ValueError(f"exchange pieces {list(pieces)} do not cover [0, {numel}) exactly once")
    sizes = [None if segment is None else segment_for(b - a, segment, depth) for a, b in bounds]
    out = []
    for p, (lo, hi) in enumerate(pieces):
        for o, (a, b) in enumerate(bounds):
            a2, b2 = max(a, lo), min(b, hi)
            if a2 < b2:
                out.extend(Unit(o, x, y, p) for x, y in _segments(a2, b2, sizes[o]))
    return out


def segment_for(chunk: int, segment: int, depth: int = DEPTH) -> int:
    """The longest message for an owner's chunk of ``chunk`` elements: ``segment`` at most, and
    short enough to cut the chunk into ``depth`` messages unless they would fall below
    :data:`MIN_SEGMENT`."""
    return min(segment, max(MIN_SEGMENT, -(-chunk // depth)))


def _segments(lo: int, hi: int, segment: int | None) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into ``ceil((hi - lo) / segment)`` near-even consecutive ranges."""
    count = 1 if segment is None else -(-(hi - lo) // segment)
    base, extra = divmod(hi - lo, count)
    out, at = [], lo
    for i in range(count):
        nxt = at + base + (1 if i < extra else 0)
        out.append((at, nxt))
        at = nxt
    return out


def gather_parts(bounds: Sequence[tuple[int, int]], gather: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Per owner, the parts of its chunk inside the ``gather`` ranges (what it sends to everyone)."""
    return [_overlaps(a, b, gather) for a, b in bounds]


@dataclass(frozen=True)
class OwnerSchedule:
    """Every message of one ``owners`` exchange, for one VN map and vector layout."""

    plan: TreePlan
    bounds: tuple[tuple[int, int], ...]
    units: tuple[Unit, ...]
    gather: tuple[tuple[int, int], ...]

    @classmethod
    def build(cls, plan: TreePlan, numel: int, *, bounds: Sequence[tuple[int, int]] | None = None,
              pieces: Sequence[tuple[int, int]] | None = None,
              gather: Sequence[tuple[int, int]] | None = None, segment: int | None = SEGMENT,
              depth: int = DEPTH) -> "OwnerSchedule":
        """``segment``: elements per message at most (:data:`SEGMENT`; None: one message per
        piece and owner); ``depth``: segments an owner's chunk is cut into at least
        (:func:`depth_for`)."""
        workers = len(plan.per_worker)
        b = list(bounds) if bounds is not None else shard_bounds(numel, workers)
        if len(b) != workers:
            raise ValueError(f"owner exchange: {len(b)} chunks for {workers} workers; pass one (lo, hi) per worker")
        check_bounds(b, numel)
        g = [(0, numel)] if gather is None else [(lo, hi) for lo, hi in gather if hi > lo]
        for lo, hi in g:
            if not 0 <= lo < hi <= numel:
                raise ValueError(f"owner exchange: gather range [{lo}, {hi}) is outside the vector [0, {numel})")
        return cls(plan, tuple(b), tuple(units(b, pieces, segment, depth)), tuple(g))

    @property
    def workers(self) -> int:
        return len(self.plan.per_worker)

    @property
    def numel(self) -> int:
        return self.bounds[-1][1]

    def slot_index(self) -> dict[Node, int]:
        return {node: i for i, node in enumerate(self.plan.slots)}

    def owner_of(self) -> dict[Node, int]:
        """The worker that computes each slot."""
        return {node: w for w, nodes in enumerate(self.plan.per_worker) for node in nodes}

    def send_order(self, rank: int) -> list[int]:
        """The indices of the units worker ``rank`` sends to other owners, in the order it sends
        them: piece by piece in launch order; inside a piece, the first segment for every owner,
        then the second, ...; at each segment the owners after ``rank`` first (``rank + 1``,
        ``rank + 2``, ... round the ring), so the workers do not all start with the same owner.
        Each owner gets its units in unit order (what it combines them in)."""
        w = self.workers
        seen: dict[tuple[int, int], int] = {}
        keyed = []
        for j, u in enumerate(self.units):
            if u.owner == rank:
                continue
            nth = seen[(u.piece, u.owner)] = seen.get((u.piece, u.owner), -1) + 1
            keyed.append(((u.piece, nth, (u.owner - rank) % w), j))
        return [j for _, j in sorted(keyed)]

    def gathers(self, owner: int) -> list[tuple[int, int, int]]:
        """The messages ``owner`` sends to every other worker in the second phase, in order:
        ``(unit, lo, hi)``, each unit of its chunk's part inside ``gather`` (sent as soon as that
        unit is combined)."""
        out = []
        for j, u in enumerate(self.units):
            if u.owner == owner:
                out.extend((j, lo, hi) for lo, hi in _overlaps(u.lo, u.hi, self.gather))
        return out

    def traffic(self, rank: int, itemsize: int) -> Traffic:
        """What worker ``rank`` sends and receives, counted message by message."""
        mine = self.plan.per_worker[rank]
        n_slots = len(self.plan.slots)
        foreign = n_slots - len(mine)
        to_others = [u for u in self.units if u.owner != rank]
        to_me = [u for u in self.units if u.owner == rank]
        gathers = [self.gathers(o) for o in range(self.workers)]
        w = self.workers
        sent = len(mine) * sum(u.hi - u.lo for u in to_others) + (w - 1) * sum(b - a for _, a, b in gathers[rank])
        received = foreign * sum(u.hi - u.lo for u in to_me) + sum(
            b - a for o in range(w) if o != rank for _, a, b in gathers[o])
        msent = len(mine) * len(to_others) + (w - 1) * len(gathers[rank])
        mrecv = foreign * len(to_me) + sum(len(gathers[o]) for o in range(w) if o != rank)
        return Traffic(sent * itemsize, received * itemsize, msent, mrecv)


def _overlaps(lo: int, hi: int, ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The non-empty parts of ``[lo, hi)`` inside each of ``ranges``, in their order."""
    out = []
    for a, b in ranges:
        a2, b2 = max(a, lo), min(b, hi)
        if a2 < b2:
            out.append((a2, b2))
    return out


def owners_traffic_closed_form(plan: TreePlan, numel: int, rank: int, itemsize: int,
                               bounds: Sequence[tuple[int, int]] | None = None,
                               gather: Sequence[tuple[int, int]] | None = None) -> tuple[int, int]:
    """(bytes sent, bytes received) of worker ``rank`` in the ``owners`` exchange, from the
    closed form in the module docstring (independent of how the vector is cut into units)."""
    w = len(plan.per_worker)
    b = list(bounds) if bounds is not None else shard_bounds(numel, w)
    g = gather_parts(b, [(0, numel)] if gather is None else gather)
    n = [hi - lo for lo, hi in b]
    gs = [sum(hi - lo for lo, hi in parts) for parts in g]
    k = len(plan.per_worker[rank])
    s = len(plan.slots)
    sent = k * (numel - n[rank]) + (w - 1) * gs[rank]
    received = (s - k) * n[rank] + (sum(gs) - gs[rank])
    return sent * itemsize, received * itemsize


def owners_seconds(schedule: OwnerSchedule, itemsize: int, direction: Callable[[float, float], float]) -> float:
    """Seconds the ``owners`` exchange's bytes need on the links (a model, without the messages'
    latency), with the second phase pipelined per unit as :mod:`virtualflow.comm.exchange` runs
    it. Every worker has its own link (to a switch); ``direction(out, in)``: the seconds one
    direction of a link needs to carry ``out`` bytes while ``in`` bytes come the other way (their
    acknowledgements ride on it). With ``L(a, b) = max(direction(a, b), direction(b, a))``, the
    busier direction of a link sending ``a`` and receiving ``b``::

        T = max( max_r L(sent_r, received_r),                      every byte over every link
                 max_r L(first_sent_r, first_received_r)          the first phase, then
                 + max_r L((W - 1) * last_r, sum_(o != r) last_o) )  the last unit's second phase

    (``first_*``: the partials' units, the first phase; ``last_r``: the gathered bytes of owner
    ``r``'s last unit.) The second phase of every other unit overlaps the first phase's later
    units, so the pipeline costs one unit's second phase at the end: with each chunk cut into
    :data:`DEPTH` segments or more that is below the first term unless the chunks are shorter than
    a few :data:`MIN_SEGMENT`. The
    unpipelined schedule (every owner waits for its whole chunk) would add the whole second phase
    instead, and an owner whose chunk completes last delays everyone by its second phase."""
    w = schedule.workers
    slots = len(schedule.plan.slots)

    def link(out: float, into: float) -> float:
        return max(direction(out, into), direction(into, out))

    total, first, last = [], [], []
    for r in range(w):
        t = schedule.traffic(r, itemsize)
        total.append(link(t.bytes_sent, t.bytes_received))
        k = len(schedule.plan.per_worker[r])
        out = k * sum(u.hi - u.lo for u in schedule.units if u.owner != r) * itemsize
        into = (slots - k) * sum(u.hi - u.lo for u in schedule.units if u.owner == r) * itemsize
        first.append(link(out, into))
        g = schedule.gathers(r)
        tail = [(lo, hi) for j, lo, hi in g if j == g[-1][0]] if g else []
        last.append(sum(hi - lo for lo, hi in tail) * itemsize)
    drain = max(link((w - 1) * last[r], sum(last) - last[r]) for r in range(w))
    return max(max(total), max(first) + drain)


def ring_allreduce_bytes(numel: int, workers: int, rank: int, itemsize: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``numel`` elements over even chunks
    (reduce-scatter then all-gather: every chunk but one, twice)."""
    if workers < 2:
        return 0
    b = shard_bounds(numel, workers)
    n = [hi - lo for lo, hi in b]
    return (2 * numel - n[rank] - n[(rank + 1) % workers]) * itemsize


def slots_traffic(plan: TreePlan, numel: int, rank: int, itemsize: int) -> int:
    """Bytes one rank sends in the ``slots`` exchange: a ring all-reduce of ``S x numel``."""
    return ring_allreduce_bytes(len(plan.slots) * numel, len(plan.per_worker), rank, itemsize)


def choose_exchange(plan: TreePlan, numel: int, itemsize: int, asked: str = "auto") -> tuple[str, str]:
    """The exchange to run for this VN map and vector (``asked``: the ``deterministic_exchange``
    knob) and the reason, for the run's events."""
    if asked not in EXCHANGES:
        raise ValueError(f"deterministic_exchange={asked!r} is not one of {', '.join(EXCHANGES)} "
                         f"(--deterministic-exchange)")
    w = len(plan.per_worker)
    if w < 2:
        return "owners", "one worker: nothing is exchanged"
    worst_new = max(owners_traffic_closed_form(plan, numel, r, itemsize)[0] for r in range(w))
    worst_old = max(slots_traffic(plan, numel, r, itemsize) for r in range(w))
    figures = (f"{w} workers, {len(plan.slots)} partial sums of {numel * itemsize / 2**20:.2f} MiB: "
               f"owners sends at most {worst_new / 2**20:.2f} MiB per worker, slots {worst_old / 2**20:.2f} MiB")
    if asked != "auto":
        return asked, f"asked for (--deterministic-exchange {asked}); {figures}"
    return "owners", f"fewer bytes ({figures}); slots was not faster at any size measured (bench.deterministic)"
