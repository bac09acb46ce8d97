"""What a user writes for a streaming dataset: shards read in order, their lengths, a shuffle buffer.

``Job.dataset`` may be a :class:`StreamingDataset` (or a factory returning one), or a
``torch.utils.data.IterableDataset`` with ``__len__`` (one shard). The order in which the shards'
samples reach the virtual nodes is the rule of :mod:`virtualflow.plan.streams` (docs/training.md,
"Streaming datasets"); reading is :mod:`virtualflow.runtime.streaming`.

Invariants: every shard's length is known before training (the rule computes each VN's position
from the step, so resizes, failures and resumes need no saved data position); a shard is opened
only by calling it - with no argument (read from its start; a later start is reached by skipping
samples), or, with ``seek=True``, with the sample offset to start at.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from torch.utils.data import IterableDataset

from virtualflow.plan.streams import StreamPlan

__all__ = ["StreamingDataset", "as_streaming"]


@dataclass(kw_only=True, slots=True)
class StreamingDataset:
    """A dataset read as streams: ``shards[k]()`` yields shard ``k``'s samples in order.

    Example::

        def shard(path):
            return lambda: (torch.load(f) for f in read_records(path))   # any iterable of samples
        vf.Job(dataset=lambda: vf.StreamingDataset(
                   shards=[shard(p) for p in paths], lengths=[count[p] for p in paths], shuffle_buffer=1024),
               ...)
    """

    shards: Sequence[Callable[..., Iterable[Any]] | Iterable[Any]]
    """One zero-argument callable per shard, returning an iterable of its samples in order (a
    generator function, a file reader), or a re-iterable object (an ``IterableDataset``, a list):
    each reader calls ``iter()`` on it. Samples are what a map-style dataset's items are: tensors
    or tuples/dicts of them (``Job.collate_fn`` batches them)."""
    lengths: Sequence[int] | None = None
    """Samples in each shard: the split rule and the epoch length depend on them. ``None``: each
    shard's ``len()`` (every shard must have one). A shard that yields fewer is an error; samples
    past its length are never read."""
    shuffle_buffer: int = 0
    """Samples each virtual node holds in its shuffle buffer (0: read in shard order). Seeded by
    (seed, epoch, VN). A worker that takes over a VN mid-epoch rebuilds its buffer by reading that
    VN's part from its start (O(position), once)."""
    seek: bool = False
    """``shards[k](start)`` yields shard ``k``'s samples from offset ``start``: a worker that takes
    over a VN mid-epoch opens the shard there instead of skipping ``start`` samples."""

    def __post_init__(self) -> None:
        if isinstance(self.shards, (str, bytes)) or not isinstance(self.shards, Sequence):
            raise TypeError(f"StreamingDataset(shards=...) must be a list of callables (one per shard), got "
                            f"{type(self.shards).__name__}")
        for k, s in enumerate(self.shards):
            if not callable(s) and (not hasattr(s, "__iter__") or iter(s) is s or isinstance(s, (str, bytes))):
                raise TypeError(f"StreamingDataset shard {k} is a {type(s).__name__}, neither a callable nor a "
                                f"re-iterable object (an iterator or generator can be read only once): give a "
                                f"function that returns an iterable of the shard's samples (e.g. lambda: iter(data))")
        if self.lengths is None:
            missing = [k for k, s in enumerate(self.shards) if not hasattr(s, "__len__")]
            if missing:
                raise ValueError(f"StreamingDataset(lengths=None) takes each shard's len(), but shard {missing[0]} "
                                 f"has none ({len(missing)} such shards): give lengths=[...], the number of samples "
                                 f"in each shard (the split rule computes every virtual node's position from the "
                                 f"step, which needs them; count them once, e.g. in your shard index)")
            self.lengths = [len(s) for s in self.shards]
        if isinstance(self.lengths, (str, bytes)) or not isinstance(self.lengths, Sequence):
            raise ValueError("StreamingDataset(lengths=...) must list the number of samples in each shard: the split "
                             "rule computes every virtual node's position from the step, which needs them (count them "
                             "once, e.g. in your shard index)")
        if len(self.lengths) != len(self.shards):
            raise ValueError(f"StreamingDataset has {len(self.shards)} shards but {len(self.lengths)} lengths; give "
                             f"one length per shard")
        if not isinstance(self.seek, bool):
            raise TypeError(f"StreamingDataset(seek={self.seek!r}) must be True or False")
        self.shards = tuple(s if callable(s) else s.__iter__ for s in self.shards)
        self.lengths = tuple(self.lengths)

    def __len__(self) -> int:
        return sum(self.lengths)

    def plan(self, global_batch_size: int, virtual_nodes: int, seed: int) -> StreamPlan:
        """The job's streaming rule (checks the lengths and the shuffle buffer)."""
        return StreamPlan(self.lengths, global_batch_size, virtual_nodes, seed, self.shuffle_buffer)

    def open(self, shard: int, start: int) -> Iterable[Any]:
        """Shard ``shard``'s samples from offset ``start``: by seeking (``seek=True``) or by
        skipping ``start`` samples."""
        if self.seek:
            try:
                return iter(self.shards[shard](start))
            except TypeError as exc:
                if "argument" not in str(exc):
                    raise
                raise TypeError(f"StreamingDataset(seek=True) calls shard {shard} as shards[{shard}](start), but it "
                                f"raised {exc}; make each shard take the sample offset to start at, or drop seek=True"
                                ) from exc
        it = iter(self.shards[shard]())
        for _ in range(start):
            try:
                next(it)
            except StopIteration:
                raise ValueError(f"streaming shard {shard} ended after fewer than {start} samples, but "
                                 f"StreamingDataset(lengths=...) says it has {self.lengths[shard]}; fix its length"
                                 ) from None
        return it


def as_streaming(ds: Any) -> StreamingDataset | None:
    """``ds`` as a streaming dataset: itself, an ``IterableDataset`` with a length as one shard, or
    None for a map-style dataset. An iterable without a length is refused (the knob: give a
    ``StreamingDataset`` with ``lengths``)."""
    if isinstance(ds, StreamingDataset):
        return ds
    if not isinstance(ds, IterableDataset) and hasattr(ds, "__getitem__") and hasattr(ds, "__len__"):
        return None  # map-style (torch's Dataset defines __getitem__, so an IterableDataset is told apart first)
    if hasattr(ds, "__iter__") and not isinstance(ds, (str, bytes, dict)):
        try:
            n = len(ds)
        except TypeError:
            raise ValueError(f"Job.dataset is an iterable {type(ds).__name__} without __len__: a stream's length "
                             f"decides the epochs and each virtual node's part, and must be known before training. "
                             f"Give it __len__, or wrap its shards in virtualflow.StreamingDataset(shards=[...], "
                             f"lengths=[...])") from None
        return StreamingDataset(shards=[ds.__iter__], lengths=[n])
    return None
