"""Process-group generations over a shared TCPStore.

Every membership generation ``g`` gets a fresh group built on ``PrefixStore(f"gen/{g}", store)``:
prefixes are never reused, so no key of an old generation can be read by a new one. Groups are
constructed directly (not through ``init_process_group``), so one process can hold several
generations over its life and two jobs can live in one process.

A collective that fails because a peer died, hung or left raises :class:`PeerFailure`, so the
worker can tell "the group is broken, regroup" from an error in the user's own code.

Invariant: no receive, send, collective or close outlives its generation. gloo has no abort, and
a dead peer is not enough to unblock everyone: a dead peer's connections are closed by its kernel,
so the operations waiting on *them* fail at once, but an operation waiting on a *live* peer that
has left the generation waits for the whole timeout (measured: 120 s), and so does the gloo
destructor of a group with such an operation in flight. Nor does dropping a group close its
connections: gloo closes them only when the last reference to its context goes, and a posted
receive's work object holds one (measured: a receive left waiting on a thread keeps the peer's
receive from this process blocked until the timeout, although the group was shut down and
dropped; a reference cycle through a stored exception's traceback keeps it until Python's cyclic
collector happens to run, which is why such stalls came and went). So a group remembers its own
TCP connections when it is built (the sockets this process opened while gloo connected the full
mesh, :class:`~virtualflow.comm.connections.Connections`) and :meth:`Group.abort` shuts them down (``shutdown(2)``, the socket
stays gloo's to close): every operation of this process on the group, and every operation of a
peer on a connection with this process, fails at once with "Connection closed by peer", exactly
as when a process is killed. :meth:`Group.close` aborts first, so a close never waits for an
operation in flight.

Who aborts. A member that gives up on a generation (a :class:`PeerFailure`, an abort flag, any
exception while forming it) closes its group, which releases every peer waiting on it. Waits do
not depend on that alone: the coordinator's ``gen/<g>/abort`` flag, read through ``abort_check``,
is looked at between short slices of every collective wait and while a point-to-point operation
is waited for (:class:`Arrival`); once it reads True the group aborts itself (the flag is
latched). A silent (stopped) peer is noticed by the coordinator's heartbeats and killed
(fencing). The group's timeout stays the last bound.

Point-to-point waits are *not* sliced: gloo closes the pair when a ``recv`` wait times out
("Application timeout caused pair closure", measured with torch 2.13), so a sliced receive of a
message that takes longer than one slice (a state transfer of a few hundred MB) would break the
group. With an ``abort_check`` such a wait is owned by a daemon thread (:class:`Arrival`) and the
caller watches the flag; giving up aborts the group and then waits for the thread to end, so no
receive is left writing into a buffer its caller has moved on from.

Limits: the connections are known on Linux (``/proc/self/fd``) for gloo groups built eagerly
(the default; ``TORCH_GLOO_LAZY_INIT`` connects later and is not tracked); elsewhere, and for
NCCL, :meth:`Group.abort` is a no-op and the timeouts bound the waits as before. While a group is
built, sockets opened by other threads of the process would be taken for the group's; the worker
opens none then except a heartbeat's reconnection to the store, which is excluded by its port.
Groups built at the same time in one process (ranks run as threads) track nothing: their
sockets cannot be told apart, so an abort shuts none down; the threaded runner
(:mod:`virtualflow.runtime.grid_threads`) shuts a broken generation's connections down itself.
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from virtualflow.comm.connections import NATIVE, Connections
from virtualflow.comm.net import loopback_store
from virtualflow.config.network import is_ip

logger = logging.getLogger("virtualflow")

WAIT_SLICE_S = 0.05
"""A collective wait's slice: how often a waiting member reads the abort flag."""
CLOSE_WAIT_S = 2.0
"""How long :meth:`Group.close` waits for gloo to release a group before moving on."""
ARRIVAL_POLL_S = 0.2
"""How often a point-to-point wait with an ``abort_check`` reads the abort flag."""
DRAIN_S = 10.0
"""After an abort, how long a give-up waits for the operation itself to end (it fails within
milliseconds once the connections are shut down; the bound covers an untracked group)."""


class PeerFailure(RuntimeError):
    """A collective of generation ``generation`` failed: a peer died, hung or left."""

    def __init__(self, generation: int, message: str) -> None:
        super().__init__(f"collective of generation {generation} failed: {message}")
        self.generation = generation


