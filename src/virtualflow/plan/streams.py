"""The streaming data order: which samples of which shards virtual node ``v`` reads at step ``s``.

A streaming dataset is a list of ``n`` shards, each a sequence of samples read in order, with
known lengths ``L_0..L_{n-1}`` (``N = sum L_k`` samples). The rule (docs/training.md, "Streaming
datasets") is a pure function of the job - seed, shard lengths, global batch ``B``, virtual
nodes ``V``, shuffle buffer ``K`` - never of the workers:

* **epochs**: an epoch has ``S = N // B`` steps (at least one); step ``s`` is step
  ``i = s % S`` of epoch ``e = s // S``;
* **shard order**: epoch ``e`` reads the shards in the order
  ``torch.randperm(n, generator=torch.Generator().manual_seed(stream_seed(seed, e)))``; their
  concatenation is the epoch's stream of ``N`` samples;
* **split**: virtual node ``v`` owns the contiguous part ``[v*S*b, (v+1)*S*b)`` of that stream
  (``b = B / V``): it reads its shards in order, starting and ending where its part does (a part
  may begin or end inside a shard, and a VN may span several shards). The last ``N - S*B`` samples
  (fewer than ``B``) are dropped: every other sample is read exactly once per epoch, and the
  dropped ones differ from epoch to epoch (the shard order does);
* **steps**: at step ``i`` of its epoch VN ``v`` trains on positions ``[i*b, (i+1)*b)`` of its
  part - or, with a shuffle buffer (``K > 0``), on outputs ``[i*b, (i+1)*b)`` of its part passed
  through the buffer of :class:`ShuffleOrder`, seeded by ``stream_seed(seed, e, v)``.

So the samples VN ``v`` reads at step ``s`` are known from ``s`` alone: after a resize, a failure
or a resume the worker that now runs VN ``v`` computes where its stream is and continues it; no
data position needs to be saved in a checkpoint.

What the engine sees: :meth:`StreamPlan.vn_indices` returns, like ``DataPlan.vn_indices``, one
integer per sample - here the sample's *stream slot* ``(e*V + v)*S*b + p`` (epoch, VN, position in
the VN's part). The reader (:mod:`virtualflow.runtime.streaming`) decodes it with :meth:`slot`.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Sequence

import torch

__all__ = ["ShuffleOrder", "StreamPlan", "stream_seed"]

_MASK64 = (1 << 64) - 1
_SALT = 0x5354524541  # "STREA": keeps stream seeds apart from vn_seed's


def _mix(x: int) -> int:
    """splitmix64's finaliser."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def stream_seed(seed: int, epoch: int, vn: int = -1) -> int:
    """Seed of epoch ``epoch``'s shard order (``vn=-1``) or of VN ``vn``'s shuffle buffer in that
    epoch: a fixed mix of the integers, below 2**63 (``torch.Generator.manual_seed`` accepts it)."""
    x = _mix((seed ^ _SALT) & _MASK64)
    x = _mix(x ^ (epoch & _MASK64))
    x = _mix(x ^ ((vn + 1) & _MASK64))
    return x & ((1 << 63) - 1)


class ShuffleOrder:
    """The order in which a shuffle buffer of ``buffer`` samples emits the positions ``0..length-1``
    of a stream read in order: a pure function of ``(key, length, buffer)``.

    The buffer starts with positions ``0..K-1``. Output ``t`` (while the stream lasts) takes slot
    ``j = mix(key, t) % K``, emits the position held there and puts the next unread position in
    its place; once every position is read, output ``t`` takes slot ``mix(key, t) % m`` of the
    ``m`` still held and moves the last slot into it. Every position is emitted exactly once; to
    emit output ``t`` a reader must have read the positions below :attr:`read`.
    """

    __slots__ = ("key", "length", "buffer", "held", "read", "t")

    def __init__(self, key: int, length: int, buffer: int) -> None:
        if buffer < 1:
            raise ValueError(f"shuffle_buffer={buffer} must be at least 1 here (0 means no buffer)")
        self.key, self.length, self.buffer = key, length, buffer
        self.held = list(range(min(buffer, length)))
        """The positions in the buffer now (slot order)."""
        self.read = len(self.held)
        """How many positions of the stream have entered the buffer."""
        self.t = 0
        """How many positions were emitted."""

    def __next__(self) -> int:
        if self.t >= self.length:
            raise StopIteration
        r = _mix(self.key ^ _mix(self.t))
        if self.read < self.length:
            j = r % self.buffer
            out = self.held[j]
            self.held[j] = self.read
            self.read += 1
        else:
            j = r % len(self.held)
            out = self.held[j]
            last = self.held.pop()
            if j < len(self.held):
                self.held[j] = last
        self.t += 1
        return out

    def __iter__(self) -> ShuffleOrder:
        return self

    def advance(self, outputs: int) -> None:
        """Skip ``outputs`` emissions (integers only: no sample is read)."""
        for _ in range(outputs):
            next(self)


