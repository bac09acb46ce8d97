"""The ``owners`` deterministic exchange over point-to-point messages.

The schedule (who sends which unit of which partial to whom, and the traffic it costs) is pure
and lives in :mod:`virtualflow.plan.exchange`; this module runs it on a :class:`Group`:

1. :meth:`OwnerExchange.begin` posts every receive of the step: this worker's units of each
   partial sum other workers hold, and the other owners' units of the root in the gathered
   ranges. Receives are posted before any send, so a message never waits for its receive.
2. :meth:`OwnerExchange.send` sends a partial's units to their owners as soon as the partial (or
   one piece of it: a gradient bucket the last backward just finished) is final, in the
   schedule's send order (each worker starts with the next owner after itself). Sends are
   asynchronous: they overlap with the VNs still to run. gloo writes a message into the socket
   on the thread that starts the send, so the sends of CPU tensors are started by the
   exchange's own thread (:class:`_Sender`), in the order they are handed over.
3. :meth:`OwnerExchange.finish` goes through this worker's units in order: it waits for every
   slot's message of the unit, combines the unit along the fixed tree (the same additions,
   element for element, as :func:`tree_exchange` on the whole vector, so the root is
   bit-identical: the additions are element-wise, however the vector is cut) and sends the
   unit's root to every other worker at once, while its later units are still arriving (the
   second phase is pipelined per unit; :func:`~virtualflow.plan.exchange.owners_seconds` models
   it). Then it waits for the other owners' units of the root, each arriving on its own.

Every worker must call ``begin``, ``send`` for each of its partials (every unit exactly once) and
``finish`` in every step; the order of the sends does not matter to the receivers (each message
has its own tag). A worker with no VN holds no partial: it still owns a chunk, combines it and
sends it on. Tags: ``TAG_BASE`` plus the step's parity (two consecutive steps never share a tag)
plus the message's index; they do not meet the other tags used on the worker's group (state
transfer 1.., gathers 17-18, the ring 2**30..).

Waiting: with an ``abort_check`` on the group (a worker), each unit's receives are waited for on
a daemon thread (:class:`~virtualflow.comm.groups.Arrival`) while the caller watches the
coordinator's abort flag, as every point-to-point wait of a worker does.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Sequence

import torch

from virtualflow.comm.groups import Arrival, Group
from virtualflow.plan.exchange import OwnerSchedule
from virtualflow.plan.vnmap import Node, split

TAG_BASE = 1 << 29
_PARITY = 1 << 27
_GATHER = 1 << 26
SENDER_IDLE_S = 10.0
"""A send thread with nothing to send for this long ends (a new one starts with the next send)."""


class _All:
    """Several works waited for in order, as one (what :class:`Arrival` waits for)."""

    __slots__ = ("works",)

    def __init__(self, works: Sequence[Any]) -> None:
        self.works = list(works)

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True


class _Sender:
    """A daemon thread that starts one exchange's sends, in the order they are handed over.

    gloo's ``send`` writes into the socket on the caller's thread until the socket's buffer is
    full (measured over loopback: 2.1 ms of a 6.8 MB message's 3.0 ms are spent inside the call).
    The exchange hands its sends here instead, so the step's thread goes on with the next VN's
    forward and backward, or the next unit's combination, while the bytes are written: the
    sends overlap the compute on a machine with a core to spare. The sends of a step are still
    started in the order the exchange hands them over, so the order of the messages on each
    connection is what it was; which bytes are sent is unchanged (same vectors, same tags)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self._works: list[Any] = []
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def post(self, group: Group, tensor: torch.Tensor, dst: int, tag: int) -> None:
        """Start ``group.isend(tensor, dst, tag)`` on the thread (the caller keeps ``tensor`` unchanged
        until :meth:`drain`). A device tensor's send is started here: NCCL's is queued on a stream
        and returns at once, and a communicator is not to be driven from two threads."""
        if tensor.device.type != "cpu":
            work = group.isend(tensor, dst, tag)
            with self._lock:
                self._works.append(work)
            return
        with self._lock:
            self._pending += 1
            if self._thread is None:  # (each thread has its own queue: a stale stop never reaches the next)
                self._jobs = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._loop, args=(self._jobs,), daemon=True,
                                                name="vf-exchange-send")
                self._thread.start()
            jobs = self._jobs
        jobs.put((group, tensor, dst, tag))

    def _loop(self, jobs: queue.SimpleQueue) -> None:
        while True:
            try:
                job = jobs.get(timeout=SENDER_IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._thread is not threading.current_thread():
                        continue  # closed meanwhile: its stop is on the way (after any send still queued)
                    if self._pending == 0:  # (an exchange no longer used leaves no thread behind)
                        self._thread = None
                        return
                continue
            if job is None:  # closed
                return
            self._start(*job)
            del job  # (this thread never holds a send's last reference: see _start)

    def _start(self, group: Group, tensor: torch.Tensor, dst: int, tag: int) -> None:
        """Start one send and hand its work over. The work's last reference is dropped by the
        step's thread, never by this one: gloo's work releases the interpreter lock while it is
        destroyed, and a daemon thread that does so as the interpreter exits aborts the process."""
        work, error = None, None
        with self._lock:
            failed = self._error is not None
        if not failed:  # after a failed send the step is lost: the rest are not started
            try:
                work = group.isend(tensor, dst, tag)
            except BaseException as exc:  # handed to the step's thread by drain()
                error = exc
        with self._lock:
            if work is not None:
                self._works.append(work)
                work = None
            if error is not None and self._error is None:
                self._error = error
            self._pending -= 1
            if self._pending == 0:
                self._idle.notify_all()

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop the thread once the sends handed over are started (the exchange is done with;
        a later :meth:`post` starts a new one). A send on an aborted group fails at once, so the
        bound is only a safeguard."""
        with self._lock:
            thread, self._thread, jobs = self._thread, None, self._jobs
        if thread is not None:
            jobs.put(None)
            thread.join(timeout_s)

    def drain(self) -> list[Any]:
        """Wait until every send handed over was started; returns their works (to be waited
        for) and forgets them; raises the first send that failed."""
        with self._lock:
            while self._pending:
                self._idle.wait()
            works, error = self._works, self._error
            self._works, self._error = [], None
        if error is not None:
            raise error
        return works

    def forget(self) -> None:
        """After a failed step: wait until nothing handed over is still being started (a send on
        an aborted group fails at once) and drop the works and the error."""
        try:
            self.drain()
        except BaseException:  # noqa: BLE001 - the step is abandoned anyway
            pass


class OwnerExchange:
    """One worker's side of the ``owners`` exchange for one generation (reused every step)."""

    def __init__(self, schedule: OwnerSchedule, group: Group, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu",
                 pieces_units: Sequence[Sequence[int]] | None = None) -> None:
        """``pieces_units``: per piece of the vector, the indices of its units in
        ``schedule.units`` (what :meth:`send` with ``piece=`` sends)."""
        if len(schedule.plan.per_worker) != group.size:
            raise ValueError(f"owner exchange: the schedule has {len(schedule.plan.per_worker)} workers, the group "
                             f"{group.size}")
        self.schedule = schedule
        self.group = group
        rank = group.rank
        self.rank = rank
        self.mine = tuple(schedule.plan.per_worker[rank])
        self.slot_of = schedule.slot_index()
        self.holder = schedule.owner_of()
        self.lo, self.hi = schedule.bounds[rank]
        self.foreign = [n for n in schedule.plan.slots if n not in set(self.mine)]
        self._row = {n: i for i, n in enumerate(self.foreign)}
        self.to_me = [(j, u) for j, u in enumerate(schedule.units) if u.owner == rank]
        self.out = schedule.send_order(rank)
        at = {j: i for i, j in enumerate(self.out)}
        self.pieces_units = [list(p) for p in pieces_units] if pieces_units is not None else None
        self._piece_out = None if pieces_units is None else [
            sorted((j for j in p if j in at), key=at.__getitem__) for p in pieces_units]
        # Per unit of this worker's chunk: its gather messages (index among this owner's, range).
        self._gather_of: dict[int, list[tuple[int, int, int]]] = {}
        for i, (j, a, b) in enumerate(schedule.gathers(rank)):
            self._gather_of.setdefault(j, []).append((i, a, b))
        self._peers = [(rank + d) % group.size for d in range(1, group.size)]
        self._from_peers = [(o, i, a, b) for o in self._peers for i, (_, a, b) in enumerate(schedule.gathers(o))]
        n = self.hi - self.lo
        # Persistent buffers (fresh ones each step would be faulted in again, page by page).
        self.inbox = torch.empty((len(self.foreign), n), dtype=dtype, device=device)
        self.root = torch.empty(schedule.numel, dtype=dtype, device=device)
        self._spare: torch.Tensor | None = None  # the inner sums' reused buffers (:meth:`_scratch`)
        self._step = 0
        self._recvs: list[list[Any]] = []
        self._gathers: list[Any] = []
        self._sends: list[Any] = []
        self._sender = _Sender()
        self._sent: set[tuple[Node, int]] = set()
        self._open = False

    # -- tags -----------------------------------------------------------------------------------

    def _tag(self, node: Node, unit: int) -> int:
        k = self.slot_of[node] * len(self.schedule.units) + unit
        return TAG_BASE + (self._step % 2) * _PARITY + k % _GATHER

    def _gather_tag(self, index: int) -> int:
        return TAG_BASE + (self._step % 2) * _PARITY + _GATHER + index % _GATHER

    # -- the step -------------------------------------------------------------------------------

    def begin(self) -> None:
        """Post every receive of this step (call before this worker's first send)."""
        if self._open:
            raise RuntimeError("owner exchange: begin() twice without finish()")
        self._open = True
        self._step += 1
        self._sender.forget()  # (a step abandoned after its sends were handed over)
        self._sends, self._sent = [], set()
        g = self.group
        self._recvs = []  # per unit of this worker's chunk, in the order finish() combines them
        for j, u in self.to_me:
            self._recvs.append([g.irecv(self.inbox[self._row[node], u.lo - self.lo:u.hi - self.lo], self.holder[node],
                                        self._tag(node, j)) for node in self.foreign])
        self._gathers = [g.irecv(self.root[a:b], o, self._gather_tag(i)) for o, i, a, b in self._from_peers]

    def send(self, node: Node, vec: torch.Tensor, piece: int | None = None) -> None:
        """Send the units of partial ``node`` (``vec``: the whole vector; only the units' ranges
        are read, and must stay unchanged until :meth:`finish`) to their owners: all of them, or
        those of ``piece``."""
        if not self._open:
            raise RuntimeError("owner exchange: send() before begin()")
        if piece is None:
            todo = self.out
        else:
            if self._piece_out is None:
                raise ValueError("owner exchange: send(piece=) needs the pieces given to the constructor")
            todo = self._piece_out[piece]
        for j in todo:
            if (node, j) in self._sent:
                raise RuntimeError(f"owner exchange: unit {j} of partial {node} sent twice in one step")
        self._send_units(node, vec, todo)

    def finish(self, local: dict[Node, torch.Tensor]) -> torch.Tensor:
        """Combine this worker's chunk unit by unit, sending each unit's root on as soon as it is
        combined, and return the root: a vector (a persistent buffer, valid until the next step)
        whose own chunk and gathered ranges hold the root sum. ``local``: this worker's partials
        (whole vectors), each sent completely."""
        if not self._open:
            raise RuntimeError("owner exchange: finish() before begin()")
        if set(local) != set(self.mine):
            raise ValueError(f"owner exchange: partials {sorted(local)} given, this worker holds {list(self.mine)}")
        for node in self.mine:
            missing = [j for j in self.out if (node, j) not in self._sent]
            if missing:  # not sent piece by piece (yet): send what is left now
                self._send_units(node, local[node], missing)
        g = self.group
        try:
            if g.on_launch is not None:
                g.on_launch()  # fault injection: every message of this worker is out, peers are inside
            for (j, _), recvs in zip(self.to_me, self._recvs):
                self._wait(recvs, "deterministic exchange (partial sums)")
                self._combine_unit(local, j)
                for i, lo, hi in self._gather_of.get(j, ()):
                    for o in self._peers:
                        self._sender.post(g, self.root[lo:hi], o, self._gather_tag(i))
            self._sends = self._sender.drain()
            self._wait(self._gathers + self._sends, "deterministic exchange (root)")
        finally:
            self._open = False
        return self.root

    def _combine_unit(self, local: dict[Node, torch.Tensor], j: int) -> None:
        """Unit ``j`` of this worker's chunk of the root, along the fixed tree (element-wise
        additions: the same bits as the whole vector's)."""
        u = self.schedule.units[j]
        a, b = u.lo - self.lo, u.hi - self.lo
        known: dict[Node, torch.Tensor] = {n: local[n][u.lo:u.hi] for n in self.mine}
        for n in self.foreign:
            known[n] = self.inbox[self._row[n], a:b]
        root, out = (0, self.schedule.plan.virtual_nodes), self.root[u.lo:u.hi]
        if root in known:
            out.copy_(known[root])
        else:  # the additions written into the root and reused buffers (same operands, same bits)
            _combine_into(root, known, out, self._scratch(u.hi - u.lo))

    def _scratch(self, n: int) -> list[torch.Tensor]:
        """Reused buffers of ``n`` elements for the tree's inner sums of a unit: one per tree level
        (the unit's additions write into them and the root, never into fresh tensors: measured at
        25 M parameters on 3 workers, fresh temporaries cost 0.37 CPU-seconds a step, more than
        the default mode's whole all-reduce)."""
        rows = self.schedule.plan.virtual_nodes.bit_length() + 1
        if self._spare is None or self._spare.shape[1] < n:
            self._spare = torch.empty((rows, n), dtype=self.root.dtype, device=self.root.device)
        return [row[:n] for row in self._spare]

    def _send_units(self, node: Node, vec: torch.Tensor, todo: Sequence[int]) -> None:
        for j in todo:
            self._sent.add((node, j))
            u = self.schedule.units[j]
            self._sender.post(self.group, vec[u.lo:u.hi], u.owner, self._tag(node, j))

    def _wait(self, works: list[Any], what: str) -> None:
        if not works:
            return
        if self.group.abort_check is None:
            for w in works:
                w.wait()
        else:
            Arrival(_All(works)).wait(self.group, what)

    def abandon(self) -> None:
        """Forget a step that failed (the group is broken; nothing more is sent or waited)."""
        self._open = False
        self._recvs, self._gathers, self._sends = [], [], []

    def close(self) -> None:
        """:meth:`abandon`, and the send thread stops (the generation is over)."""
        self.abandon()
        self._sender.close()


def _combine_into(node: Node, known: dict[Node, torch.Tensor], out: torch.Tensor, scratch: Sequence[torch.Tensor],
                  depth: int = 0) -> torch.Tensor:
    """:func:`_combine` of ``node`` (not in ``known``) written into ``out``: the left child's sum
    goes into ``out`` itself, the right child's into ``scratch[depth]`` (its own inner sums deeper),
    then ``out = left + right``: the same additions, in the same order, as :func:`_combine`."""
    left, right = split(node)
    a = known[left] if left in known else _combine_into(left, known, out, scratch, depth)
    b = known[right] if right in known else _combine_into(right, known, scratch[depth], scratch, depth + 1)
    return torch.add(a, b, out=out)


def _combine(node: Node, known: dict[Node, torch.Tensor]) -> torch.Tensor:
    """The fixed tree's sum of ``node`` from the slots in ``known`` (as :func:`tree_exchange`)."""
    if node in known:
        return known[node]
    left, right = split(node)
    return _combine(left, known) + _combine(right, known)


def owner_exchange(schedule: OwnerSchedule, group: Group, local: dict[Node, torch.Tensor],
                   like: torch.Tensor | None = None) -> torch.Tensor:
    """One whole ``owners`` exchange (no overlap): every worker gets the root sum in its own chunk
    and the gathered ranges, bit-identical to :func:`~virtualflow.comm.reduce.tree_exchange`.
    ``like`` gives the dtype and device to a worker with no partial."""
    plan = schedule.plan
    if group.size == 1:
        return local[(0, plan.virtual_nodes)]
    some = next(iter(local.values())) if local else like
    if some is None:
        raise ValueError("owner_exchange: a worker without virtual nodes must pass like= (one node's shape)")
    ex = OwnerExchange(schedule, group, dtype=some.dtype, device=some.device)
    try:
        ex.begin()
        for node, vec in local.items():
            ex.send(node, vec)
        return ex.finish(local).clone()
    finally:
        ex.close()