class _Builds:
    """Which gloo builds of this process overlapped in time. The sockets a build finds new are its
    own only when no other build ran meanwhile; overlapping builds (ranks of one group run as
    threads of one process, as some tests do) cannot tell theirs apart, so they track none and
    fall back to the timeouts. Builds must not take turns instead: the ranks of one group in one
    process connect to each other inside the build, so turns would deadlock them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._started = 0

    def begin(self) -> tuple[int, bool]:
        with self._lock:
            self._running += 1
            self._started += 1
            return self._started, self._running > 1

    def end(self, started: int, overlapped: bool) -> bool:
        """Ends the build that :meth:`begin` returned ``(started, overlapped)`` for; True when it
        ran alone (its new sockets are its own)."""
        with self._lock:
            self._running -= 1
            return not overlapped and self._started == started


_BUILDS = _Builds()


@dataclass(slots=True)
class Group:
    """One generation's process group, or a trivial one for a single worker."""

    generation: int
    rank: int
    size: int
    pg: dist.ProcessGroup | None
    on_launch: Callable[[], None] | None = None
    """Test hook (fault injection): called after a blocking collective is launched, before it is
    waited on, i.e. while the peers are inside it."""
    connections: Connections = field(default_factory=Connections)
    """This group's TCP connections (what :meth:`abort` shuts down)."""
    local: bool = False
    """Every member reached the rendezvous store over loopback, so all share this machine's network
    stack: a message between them is a copy by the kernel, not a transfer over a link (the
    ``owners`` exchange cuts its messages by it: :func:`virtualflow.plan.exchange.depth_for`). The
    same on every member: each votes before the group is built, and the count is read once the
    group is up, when every member has voted. False for NCCL groups and stores other than TCP."""
    _check: Callable[[], bool] | None = field(default=None, repr=False)
    _broken: bool = field(default=False, repr=False)

    @property
    def abort_check(self) -> Callable[[], bool] | None:
        """Asked while waiting: True when the coordinator has declared this generation broken.
        Reading True aborts the group (:meth:`abort`) and is remembered. Set it to the raw check
        (e.g. a read of the ``gen/<g>/abort`` flag); reading gives the aborting one."""
        return None if self._check is None else self._broken_now

    @abort_check.setter
    def abort_check(self, check: Callable[[], bool] | None) -> None:
        self._check = check

    def _broken_now(self) -> bool:
        if not self._broken and self._check is not None and self._check():
            self._broken = True
            self.abort()
        return self._broken

    def abort(self) -> None:
        """Give up on this generation now: shut its connections down, so every operation of this
        process on the group and every operation of a peer on a connection with this process ends
        at once with a :class:`PeerFailure` (the process group itself is released by
        :meth:`close`)."""
        self.connections.shut_down()

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False):
        if self.pg is None:
            return _Done() if async_op else None
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        try:
            work = self.pg.allreduce([tensor], opts)
        except RuntimeError as exc:
            raise PeerFailure(self.generation, str(exc)) from exc
        if async_op:
            return _Work(work, self, sliced=True)
        if self.on_launch is not None:
            self.on_launch()
        _Work(work, self, sliced=True).wait()
        return None

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        if self.pg is None:
            return
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        try:
            work = self.pg.broadcast([tensor], opts)
        except RuntimeError as exc:
            raise PeerFailure(self.generation, str(exc)) from exc
        if self.on_launch is not None:
            self.on_launch()
        _Work(work, self, sliced=True).wait()

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Send ``tensor`` and wait until it is out; with an ``abort_check``, given up (the group
        aborted) when the generation is declared broken."""
        self._await(self.isend(tensor, dst, tag), "send")

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> "_Work":
        """Start sending ``tensor``; the caller keeps it alive and waits on the returned work."""
        if self.pg is None:
            raise PeerFailure(self.generation, "send on a closed group")
        try:
            work = self.pg.send([tensor], dst, tag)
        except RuntimeError as exc:
            raise PeerFailure(self.generation, str(exc)) from exc
        return _Work(work, self, sliced=False)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> "_Work":
        """Post a receive into ``tensor``; wait on the returned work (unsliced, see above)."""
        if self.pg is None:
            raise PeerFailure(self.generation, "receive on a closed group")
        try:
            work = self.pg.recv([tensor], src, tag)
        except RuntimeError as exc:
            raise PeerFailure(self.generation, str(exc)) from exc
        return _Work(work, self, sliced=False)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        """Receive into ``tensor``; with an ``abort_check``, given up (the group aborted) when the
        generation is declared broken: a receive from a live peer that has itself left the
        generation would otherwise block until the group's timeout."""
        self._await(self.irecv(tensor, src, tag), "receive")

    def _await(self, work: "_Work", what: str) -> None:
        if self._check is None:
            work.wait()
        else:
            Arrival(work).wait(self, what)

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Leave the generation: abort it (no operation in flight can hold the close or a peer),
        then release the process group (best effort; a broken group may refuse), waiting at most
        ``wait_s`` for the release.

        The release runs on a daemon thread: gloo's ``shutdown`` and destructor wait for an
        operation still in flight, which the abort ends only where it knows every connection the
        operation waits on. Seen once in about twenty-five runs of a healed partition
        (tests/e2e/test_host_faults.py): a fenced worker's close waited in gloo's destructor for
        its group's whole timeout after the abort, and the worker, which had nothing left to do but
        exit, did not. A release that does not end within ``wait_s`` goes on after the caller has
        moved on; it holds nothing the caller uses (a new generation is a new group on a fresh
        prefix) and ends at the group's timeout at the latest."""
        self.abort()
        pg, self.pg = self.pg, None
        if pg is None:
            return
        done = threading.Event()

        def release(held: list) -> None:
            with NATIVE:
                try:
                    held[0].shutdown()
                except Exception:
                    pass
                held.clear()  # the last reference: gloo's destructor runs here, not in the caller
            done.set()

        held = [pg]
        del pg
        threading.Thread(target=release, args=(held,), daemon=True, name="vf-close-group").start()
        del held
        done.wait(wait_s)

    def close_soon(self, wait_s: float = 0.5) -> None:
        """:meth:`close` with a shorter bound (a pipeline's stage groups, several per step)."""
        self.close(wait_s)


