"""Reading a streaming dataset: one open reader per virtual node this worker runs.

:class:`StreamLoader` takes the stream slots :meth:`StreamPlan.vn_indices` hands out (what the VN
engine, the prefetcher and the pipeline's first and last stages pass to a loader, exactly as they
pass a map-style dataset's indices) and returns the collated batch. Per VN it keeps a reader open
where the last batch ended, so the common case - the VN's next batch - reads ``b`` samples and
nothing else. A reader is (re)built only when a VN's batch is asked for at another place: the
first time this worker runs the VN (a start, a resize, a failure, a resume), a new epoch, or a
step redone further back than the batches it keeps. Rebuilding opens the shard at the VN's
position (``seek=True``) or skips to it (O(offset in the shard)); with a shuffle buffer it reads
the VN's part from the epoch's start to refill the buffer (O(position), once per takeover). A
new reader starts one batch before the batch asked for (the prefetcher may ask for a VN's next
batch before its current one); at an epoch's end a VN has a reader for each of the two epochs.
Readers left more than two batches behind the ones asked for belong to VNs this worker no
longer runs, and are closed.

Invariants: which samples a batch holds is the plan's rule (a function of the job and the slot),
never of which reader, worker or thread read it; the reader of a VN is used by one thread at a
time (a lock per VN: the prefetcher may ask for a VN's next two batches from two threads, and
the later one then reads, and keeps, the earlier first); at most ``KEEP`` batches per VN are kept
(the next ones read ahead, and the last ones handed out, for a step that is redone).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import default_collate

from virtualflow.config.streaming import StreamingDataset, as_streaming
from virtualflow.plan.data import DataPlan, OrderedJob
from virtualflow.plan.streams import ShuffleOrder, StreamPlan
from virtualflow.runtime.batches import BatchLoader

__all__ = ["KEEP", "StreamLoader", "data_plan_of", "loader_of"]

KEEP = 4
"""Batches kept per VN: read ahead for the prefetcher, or handed out (a redone step asks again)."""

MAX_AHEAD = 4
"""A VN's batch up to this many batches ahead of its reader is reached by reading on (keeping
what is read); further ahead, the reader is rebuilt there."""


def data_plan_of(dataset: Any, job: OrderedJob) -> DataPlan | StreamPlan:
    """The job's data order: the streaming rule for a streaming dataset (``Job.data_order`` is the
    order of map-style datasets: a stream has its own), else the map-style one."""
    stream = as_streaming(dataset)
    if stream is not None:
        return stream.plan(job.global_batch_size, job.virtual_nodes, job.seed)
    return DataPlan.of_job(job, len(dataset))


def loader_of(dataset: Any, collate_fn: Callable | None, plan: DataPlan | StreamPlan) -> BatchLoader | StreamLoader:
    """What loads a VN's batch from the indices ``plan`` hands out."""
    stream = as_streaming(dataset)
    if stream is not None:
        if not isinstance(plan, StreamPlan):
            raise TypeError("a streaming dataset needs the streaming plan (data_plan_of)")
        return StreamLoader(stream, plan, collate_fn)
    return BatchLoader(dataset, collate_fn)


