"""Which slice of a flat vector each of p ranks owns (pure, no processes).

A sharded reduction (reduce-scatter, then an update of the local slice, then all-gather) cuts a
flat vector of ``numel`` elements into ``p`` contiguous chunks in rank order: rank ``r`` owns
``[lo_r, hi_r)``. Chunks differ in size by at most ``align`` elements and their boundaries fall on
multiples of ``align`` (except the end), so a chunk starts on a vector-width boundary when
``align`` is one; a chunk may be empty when ``numel < p * align``. Given ``cuts`` (the only
places a chunk may start: the clipping norm's blocks, which no chunk may split), each boundary
moves forward to the first cut at or after it, so chunks then differ by up to the largest gap
between cuts more.

The same function cuts a *range* of the vector (a gradient bucket) into the parts that fall into
each rank's chunk (:func:`intersect`), so the bucket's reduce-scatter delivers to each rank
exactly the elements it owns.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Sequence

Bounds = list[tuple[int, int]]


def shard_bounds(numel: int, parts: int, align: int = 1, cuts: Sequence[int] | None = None) -> Bounds:
    """``parts`` contiguous chunks covering ``[0, numel)``, in rank order, as even as ``align``
    allows (boundaries on multiples of ``align``; with ``cuts``, a sorted list of offsets that
    ends at ``numel``, each moved forward onto the first cut at or after it)."""
    if parts < 1:
        raise ValueError(f"shard_bounds: parts={parts} must be at least 1 (the number of ranks)")
    if numel < 0:
        raise ValueError(f"shard_bounds: numel={numel} must be non-negative")
    if align < 1:
        raise ValueError(f"shard_bounds: align={align} must be at least 1")
    units = -(-numel // align)  # ceil: the last unit may be partial
    base, extra = divmod(units, parts)
    out: Bounds = []
    lo = 0
    for r in range(parts):
        hi = min(numel, lo + (base + (1 if r < extra else 0)) * align)
        if cuts is not None and hi < numel:
            k = bisect_left(cuts, hi)
            hi = min(numel, cuts[k]) if k < len(cuts) else numel
        hi = max(hi, lo)
        out.append((lo, hi))
        lo = hi
    return out


def intersect(bounds: Sequence[tuple[int, int]], lo: int, hi: int) -> Bounds:
    """The part of each rank's chunk inside ``[lo, hi)``, *relative to* ``lo`` (empty ranges for
    ranks whose chunk misses it). The result again covers ``[0, hi - lo)`` in rank order."""
    if not 0 <= lo <= hi:
        raise ValueError(f"intersect: range [{lo}, {hi}) is not a valid range")
    out: Bounds = []
    for a, b in bounds:
        a2, b2 = max(a, lo), min(b, hi)
        if a2 >= b2:  # empty: placed where it keeps the cover contiguous
            at = min(max(a, lo), hi) - lo
            out.append((at, at))
        else:
            out.append((a2 - lo, b2 - lo))
    return out


def check_bounds(bounds: Sequence[tuple[int, int]], numel: int) -> None:
    """Raise ``ValueError`` unless ``bounds`` cover ``[0, numel)`` contiguously in rank order."""
    at = 0
    for r, (a, b) in enumerate(bounds):
        if a != at or b < a:
            raise ValueError(f"bounds {list(bounds)} must cover [0, {numel}) contiguously in rank order; "
                             f"rank {r}'s chunk ({a}, {b}) should start at {at}")
        at = b
    if at != numel:
        raise ValueError(f"bounds {list(bounds)} end at {at}, not at numel={numel}")