class _Waiters:
    """The daemon threads :class:`Arrival` waits on, kept and reused: starting a thread makes the
    caller wait until the new thread has run (``Thread.start`` waits for it to signal), which on a
    busy 2-core machine is a scheduler slice per wait (1-2 % of a deterministic step's time,
    sampled). A thread whose wait never ends (a message that never comes, a group not aborted)
    is simply not reused; at most :attr:`KEEP` idle threads are kept."""

    KEEP = 64

    def __init__(self) -> None:
        self._idle: list[queue.SimpleQueue] = []
        self._lock = threading.Lock()

    def run(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on an idle waiter thread, or a new one."""
        with self._lock:
            jobs = self._idle.pop() if self._idle else None
        if jobs is None:
            jobs = queue.SimpleQueue()
            threading.Thread(target=self._loop, args=(jobs,), daemon=True, name="vf-recv-arrival").start()
        jobs.put(fn)

    def _loop(self, jobs: queue.SimpleQueue) -> None:
        while True:
            jobs.get()()
            with self._lock:
                if len(self._idle) >= self.KEEP:
                    return
                self._idle.append(jobs)


_WAITERS = _Waiters()


class Arrival:
    """The wait of one posted point-to-point operation, owned by a daemon thread, so that the
    waiting side can (1) tell without blocking whether the message is there (gloo's
    point-to-point work reports ``is_completed()`` False until someone waits on it, measured) and
    (2) give up on it when the coordinator declares the generation broken (a timed wait on a gloo
    point-to-point receive breaks the pair, measured). Giving up aborts the group, which ends the
    thread's wait at once (:meth:`Group.abort`); the thread is waited for before the give-up is
    raised, so it never writes into the buffer afterwards."""

    __slots__ = ("done", "error")

    def __init__(self, work: Any) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None
        _WAITERS.run(lambda: self._wait(work))

    def _wait(self, work: Any) -> None:
        try:
            work.wait()
        except BaseException as exc:  # handed to the waiting thread
            self.error = exc
        finally:
            self.done.set()

    def wait(self, group: Group, what: str = "receive") -> None:
        if not self.done.wait(0.05):
            check = group.abort_check
            while not self.done.wait(ARRIVAL_POLL_S):  # short waits: the abort flag is read in between
                if check is not None and check():  # the group is aborted: the wait ends at once
                    if not self.done.wait(DRAIN_S):
                        logger.warning("generation %d: a %s on the aborted group did not end within %.0f s "
                                       "(its connections were not shut down); giving it up anyway",
                                       group.generation, what, DRAIN_S)
                    raise PeerFailure(group.generation, f"the coordinator declared the generation broken (a member "
                                                        f"failed) during a {what}")
        if self.error is not None:
            if isinstance(self.error, RuntimeError) and not isinstance(self.error, PeerFailure):
                raise PeerFailure(group.generation, _first_line(str(self.error))) from self.error
            raise self.error


class _Work:
    __slots__ = ("work", "group", "sliced")

    def __init__(self, work: Any, group: Group, sliced: bool) -> None:
        self.work = work
        self.group = group
        self.sliced = sliced

    @property
    def generation(self) -> int:
        return self.group.generation

    def wait(self) -> bool:
        with NATIVE:  # (a thread waiting here must not outlive a run that cut its connections)
            return self._wait()

    def _wait(self) -> bool:
        group = self.group
        check = group.abort_check if self.sliced else None
        if check is None:
            try:
                return self.work.wait()
            except RuntimeError as exc:
                raise PeerFailure(group.generation, _first_line(str(exc))) from exc
        # A gloo *collective* can be waited on again after a wait times out (measured), so a long
        # wait is a loop of short ones with a look at the abort flag in between. An expired slice
        # reads "Operation timed out!"; the group's own timeout reads "Timed out waiting <T>ms".
        while True:
            try:
                return self.work.wait(_SLICE)
            except RuntimeError as exc:
                text = str(exc)
                if not _is_slice_expiry(text):
                    raise PeerFailure(group.generation, _first_line(text)) from exc
            if check():  # the group is aborted: the collective fails at once; wait for that
                self._drain()
                raise PeerFailure(group.generation, "the coordinator declared the generation broken "
                                                    "(a member failed)")

    def _drain(self) -> None:
        """Wait (bounded) for an aborted collective to end, so that it does not outlive the give-up."""
        if not len(self.group.connections):
            return  # nothing was shut down: it would end only at the group's timeout
        for _ in range(int(DRAIN_S / WAIT_SLICE_S)):
            try:
                self.work.wait(_SLICE)
                return
            except RuntimeError as exc:
                if not _is_slice_expiry(str(exc)):
                    return


_SLICE = datetime.timedelta(seconds=WAIT_SLICE_S)


def _is_slice_expiry(text: str) -> bool:
    return "timed out" in text.lower() and "Timed out waiting" not in text


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else text
    return line[:300]


class _Done:
    def wait(self) -> bool:
        return True


def make_subgroup(store: dist.Store, generation: int, name: str, rank: int, size: int, timeout_s: float,
                  device: torch.device, *, bind: Sequence[str] | None = None, duplex: bool = False) -> Group:
    """A group of some members of generation ``generation`` (e.g. the replicas of one pipeline
    stage), on its own fresh prefix ``gen/<g>/<name>``. ``duplex``: see :func:`make_group`."""
    return _build(store, f"gen/{generation}/{name}", generation, rank, size, timeout_s, device, bind, duplex)


def make_group(
    store: dist.Store, generation: int, rank: int, size: int, timeout_s: float, device: torch.device, *,
    bind: Sequence[str] | None = None, duplex: bool = False,
) -> Group:
    """Build generation ``generation``'s group (gloo on CPU, NCCL on CUDA).

    ``bind``: the addresses (or, off Linux, interface names) of this machine gloo listens on and
    tells its peers (:func:`virtualflow.comm.net.resolve_interface`); None: gloo's own choice
    (``GLOO_SOCKET_IFNAME``, else the address the host name resolves to). ``duplex`` (gloo): two
    devices per address, so that gloo opens two connections between each pair of members and a
    message whose tag is odd travels on the second (a pipeline's driver puts each direction of a
    link on its own connection: sends both ways at once on one connection stall each other)."""
    return _build(store, f"gen/{generation}", generation, rank, size, timeout_s, device, bind, duplex)


def gloo_options(timeout: datetime.timedelta, bind: Sequence[str] | None, duplex: bool = False) -> Any:
    """gloo's options with one device per address (or interface name) in ``bind`` (None: gloo's
    default device), each twice with ``duplex``."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    copies = 2 if duplex else 1
    if not bind:
        opts._devices = [dist.ProcessGroupGloo.create_default_device() for _ in range(copies)]
        return opts
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=a) if is_ip(a)
                     else dist.ProcessGroupGloo.create_device(interface=a) for a in bind for _ in range(copies)]
    return opts