class _Reader:
    """VN ``vn``'s stream in one epoch, open at output position ``next``."""

    def __init__(self, loader: StreamLoader, epoch: int, vn: int, position: int) -> None:
        self.loader, self.epoch, self.vn = loader, epoch, vn
        plan = loader.plan
        self.start = plan.vn_start(vn)
        self.order: ShuffleOrder | None = None
        self.held: dict[int, Any] = {}
        if plan.shuffle_buffer:
            self.order = ShuffleOrder(plan.shuffle_key(epoch, vn), plan.part, plan.shuffle_buffer)
            self.order.advance(position)  # integers only
            keep = set(self.order.held)
            self._open(0)
            for p in range(self.order.read):  # refill the buffer: read the part up to where it was
                sample = self._read()
                if p in keep:
                    self.held[p] = sample
            self.read = self.order.read
        else:
            self._open(position)
        self.next = position

    def _open(self, position: int) -> None:
        """Read on from position ``position`` of this VN's part."""
        self.index, self.shard, self.offset = self.loader.plan.locate(self.epoch, self.start + position)
        self.it: Iterator[Any] = self.loader.stream.open(self.shard, self.offset)

    def _read(self) -> Any:
        """The next sample of the part, across shard ends."""
        lengths = self.loader.plan.shard_lengths
        while self.offset >= lengths[self.shard]:
            self.index, self.shard, self.offset = self.loader.plan.next_shard(self.epoch, self.index)
            self.it = self.loader.stream.open(self.shard, 0)
        try:
            sample = next(self.it)
        except StopIteration:
            raise ValueError(f"streaming shard {self.shard} ended after {self.offset} samples, but "
                             f"StreamingDataset(lengths=...) says it has {lengths[self.shard]}; fix its length"
                             ) from None
        self.offset += 1
        return sample

    def take(self, count: int) -> list[Any]:
        """The next ``count`` samples of the VN's (shuffled) part."""
        out = []
        for _ in range(count):
            if self.order is None:
                out.append(self._read())
            else:
                p = next(self.order)
                while self.read < self.order.read:
                    self.held[self.read] = self._read()
                    self.read += 1
                out.append(self.held.pop(p))
        self.next += count
        return out


class StreamLoader:
    """Loads VN batches of a streaming dataset from stream slots (see the module docstring)."""

    def __init__(self, stream: StreamingDataset, plan: StreamPlan, collate_fn: Callable | None) -> None:
        self.stream = stream
        self.plan = plan
        self.collate = collate_fn or default_collate
        self._readers: dict[tuple[int, int], _Reader] = {}
        """(VN, epoch) -> its open reader: at an epoch's end a VN may have two (the prefetcher
        asks for the next epoch's first batch before this epoch's last one)."""
        self._kept: dict[int, OrderedDict[tuple[int, int], Any]] = {}
        self._locks: dict[int, threading.Lock] = {}
        self._guard = threading.Lock()
        self.rebuilds = 0
        """How many times a reader was (re)built: once per VN taken over, in the common case."""

    def vn_batches(self, indices: list[torch.Tensor]) -> list[Any]:
        return [self(i) for i in indices]

    def __call__(self, indices: torch.Tensor) -> Any:
        if len(indices) == 0:
            raise ValueError("a streaming VN batch needs at least one sample")
        epoch, vn, position = self.plan.slot(int(indices[0]))
        count = len(indices)
        with self._guard:
            lock = self._locks.setdefault(vn, threading.Lock())
        with lock:
            return self._batch(epoch, vn, position, count)

    def _batch(self, epoch: int, vn: int, position: int, count: int) -> Any:
        kept = self._kept.setdefault(vn, OrderedDict())
        key = (epoch, position)
        if key in kept:
            kept.move_to_end(key)
            return kept[key]
        self._drop_stale(epoch, position - 2 * count)
        reader = self._readers.get((vn, epoch))
        if reader is None or reader.next > position or position - reader.next > MAX_AHEAD * count:
            # A new reader starts one batch early: the prefetcher may ask for the next step's
            # batch of a VN before this step's (reading one batch more beats a second rebuild).
            start = position - count if reader is None and position >= count else position
            reader = self._readers[(vn, epoch)] = _Reader(self, epoch, vn, start)
            self.rebuilds += 1
        while reader.next < position:  # the prefetcher asked for a later batch first
            at = reader.next
            self._keep(kept, (epoch, at), self.collate(reader.take(min(count, position - at))))
        batch = self.collate(reader.take(count))
        self._keep(kept, key, batch)
        return batch

    @staticmethod
    def _keep(kept: OrderedDict, key: tuple[int, int], batch: Any) -> None:
        kept[key] = batch
        while len(kept) > KEEP:
            kept.popitem(last=False)

    def _drop_stale(self, epoch: int, position: int) -> None:
        """Close the readers left behind ``(epoch, position)`` (counted through epochs): every VN
        this worker runs is read at the same step, so a reader that far behind belongs to a VN now
        run elsewhere (or to an epoch that is over)."""
        part = self.plan.part
        with self._guard:
            for key, reader in list(self._readers.items()):
                if reader.epoch * part + reader.next < epoch * part + position:
                    self._readers.pop(key, None)
                    if not any(k[0] == key[0] for k in self._readers):
                        self._kept.pop(key[0], None)
