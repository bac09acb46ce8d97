"""Sharded parameters' gradient reduction, unit by unit, as each unit's backward finishes.

Purpose: after every VN's backward of a unit, the unit's gradient leaves this worker for the
owners of its shards, on a background thread (so it overlaps the backward of the units before
it), in the store's fixed reduction order. Two reductions, chosen once when the engine is built:

* :class:`ScatterSum` (default mode): a reduce-scatter of the unit's gradient (the project's ring
  on gloo, on its own lane of the group), each owner adding the sum of its shard to its gradient
  shard, accumulated over the rounds of the step (FSDP2's reduce-scatter per micro-batch). In
  ``reduce_dtype`` (bf16 halves the bytes; the shard accumulates in the master dtype).
* :class:`TreeSum` (deterministic mode): every worker sends each owner its slice of the VN's
  gradient (a leaf of the fixed VN tree); the owner folds the leaves of its shard in VN order
  (:class:`~virtualflow.plan.param_shards.InOrderFold`): operation for operation the tree's sum,
  so the gradient shard is bit-identical to the same elements of the unsharded deterministic
  run's sum, for any number of workers. Rounds hand out consecutive VN ids
  (:func:`~virtualflow.plan.param_shards.interleaved_assignment`), so an owner receives each
  round's leaves in VN order and holds at most one partial sum per tree level.

On CUDA the jobs run in the backward's own thread (:class:`_Inline`): NCCL's operations are
asynchronous already, and a second issuing thread could interleave them differently on different
ranks.

Invariants: at most :data:`IN_FLIGHT` units' gradients wait for the thread (the worker's memory
stays bounded when the network is slower than the backward); a failure on the thread is raised
on the next call from the step (a :class:`~virtualflow.comm.groups.PeerFailure` as any collective's).
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Sequence

import torch

from virtualflow.comm.groups import Group
from virtualflow.comm.ring import Collectives
from virtualflow.plan.param_shards import InOrderFold
from virtualflow.runtime.fsdp.store import DTYPES, UnitShard

__all__ = ["IN_FLIGHT", "ScatterSum", "TreeSum", "unit_leaf"]

IN_FLIGHT = 1
"""Units' gradients handed to the reduction thread and not reduced yet, at most (the backward
fills the next one meanwhile): two units' gradients alive at a time."""
LEAF_TAG = 1 << 20
"""Point-to-point tags of the deterministic exchange start here (unit ``k``: ``LEAF_TAG + k``)."""


def unit_leaf(u: UnitShard, dtype: torch.dtype) -> torch.Tensor:
    """The unit's gradient of the VN just run, flat in ``dtype`` (:meth:`UnitShard.take_grad`)."""
    leaf = u.take_grad()
    return leaf if leaf.dtype == dtype else leaf.to(dtype)


class _Thread:
    """One background thread running jobs in submission order; at most :data:`IN_FLIGHT` queued."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._slots = threading.Semaphore(IN_FLIGHT)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self.check()
        self._slots.acquire()
        self._jobs.put(job)

    def drain(self) -> None:
        """Wait for every job submitted; raise the first failure."""
        for _ in range(IN_FLIGHT):
            self._slots.acquire()
        for _ in range(IN_FLIGHT):
            self._slots.release()
        self.check()

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if self._error is None:
                    job()
            except BaseException as exc:  # raised on the step's next call
                self._error = exc
            finally:
                self._slots.release()


class _Inline:
    """Jobs run at once, in the caller's thread: on CUDA, where NCCL's collectives are already
    asynchronous (they queue on a stream) and every rank must issue them from one ordered thread."""

    def submit(self, job: Callable[[], None]) -> None:
        job()

    def drain(self) -> None:
        pass

    def check(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Base:
    """What both reductions share: the gradient shards, the generation's group, the thread."""

    def __init__(self, units: Sequence[UnitShard], reduce_dtype: str) -> None:
        self.units = list(units)
        self.dtype = DTYPES[reduce_dtype]
        self.grads: list[torch.Tensor] = [torch.zeros(0) for _ in self.units]
        """Per unit, this worker's shard of the step's summed gradient (master dtype, on the host)."""
        self.group: Group | None = None
        self.thread: _Thread | _Inline | None = None
        self.ghost = False
        """The VN running is a ghost: its gradient counts as nothing."""

    def bind(self, group: Group) -> None:
        self.close()
        self.group = group
        on_cuda = self.units[0].full.device.type == "cuda"
        self.thread = _Inline() if on_cuda else _Thread(f"vf-fsdp-reduce-g{group.generation}")

    def close(self) -> None:
        if self.thread is not None:
            self.thread.close()
            self.thread = None

    def finish_step(self) -> None:
        assert self.thread is not None
        self.thread.drain()