@dataclass(slots=True)
class StreamPlan:
    """The streaming rule of the module docstring for one job (see there)."""

    shard_lengths: Sequence[int]
    global_batch_size: int
    virtual_nodes: int
    seed: int = 0
    shuffle_buffer: int = 0
    _epochs: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict, repr=False)
    """Cache: epoch -> (shard order, start of each in the epoch's stream). Two epochs at most
    (loader threads may read the next epoch's first batches while this one ends); entries are
    replaced whole, so a thread never sees half of one."""

    def __post_init__(self) -> None:
        B, V = self.global_batch_size, self.virtual_nodes
        if B % V:
            raise ValueError(f"global_batch_size={B} is not divisible by virtual_nodes={V}; choose a multiple of {V}")
        lengths = list(self.shard_lengths)
        if not lengths:
            raise ValueError("the streaming dataset has no shards; give at least one (StreamingDataset(shards=...))")
        for k, n in enumerate(lengths):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"shard {k}'s length {n!r} must be a non-negative integer "
                                 f"(StreamingDataset(lengths=...))")
        self.shard_lengths = tuple(lengths)
        if self.total < B:
            raise ValueError(f"the streaming dataset has {self.total} samples in {len(lengths)} shards, fewer than "
                             f"global_batch_size={B}; an epoch needs at least one full global batch: lower "
                             f"global_batch_size or add shards")
        if isinstance(self.shuffle_buffer, bool) or not isinstance(self.shuffle_buffer, int) or self.shuffle_buffer < 0:
            raise ValueError(f"shuffle_buffer={self.shuffle_buffer!r} must be a non-negative integer (0: no buffer; "
                             f"StreamingDataset(shuffle_buffer=...))")

    # -- the job's geometry -----------------------------------------------------------------
    @property
    def total(self) -> int:
        """``N``: samples in all shards."""
        return sum(self.shard_lengths)

    @property
    def steps_per_epoch(self) -> int:
        """``S = N // B``."""
        return self.total // self.global_batch_size

    @property
    def vn_batch_size(self) -> int:
        return self.global_batch_size // self.virtual_nodes

    @property
    def part(self) -> int:
        """Samples in one VN's part of an epoch: ``S * b``."""
        return self.steps_per_epoch * self.vn_batch_size

    @property
    def dropped_per_epoch(self) -> int:
        return self.total - self.steps_per_epoch * self.global_batch_size

    def set_vn_sizes(self, sizes: list[int] | None) -> None:
        """Streams split the epoch into V equal parts: uneven VN sizes are refused."""
        if sizes is not None and len(set(sizes)) > 1:
            raise ValueError(f"VN sizes {sizes}: a streaming dataset gives every virtual node an equal part of each "
                             f"epoch's stream, so VN sizes cannot differ; drop uneven_vn_sizes (--uneven-vn-sizes)")

    # -- the order --------------------------------------------------------------------------
    def shard_order(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s shard order (a seeded permutation)."""
        return list(self._table(epoch)[0])

    def _table(self, epoch: int) -> tuple[list[int], list[int]]:
        table = self._epochs.get(epoch)
        if table is None:
            gen = torch.Generator().manual_seed(stream_seed(self.seed, epoch))
            order = torch.randperm(len(self.shard_lengths), generator=gen).tolist()
            starts, pos = [], 0
            for k in order:
                starts.append(pos)
                pos += self.shard_lengths[k]
            table = (order, starts)
            for old in [e for e in list(self._epochs) if e < epoch - 1 or e > epoch + 1]:
                self._epochs.pop(old, None)
            self._epochs[epoch] = table
        return table

    def locate(self, epoch: int, position: int) -> tuple[int, int, int]:
        """Where position ``position`` of epoch ``epoch``'s stream is: (index in the shard order,
        shard id, offset in that shard). Empty shards are passed over."""
        if not 0 <= position < self.total:
            raise ValueError(f"stream position {position} is outside 0..{self.total - 1}")
        order, starts = self._table(epoch)
        i = bisect.bisect_right(starts, position) - 1
        while self.shard_lengths[order[i]] == 0:  # bisect lands on the last of equal starts
            i += 1
        return i, order[i], position - starts[i]

    def next_shard(self, epoch: int, index: int) -> tuple[int, int, int]:
        """``locate`` of the first sample after the ``index``-th shard of epoch ``epoch``'s order."""
        order, starts = self._table(epoch)
        return self.locate(epoch, starts[index] + self.shard_lengths[order[index]])

    def vn_start(self, vn: int) -> int:
        """Where VN ``vn``'s part starts in each epoch's stream."""
        return vn * self.part

    def shuffle_key(self, epoch: int, vn: int) -> int:
        return stream_seed(self.seed, epoch, vn)

    def vn_positions(self, step: int, vn: int) -> tuple[int, int, int]:
        """(epoch, first output of VN ``vn``'s part at ``step``, count)."""
        if not 0 <= vn < self.virtual_nodes:
            raise ValueError(f"vn={vn} is outside 0..{self.virtual_nodes - 1}")
        if step < 0:
            raise ValueError(f"step={step} must be non-negative")
        epoch, i = divmod(step, self.steps_per_epoch)
        b = self.vn_batch_size
        return epoch, i * b, b

    def vn_indices(self, step: int, vn: int) -> torch.Tensor:
        """The stream slots of VN ``vn``'s samples at ``step`` (see the module docstring)."""
        epoch, first, b = self.vn_positions(step, vn)
        base = (epoch * self.virtual_nodes + vn) * self.part + first
        return torch.arange(base, base + b, dtype=torch.long)

    def slot(self, value: int) -> tuple[int, int, int]:
        """A stream slot as (epoch, VN, output position in the VN's part)."""
        epoch, rest = divmod(int(value), self.virtual_nodes * self.part)
        vn, position = divmod(rest, self.part)
        return epoch, vn, position

    def samples(self, step: int, vn: int) -> list[tuple[int, int]]:
        """(shard id, offset) of every sample VN ``vn`` reads at ``step``, in order: the rule
        written out directly (O(position) with a shuffle buffer; for tests and references)."""
        epoch, first, b = self.vn_positions(step, vn)
        if self.shuffle_buffer:
            order = ShuffleOrder(self.shuffle_key(epoch, vn), self.part, self.shuffle_buffer)
            order.advance(first)
            local = [next(order) for _ in range(b)]
        else:
            local = list(range(first, first + b))
        return [self.locate(epoch, self.vn_start(vn) + p)[1:] for p in local]