_REMOTE_VOTES = "vf/remote_members"
"""Key, in a group's own prefix, counting the members that reached the store other than over
loopback (:attr:`Group.local`)."""


def _build(store: dist.Store, prefix_name: str, generation: int, rank: int, size: int, timeout_s: float,
           device: torch.device, bind: Sequence[str] | None = None, duplex: bool = False) -> Group:
    if size == 1:
        return Group(generation, 0, 1, None)
    prefix = dist.PrefixStore(prefix_name, store)
    timeout = datetime.timedelta(seconds=timeout_s)
    connections = Connections()
    local = False
    try:
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefix, rank, size, opts)
        else:
            prefix.add(_REMOTE_VOTES, 0 if loopback_store(store) else 1)  # before this member's gloo rendezvous
            ticket = _BUILDS.begin()
            alone = False
            try:
                before = Connections.snapshot()
                pg = (dist.ProcessGroupGloo(prefix, rank, size, gloo_options(timeout, bind, duplex)) if bind or duplex
                      else dist.ProcessGroupGloo(prefix, rank, size, timeout))
                after = Connections.snapshot()
            finally:
                alone = _BUILDS.end(*ticket)
            if alone:
                port = getattr(store, "port", None)
                connections = Connections.opened_between(before, after, port if isinstance(port, int) else None)
            # the group is up, so every member has voted (each votes before its rendezvous)
            local = prefix.add(_REMOTE_VOTES, 0) == 0
    except RuntimeError as exc:  # a peer died or vanished while the group was being built
        raise PeerFailure(generation, _first_line(str(exc))) from exc
    return Group(generation, rank, size, pg, connections=connections, local=local)