class ScatterSum(_Base):
    """Default mode: a reduce-scatter per unit per VN, summed into each owner's gradient shard."""

    def __init__(self, units: Sequence[UnitShard], reduce_dtype: str) -> None:
        super().__init__(units, reduce_dtype)
        self.lane: Collectives | None = None

    def bind(self, group: Group) -> None:
        super().bind(group)
        if self.lane is not None:
            self.lane.close(timeout_s=1.0)
        self.lane = Collectives(group, lane=1) if group.size > 1 else None

    def close(self) -> None:
        super().close()
        if self.lane is not None:
            self.lane.close(timeout_s=1.0)
            self.lane = None

    def begin_step(self, virtual_nodes: int) -> None:
        self.grads = [torch.zeros(u.hi - u.lo, dtype=u.dtype, device=u.host) for u in self.units]

    def begin_round(self, active: Sequence[int], first_vn: int) -> None:
        pass

    def unit_done(self, u: UnitShard) -> None:
        leaf = unit_leaf(u, self.dtype)
        if self.ghost:
            leaf.zero_()
        lane, grad = self.lane, self.grads[u.index]

        def job() -> None:
            if lane is not None:
                lane.reduce_scatter(leaf, u.bounds)
            grad.add_(leaf[u.lo : u.hi].to(grad.device, grad.dtype))

        assert self.thread is not None
        self.thread.submit(job)


class TreeSum(_Base):
    """Deterministic mode: leaves to their owners, folded in VN order (see the module docstring)."""

    def __init__(self, units: Sequence[UnitShard], reduce_dtype: str = "fp32") -> None:
        super().__init__(units, "fp32")
        self.folds: list[InOrderFold] = []
        self.stacks: list[list[torch.Tensor]] = []
        self.active: list[int] = []
        """Ranks with a real VN in this round, in rank order (their VN ids are consecutive)."""

    def begin_step(self, virtual_nodes: int) -> None:
        self.folds = [InOrderFold(virtual_nodes) for _ in self.units]
        self.stacks = [[] for _ in self.units]

    def begin_round(self, active: Sequence[int], first_vn: int) -> None:
        self.active = list(active)

    def unit_done(self, u: UnitShard) -> None:
        leaf = unit_leaf(u, u.dtype if u.dtype.is_floating_point and u.dtype.itemsize >= 4 else torch.float32)
        group, active, mine = self.group, list(self.active), not self.ghost
        assert group is not None
        fold, stack = self.folds[u.index], self.stacks[u.index]

        def job() -> None:
            me, tag = group.rank, LEAF_TAG + u.index
            works = []
            if mine:
                for o, (a, b) in enumerate(u.bounds):
                    if o != me and b > a:
                        works.append(group.isend(leaf[a:b], o, tag))
            got: dict[int, torch.Tensor] = {}
            for w in active:
                got[w] = leaf[u.lo : u.hi].clone() if w == me else leaf.new_empty(u.hi - u.lo)
                if w != me and u.hi > u.lo:
                    works.append(group.irecv(got[w], w, tag))
            for work in works:
                work.wait()
            for w in active:
                _push(fold, stack, got[w].to(u.host))

        assert self.thread is not None
        self.thread.submit(job)

    def finish_step(self) -> None:
        super().finish_step()
        self.grads = []
        for u, fold, stack in zip(self.units, self.folds, self.stacks):
            if not fold.complete:
                raise RuntimeError(f"fsdp: unit {u.name!r} folded {fold.next} of {fold.virtual_nodes} leaves")
            root = stack[0] if stack else torch.zeros(0, dtype=u.dtype, device=u.host)
            self.grads.append(root if root.dtype == u.dtype else root.to(u.dtype))


def _push(fold: InOrderFold, stack: list[torch.Tensor], leaf: torch.Tensor) -> None:
    stack.append(leaf)
    for _ in fold.push():
        right = stack.pop()
        stack[-1].add_(right)  # left + right, as the tree's sum (comm/reduce.py tree_reduce_local)


def reduction_of(deterministic: bool, units: Sequence[UnitShard], reduce_dtype: str) -> Any:
    """The mode's reduction (chosen once, when the engine is built)."""
    return MODES[deterministic](units, reduce_dtype)


MODES: dict[bool, type[ScatterSum] | type[TreeSum]] = {False: ScatterSum, True: TreeSum}
"""Deterministic mode -> its reduction."""
