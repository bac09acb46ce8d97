"""Process-group generations over a shared TCPStore.

Every membership generation ``g`` gets a fresh group built on ``PrefixStore(f"gen/{g}", store)``:
prefixes are never reused, so no key of an old generation can be read by a new one. Groups are
constructed directly (not through ``init_process_group``), so one process can hold several
generations over its life and two jobs can live in one process.

A collective that fails because a peer died, hung or left raises :class:`PeerFailure`, so the
worker can tell "the group is broken, regroup" from an error in the user's own code. gloo has no
abort, and a dead peer is not enough to unblock everyone: in a ring, the dead peer's neighbours
fail at once, but a survivor waiting on a *live* neighbour that has already given up waits for
the whole timeout (measured: 120 s). So waits are sliced (``WAIT_SLICE_S``) and between slices
the group asks ``abort_check`` (the coordinator's ``gen/<g>/abort`` flag) whether the
generation is broken; a silent (stopped) peer is noticed by the coordinator's heartbeats and
killed (fencing). The group's timeout stays the last bound.

Point-to-point waits are *not* sliced: gloo closes the pair when a ``recv`` wait times out
("Application timeout caused pair closure", measured with torch 2.13), so a sliced receive of a
message that takes longer than one slice (a state transfer of a few hundred MB) would break the
group. They wait for the group's timeout instead; a peer that gives up releases them by closing
its group (:meth:`Group.close` drops the process group, whose destructor closes the sockets), and
a hung peer is fenced by the coordinator, which closes its sockets too.
"""

from __future__ import annotations

import datetime
import threading
from dataclasses import dataclass
from typing import Callable

WAIT_SLICE_S = 0.05

import torch
import torch.distributed as dist


class PeerFailure(RuntimeError):
    """A collective of generation ``generation`` failed: a peer died, hung or left."""

    def __init__(self, generation: int, message: str) -> None:
        super().__init__(f"collective of generation {generation} failed: {message}")
        self.generation = generation


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
    abort_check: Callable[[], bool] | None = None
    """Asked between wait slices: True when the coordinator has declared this generation broken."""

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
            return _Work(work, self.generation, self.abort_check)
        if self.on_launch is not None:
            self.on_launch()
        _Work(work, self.generation, self.abort_check).wait()
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
        _Work(work, self.generation, self.abort_check).wait()

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.isend(tensor, dst, tag).wait()  # unsliced: see the module docstring

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> "_Work":
        """Start sending ``tensor``; the caller keeps it alive and waits on the returned work."""
        try:
            work = self.pg.send([tensor], dst, tag)
        except RuntimeError as exc:
            raise PeerFailure(self.generation, str(exc)) from exc
        return _Work(work, self.generation)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> "_Work":
        """Post a receive into ``tensor``; wait on the returned work (unsliced, see above)."""
        try:
            work = self.pg.recv([tensor], src, tag)
        except RuntimeError as exc:
            raise PeerFailure(self.generation, str(exc)) from exc
        return _Work(work, self.generation)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        self.irecv(tensor, src, tag).wait()  # unsliced: see the module docstring

    def close(self) -> None:
        """Release the group's sockets and threads (best effort; a broken group may refuse)."""
        if self.pg is not None:
            try:
                self.pg.shutdown()
            except Exception:
                pass
            self.pg = None

    def close_soon(self, wait_s: float = 0.5) -> None:
        """:meth:`close` a broken generation's group without hanging on it: gloo's shutdown waits
        for the operations still in flight (a collective whose live peers have all given up, or a
        receive given up on the abort flag, :class:`Arrival`), up to the group's timeout. So the
        close runs on a daemon thread, waited for ``wait_s`` at most; one that hangs ends with the
        group's timeout, after the caller has moved on."""
        closer = threading.Thread(target=self.close, daemon=True, name="vf-close-group")
        closer.start()
        closer.join(wait_s)


class Arrival:
    """The wait of one posted receive, owned by a daemon thread, so that the receiver can (1) tell
    without blocking whether the message is there (gloo's point-to-point work reports
    ``is_completed()`` False until someone waits on it, measured) and (2) give up on it when the
    coordinator declares the generation broken (a timed wait on a gloo point-to-point receive
    breaks the pair, measured; a receive from a live peer that has itself left the generation
    would otherwise block until the group's timeout). A thread left waiting ends when the group's
    sockets close or at its timeout; close such a group with :meth:`Group.close_soon` (gloo's
    shutdown waits for a receive in flight)."""

    __slots__ = ("done", "error")

    def __init__(self, work) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None
        threading.Thread(target=self._wait, args=(work,), daemon=True, name="vf-recv-arrival").start()

    def _wait(self, work) -> None:
        try:
            work.wait()
        except BaseException as exc:  # handed to the receiver's thread
            self.error = exc
        finally:
            self.done.set()

    def wait(self, group: "Group") -> None:
        if not self.done.wait(0.05):
            while not self.done.wait(0.2):  # short waits: the abort flag is read in between
                if group.abort_check is not None and group.abort_check():
                    raise PeerFailure(group.generation, "the coordinator declared the generation broken (a member "
                                                        "failed) during a receive")
        if self.error is not None:
            if isinstance(self.error, RuntimeError) and not isinstance(self.error, PeerFailure):
                raise PeerFailure(group.generation, _first_line(str(self.error))) from self.error
            raise self.error


class _Work:
    __slots__ = ("work", "generation", "abort_check")

    def __init__(self, work, generation: int, abort_check: Callable[[], bool] | None = None) -> None:
        self.work = work
        self.generation = generation
        self.abort_check = abort_check

    def wait(self) -> bool:
        if self.abort_check is None:
            try:
                return self.work.wait()
            except RuntimeError as exc:
                raise PeerFailure(self.generation, _first_line(str(exc))) from exc
        # A gloo *collective* can be waited on again after a wait times out (measured), so a long
        # wait is a loop of short ones with a look at the abort flag in between. An expired slice
        # reads "Operation timed out!"; the group's own timeout reads "Timed out waiting <T>ms".
        while True:
            try:
                return self.work.wait(_SLICE)
            except RuntimeError as exc:
                text = str(exc)
                if not _is_slice_expiry(text):
                    raise PeerFailure(self.generation, _first_line(text)) from exc
            if self.abort_check():
                raise PeerFailure(self.generation, "the coordinator declared the generation broken "
                                                   "(a member failed)")


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
                  device: torch.device) -> Group:
    """A group of some members of generation ``generation`` (e.g. the replicas of one pipeline
    stage), on its own fresh prefix ``gen/<g>/<name>``."""
    return _build(store, f"gen/{generation}/{name}", generation, rank, size, timeout_s, device)


def make_group(
    store: dist.Store, generation: int, rank: int, size: int, timeout_s: float, device: torch.device
) -> Group:
    """Build generation ``generation``'s group (gloo on CPU, NCCL on CUDA)."""
    return _build(store, f"gen/{generation}", generation, rank, size, timeout_s, device)


def _build(store: dist.Store, prefix_name: str, generation: int, rank: int, size: int, timeout_s: float,
           device: torch.device) -> Group:
    if size == 1:
        return Group(generation, 0, 1, None)
    prefix = dist.PrefixStore(prefix_name, store)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefix, rank, size, opts)
        else:
            pg = dist.ProcessGroupGloo(prefix, rank, size, timeout)
    except RuntimeError as exc:  # a peer died or vanished while the group was being built
        raise PeerFailure(generation, _first_line(str(exc))) from exc
    return Group(generation, rank, size, pg)
