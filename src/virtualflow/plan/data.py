"""Data order and random streams: pure functions of (seed, epoch, step, VN id).

The data-order and randomness rules of docs/training.md ("Semantics") made concrete. Nothing
here depends on ranks or worker counts:

* for epoch ``e`` the sample at position ``p`` of the epoch's order is
  :func:`~virtualflow.plan.permutation.epoch_indices` ``(p, len(dataset), seed, e)``: a keyed
  bijection computed per position, so a step's B indices cost O(B) memory, never O(len(dataset))
  (``order="feistel"``, the default); ``order="randperm"``, the order before it (kept to resume
  old checkpoints), is ``torch.randperm(len(dataset),
  generator=torch.Generator().manual_seed(seed + e))``, one tensor of the whole epoch;
* each epoch has ``len(dataset) // B`` steps (the incomplete tail is dropped);
* global step ``s`` uses positions ``[i*B, (i+1)*B)`` of its epoch's order, with
  ``e = s // steps_per_epoch`` and ``i = s % steps_per_epoch``; a run whose batch changes at
  recorded steps (``Job.batch_schedule``) reads on from where the previous batch left off, a step
  that the epoch's rest cannot hold starting the next epoch (:mod:`virtualflow.plan.batch_schedule`);
* virtual node ``v`` gets the ``v``-th contiguous slice of ``B / V`` of those positions (with
  uneven VN sizes ``s_0..s_{V-1}``, summing to ``B``: the slice ``[s_0+..+s_{v-1}, +s_v)``);
* randomness inside VN ``v`` of step ``s`` (dropout, augmentation) draws from the global torch
  generator seeded with :func:`vn_seed` ``(seed, s, v)``.
"""

from __future__ import annotations

import functools

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from virtualflow.plan.batch_schedule import BatchSchedule, FixedPositions, SchedulePositions
from virtualflow.plan.permutation import epoch_indices

DATA_ORDERS = ("feistel", "randperm")
"""The data orders: ``"feistel"`` (per position, O(B) memory) and ``"randperm"`` (the order
before it: one ``torch.randperm`` of the dataset per epoch)."""


class OrderedJob(Protocol):
    """What a plan reads of a job (:class:`~virtualflow.config.job.Job` has it)."""

    global_batch_size: int
    virtual_nodes: int
    seed: int
    data_order: str
    batch_schedule: object
    lr_rule: object


_BLOCK_POSITIONS = 2048
"""A miss in the step cache computes the order of the following steps of the same epoch too, up
to this many positions and :data:`_BLOCK_STEPS` steps in one call. The Feistel rule is about 90
element-wise operations per call whatever the number of positions: measured here 0.2 ms for one
step of 256 positions and 0.4 ms for 2,048 (with torch's operations, up to issue 44, 0.6 and 1.2
ms: most of the engine's own time in a small model's step), so a block costs each step a fraction
of one call. Same values: each position's index is a function of the position only. The block
stays small (a few batches of a small B, one or two of a large one): a step's indices cost memory
of the order of its batch, whatever the dataset's size."""
_BLOCK_STEPS = 32
_CACHED_STEPS = 2 * _BLOCK_STEPS  # the block in use, and room for the step before it (a retry)

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def vn_seed(seed: int, step: int, vn: int) -> int:
    """Seed of the random stream used inside virtual node ``vn`` of global step ``step``.

    A fixed mix of the three integers (splitmix64), kept below 2**63 so that
    ``torch.manual_seed`` accepts it. Public: tests and users' references may call it.
    """
    x = _splitmix64(_step_mix(seed, step) ^ (vn & _MASK64))
    return x & ((1 << 63) - 1)


