"""Process-group generations over a shared TCPStore.

Every membership generation ``g`` gets a fresh group built on ``PrefixStore(f"gen/{g}", store)``:
prefixes are never reused, so no key of an old generation can be read by a new one. Groups are
constructed directly (not through ``init_process_group``), so one process can hold several
generations over its life and two jobs can live in one process.

A collective that fails because a peer died, hung or left raises :class:`PeerFailure`, so the
worker can tell "the group is broken, regroup" from an error in the user's own code. gloo has no
abort: a dead peer's sockets close and every survivor's collective fails within milliseconds,
while a silent (stopped) peer is only noticed by the coordinator's heartbeats, which then kill
it (fencing) and so turn the hang into the same fast failure. The group's timeout is the last
bound.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Callable

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
            return _Work(work, self.generation)
        if self.on_launch is not None:
            self.on_launch()
        _Work(work, self.generation).wait()
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
        _Work(work, self.generation).wait()

    def close(self) -> None:
        """Release the group's sockets and threads (best effort; a broken group may refuse)."""
        if self.pg is not None:
            try:
                self.pg.shutdown()
            except Exception:
                pass
            self.pg = None


class _Work:
    __slots__ = ("work", "generation")

    def __init__(self, work, generation: int) -> None:
        self.work = work
        self.generation = generation

    def wait(self) -> bool:
        try:
            return self.work.wait()
        except RuntimeError as exc:
            raise PeerFailure(self.generation, _first_line(str(exc))) from exc


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else text
    return line[:300]


class _Done:
    def wait(self) -> bool:
        return True


def make_group(
    store: dist.Store, generation: int, rank: int, size: int, timeout_s: float, device: torch.device
) -> Group:
    """Build generation ``generation``'s group (gloo on CPU, NCCL on CUDA)."""
    if size == 1:
        return Group(generation, 0, 1, None)
    prefix = dist.PrefixStore(f"gen/{generation}", store)
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
