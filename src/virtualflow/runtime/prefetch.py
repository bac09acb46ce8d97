"""Overlapped input: the next virtual nodes' batches are loaded while the current ones compute.

A :class:`Prefetcher` holds a pool of ``workers`` threads (``concurrent.futures``) that run the
worker's batch loader on the indices the engine asks for ahead of time: while a step computes,
the rest of its VNs and the next step's VNs are read. A batch is identified by (step, VN) *and*
its sample indices, and is handed over only when the indices asked for at compute time are the
ones it was loaded from; anything else is loaded on the spot. The data order is the plan's
(a function of seed, step and VN id), so prefetching changes when a batch is read, never which
samples it holds: the model is the same, bit for bit in deterministic mode.

Threads, not processes: reading files and sleeping on storage release the GIL, so threads overlap
I/O-bound loading with compute at no start-up cost and without pickling the dataset. A dataset
whose ``__getitem__`` is CPU-bound Python (decoding in pure Python) gains less; one that draws
from torch's global random generator must not be prefetched (that stream is shared with the
training thread). The dataset is read from several threads at once: its ``__getitem__`` must be
thread-safe (file reads and tensor indexing are).

Invariants: at most the batches of two steps of this worker's VNs are held (bounded memory); a
membership change (:meth:`clear`) drops what was loaded for the old VN map; an error raised while
loading surfaces in the training thread when that batch is taken.

Both engines use it. The VN engine schedules each step's VNs at the step's start
(:meth:`virtualflow.runtime.step.compute.VNCompute.prefetch`). A pipeline stage reads its
micro-batches inside its forwards, in the order its schedule runs them, so its prefetcher is driven
by what it takes (:class:`StepAhead`): the first batch taken of a step schedules the rest of that
step's micro-batches and the next step's. A stage is given one batch source at construction
(:func:`batch_source`): :class:`LoadNow` without loader threads, :class:`StepAhead` with them; the
stages that read no data (the middle ones) never ask theirs for a batch, so they start no thread.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch

from virtualflow.runtime.breakdown import LoadStats, measured_load


class Prefetcher:
    """Loads VN batches ahead of use in ``workers`` background threads."""

    def __init__(self, load: Callable[[torch.Tensor], Any], workers: int, *, io: bool = True) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"loader_workers={workers!r} must be a positive integer to prefetch (0 turns "
                             f"prefetching off; --loader-workers)")
        self.load = load
        self.io = io
        self.workers = workers
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="vf-loader")
        self._pending: dict[tuple[int, int], tuple[torch.Tensor, Future]] = {}

    def schedule(self, step: int, vn: int, indices: torch.Tensor) -> None:
        """Start loading VN ``vn`` of ``step`` (nothing if it is already under way)."""
        if (step, vn) in self._pending:
            return
        self._pending[(step, vn)] = (indices, self._pool.submit(measured_load, self.load, indices, io=self.io))

    def take(self, step: int, vn: int, indices: torch.Tensor) -> tuple[Any, float, LoadStats]:
        """(batch, seconds the caller waited for it, what loading it cost). A batch not scheduled,
        or scheduled from other indices, is loaded now in the calling thread."""
        entry = self._pending.pop((step, vn), None)
        # Batches of earlier steps will never be asked for again (a redone step asks for its own).
        for key in [k for k in self._pending if k[0] < step]:
            self._pending.pop(key)[1].cancel()
        t0 = time.perf_counter()
        if entry is not None and entry[0].shape == indices.shape and torch.equal(entry[0], indices):
            batch, stats = entry[1].result()
            return batch, time.perf_counter() - t0, stats
        if entry is not None:
            entry[1].cancel()
        batch, stats = measured_load(self.load, indices, io=self.io)
        return batch, time.perf_counter() - t0, stats

    def clear(self) -> None:
        """Forget everything scheduled (a new VN map); loads already running finish unheeded."""
        for _, fut in self._pending.values():
            fut.cancel()
        self._pending.clear()

    def close(self) -> None:
        self.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    @property
    def pending(self) -> int:
        return len(self._pending)


class LoadNow:
    """No loader threads (``loader_workers=0``): a batch is loaded when it is asked for, in the
    calling thread, which waits for all of it."""

    def __init__(self, load: Callable[[torch.Tensor], Any], *, io: bool = True) -> None:
        self.load = load
        self.io = io

    def set_vns(self, vns: Sequence[int]) -> None:
        """A new VN map: nothing is held."""

    def take(self, step: int, vn: int, indices: torch.Tensor) -> tuple[Any, float, LoadStats]:
        """(batch, seconds the caller waited for it, what loading it cost): loaded now."""
        batch, stats = measured_load(self.load, indices, io=self.io)
        return batch, stats.seconds, stats

    def close(self) -> None:
        """Nothing to stop."""


class StepAhead:
    """A :class:`Prefetcher` driven by the batches its owner takes, for a reader whose order of
    reading is its schedule's (a pipeline stage's forwards). The first batch taken of a step
    schedules every VN of the owner's map (:meth:`set_vns`) for that step and the next one, so the
    next step's micro-batches load while this step's compute. Batches are still handed over only
    when their indices are the ones asked for, so the order of reading never changes which samples
    a batch holds."""

    def __init__(self, prefetcher: Prefetcher, indices_of: Callable[[int, int], torch.Tensor]) -> None:
        """``indices_of(step, vn)``: the samples of VN ``vn`` in ``step`` (the data plan's)."""
        self.prefetcher = prefetcher
        self.indices_of = indices_of
        self.vns: list[int] = []
        self._step: int | None = None  # the step whose first take scheduled the loads

    def set_vns(self, vns: Sequence[int]) -> None:
        """A new VN map (a generation, a re-layout): what was loaded for the old one is dropped."""
        self.vns = list(vns)
        self.prefetcher.clear()
        self._step = None

    def take(self, step: int, vn: int, indices: torch.Tensor) -> tuple[Any, float, LoadStats]:
        """(batch, seconds the caller waited for it, what loading it cost: the loader's)."""
        if step != self._step:
            self._step = step
            for s in (step, step + 1):
                for v in self.vns:
                    self.prefetcher.schedule(s, v, self.indices_of(s, v))
        return self.prefetcher.take(step, vn, indices)

    def close(self) -> None:
        self.prefetcher.close()


def batch_source(load: Callable[[torch.Tensor], Any], workers: int, indices_of: Callable[[int, int], torch.Tensor],
                 *, io: bool = True) -> LoadNow | StepAhead:
    """A pipeline stage's batch source, chosen once: ``workers`` loader threads loading ahead
    (:class:`StepAhead`), or none (:class:`LoadNow`, ``workers=0``). ``io``: measure the reads
    (the step breakdown's I/O profile)."""
    if workers == 0:
        return LoadNow(load, io=io)
    return StepAhead(Prefetcher(load, workers, io=io), indices_of)