@functools.lru_cache(maxsize=256)
def _step_mix(seed: int, step: int) -> int:
    """The part of :func:`vn_seed` shared by a step's VNs (kept for the last few steps: a worker
    seeds each of its VNs in turn, 3 mixes of Python integers each otherwise)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64))


@dataclass(slots=True)
class DataPlan:
    """Which dataset indices each virtual node reads at each global step.

    ``global_batch_size`` and ``virtual_nodes`` are those of the step the engine runs now: with a
    ``schedule`` they change at its steps (:meth:`set_virtual_nodes`); which samples a step reads
    depends on the step only."""

    dataset_size: int
    global_batch_size: int
    virtual_nodes: int
    seed: int = 0
    order: str = "feistel"
    """One of :data:`DATA_ORDERS` (``Job.data_order``)."""
    schedule: BatchSchedule | None = None
    """The batch's changes (``Job.batch_schedule``); None: one batch for the run."""
    _positions: FixedPositions | SchedulePositions = field(init=False, repr=False)
    _cache: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _steps: OrderedDict[int, torch.Tensor] = field(default_factory=OrderedDict, repr=False)
    _offsets: list[int] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.global_batch_size % self.virtual_nodes:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is not divisible by "
                f"virtual_nodes={self.virtual_nodes}; choose a multiple of {self.virtual_nodes}"
            )
        largest = max(b for _, b in self.schedule.segments) if self.schedule is not None else self.global_batch_size
        if self.dataset_size < largest:
            raise ValueError(
                f"the dataset has {self.dataset_size} samples, fewer than "
                f"global_batch_size={largest}; an epoch needs at least one full "
                f"global batch: lower global_batch_size (or Job.batch_schedule's virtual_nodes) or use a larger dataset"
            )
        if self.order not in DATA_ORDERS:
            raise ValueError(f"data_order={self.order!r} is not one of {', '.join(map(repr, DATA_ORDERS))} "
                             f"(Job.data_order)")
        self._positions = (FixedPositions(self.dataset_size, self.global_batch_size) if self.schedule is None
                           else SchedulePositions(self.dataset_size, self.schedule))

    @classmethod
    def of_job(cls, job: OrderedJob, dataset_size: int) -> DataPlan:
        """The plan of a :class:`~virtualflow.config.job.Job` (its B, V, seed, data order and batch schedule)."""
        schedule = BatchSchedule.of(job.global_batch_size, job.virtual_nodes, getattr(job, "batch_schedule", ()),
                                    getattr(job, "lr_rule", None))
        return cls(dataset_size, job.global_batch_size, job.virtual_nodes, job.seed, order=job.data_order,
                   schedule=schedule)

    def set_virtual_nodes(self, virtual_nodes: int) -> None:
        """The batch of the steps from now on: ``virtual_nodes`` VNs of the fixed per-VN size (a
        change of the schedule, at a step boundary); even VN sizes."""
        n = self.vn_batch_size
        self.virtual_nodes, self.global_batch_size, self._offsets = virtual_nodes, virtual_nodes * n, None

    def set_schedule(self, schedule: BatchSchedule) -> None:
        """A batch change asked while the run goes on (the cluster service's): the positions
        follow ``schedule`` from now on. Its changes up to the steps already read must be the
        plan's (a change is appended for a step not yet run); steps read ahead are dropped."""
        largest = max(b for _, b in schedule.segments)
        if self.dataset_size < largest:
            raise ValueError(f"a batch change to global batch {largest} is more than the dataset's {self.dataset_size} "
                             f"samples; an epoch needs at least one full global batch (the change's virtual_nodes)")
        self.schedule, self._positions = schedule, SchedulePositions(self.dataset_size, schedule)
        self._steps.clear()

    @property
    def steps_per_epoch(self) -> int:
        return self.dataset_size // self.global_batch_size

    @property
    def vn_batch_size(self) -> int:
        return self.global_batch_size // self.virtual_nodes

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The whole order of ``epoch`` (``order="randperm"`` only: it materialises the epoch)."""
        if self.order != "randperm":
            raise ValueError(f"epoch_order materialises a randperm epoch; data_order={self.order!r} is computed "
                             f"per step (step_indices)")
        order = self._cache.get(epoch)
        if order is None:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.dataset_size, generator=gen)
            self._cache.clear()  # one epoch at a time is enough; keeps memory flat
            self._cache[epoch] = order
        return order

    def step_indices(self, step: int) -> torch.Tensor:
        """Dataset indices of the whole global batch of ``step``."""
        epoch, start, b, run = self._positions.locate(step)
        if self.order == "randperm":
            return self.epoch_order(epoch)[start : start + b]
        indices = self._steps.get(step)
        if indices is None:
            count = max(1, min(_BLOCK_STEPS, _BLOCK_POSITIONS // b, run))
            block = epoch_indices(range(start, start + count * b), self.dataset_size, self.seed, epoch)
            for k in range(count):
                self._steps[step + k] = block[k * b:(k + 1) * b]
            while len(self._steps) > _CACHED_STEPS:
                self._steps.popitem(last=False)
            indices = self._steps[step]
        return indices

    def set_vn_sizes(self, sizes: list[int] | None) -> None:
        """Uneven VN sizes (heterogeneous mode), or None for ``B / V`` each."""
        if sizes is None:
            self._offsets = None
            return
        if len(sizes) != self.virtual_nodes or sum(sizes) != self.global_batch_size or min(sizes) < 1:
            raise ValueError(
                f"VN sizes {sizes} must be {self.virtual_nodes} positive integers summing to "
                f"global_batch_size={self.global_batch_size}"
            )
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)
        self._offsets = offsets

    def vn_block(self, step: int, vns: Sequence[int]) -> tuple[torch.Tensor, list[int]] | None:
        """The indices of the consecutive VNs ``vns`` at ``step`` as one slice of the step's order
        (what :meth:`vn_indices` returns for each, back to back) and each VN's sample count; None
        when ``vns`` are not consecutive."""
        if not vns or list(vns) != list(range(vns[0], vns[0] + len(vns))):
            return None
        first, end = vns[0], vns[0] + len(vns)
        if not (0 <= first and end <= self.virtual_nodes):
            raise ValueError(f"vns={list(vns)} are outside 0..{self.virtual_nodes - 1}")
        if self._offsets is not None:
            o = self._offsets
            return self.step_indices(step)[o[first] : o[end]], [o[v + 1] - o[v] for v in range(first, end)]
        n = self.vn_batch_size
        return self.step_indices(step)[first * n : end * n], [n] * len(vns)

    def vn_indices(self, step: int, vn: int) -> torch.Tensor:
        """Dataset indices read by virtual node ``vn`` at global ``step``."""
        if not 0 <= vn < self.virtual_nodes:
            raise ValueError(f"vn={vn} is outside 0..{self.virtual_nodes - 1}")
        if self._offsets is not None:
            return self.step_indices(step)[self._offsets[vn] : self._offsets[vn + 1]]
        n = self.vn_batch_size
        return self.step_indices(step)[vn * n : (vn + 1) * n]
