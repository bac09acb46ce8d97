"""An in-process fabric: W ranks as threads, messages through queues, every byte counted (tests of
exchanges that use ``Group.isend`` / ``Group.irecv``, and of engines that also all-reduce).

``Fabric(W).groups[r]`` stands in for rank ``r``'s :class:`virtualflow.comm.groups.Group`; a send
copies the tensor into the receiver's queue for ``(src, tag)`` and adds to both ranks' counters.
:func:`run_ranks` runs ``body(rank, group)`` on W threads and returns the results in rank order.
"""

from __future__ import annotations

import queue
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

WAIT_S = 30.0


@dataclass
class Counter:
    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0


class _Sent:
    def wait(self) -> bool:
        return True


class _Recv:
    def __init__(self, fabric: "Fabric", dst: int, src: int, tag: int, buf: torch.Tensor) -> None:
        self.fabric, self.dst, self.src, self.tag, self.buf = fabric, dst, src, tag, buf
        self.done = False

    def wait(self) -> bool:
        if self.done:
            return True
        data = self.fabric.box(self.dst, self.src, self.tag).get(timeout=WAIT_S)
        if data.shape != self.buf.shape or data.dtype != self.buf.dtype:
            raise RuntimeError(f"rank {self.dst}: message from {self.src} tag {self.tag} is {tuple(data.shape)} "
                               f"{data.dtype}, the receive expects {tuple(self.buf.shape)} {self.buf.dtype}")
        self.buf.copy_(data)
        c = self.fabric.counters[self.dst]
        c.bytes_received += data.numel() * data.element_size()
        c.messages_received += 1
        self.done = True
        return True


@dataclass
class FakeGroup:
    fabric: "Fabric"
    rank: int
    size: int
    generation: int = 0
    on_launch: Callable[[], None] | None = None
    abort_check: Any = None
    pg: Any = field(default=True)
    local: bool = False
    """As :attr:`virtualflow.comm.groups.Group.local`: the fabric stands for links between machines."""

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> _Sent:
        assert dst != self.rank and 0 <= dst < self.size
        self.fabric.box(dst, self.rank, tag).put(tensor.detach().clone())
        c = self.fabric.counters[self.rank]
        c.bytes_sent += tensor.numel() * tensor.element_size()
        c.messages_sent += 1
        return _Sent()

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.isend(tensor, dst, tag).wait()

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> _Recv:
        assert src != self.rank and 0 <= src < self.size
        return _Recv(self.fabric, self.rank, src, tag, tensor)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        self.irecv(tensor, src, tag).wait()

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """``src``'s tensor into every rank's (not counted as point-to-point traffic)."""
        self.fabric.broadcast(self.rank, tensor, src)

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False):
        """Sum over the ranks, added in rank order (not counted as point-to-point traffic)."""
        if self.on_launch is not None:
            self.on_launch()
        self.fabric.all_reduce(self.rank, tensor)
        return _Sent() if async_op else None


class Fabric:
    def __init__(self, size: int) -> None:
        self.size = size
        self.counters = [Counter() for _ in range(size)]
        self._boxes: dict[tuple[int, int, int], queue.Queue] = defaultdict(queue.Queue)
        self._lock = threading.Lock()
        self.groups = [FakeGroup(self, r, size) for r in range(size)]
        self._barrier = threading.Barrier(size, timeout=WAIT_S)
        self._deposit: list[torch.Tensor | None] = [None] * size

    def all_reduce(self, rank: int, tensor: torch.Tensor) -> None:
        self._deposit[rank] = tensor.detach().clone()
        self._barrier.wait()
        total = self._deposit[0].clone()
        for t in self._deposit[1:]:
            total += t
        self._barrier.wait()  # everyone has read every deposit
        tensor.copy_(total)

    def broadcast(self, rank: int, tensor: torch.Tensor, src: int) -> None:
        if rank == src:
            self._deposit[rank] = tensor.detach().clone()
        self._barrier.wait()
        value = self._deposit[src]
        self._barrier.wait()  # everyone has read it
        tensor.copy_(value)

    def box(self, dst: int, src: int, tag: int) -> queue.Queue:
        with self._lock:
            return self._boxes[(dst, src, tag)]

    def undelivered(self) -> int:
        with self._lock:
            return sum(q.qsize() for q in self._boxes.values())


def run_ranks(fabric: Fabric, body: Callable[[int, FakeGroup], Any]) -> list[Any]:
    out: list[Any] = [None] * fabric.size
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            out[r] = body(r, fabric.groups[r])
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(fabric.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S * 2)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a rank is stuck"
    return out
