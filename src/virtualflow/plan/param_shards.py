"""Sharded parameters' layout, the moves of a resize, and the tree's in-order fold (pure code).

``reduction="fsdp"`` cuts each *unit* (a set of parameters gathered together: a transformer block,
or the root unit) into one contiguous shard per worker: the unit's parameters are laid end to
end in their order, and worker ``r`` of ``W`` owns elements ``[lo_r, hi_r)`` of that vector
(:func:`unit_bounds`). Shards start on the clipping norm's blocks (every parameter's start and
every :data:`~virtualflow.runtime.clipping.BLOCK` elements into it), so a block's sum of squares
is taken by one owner from the same elements as on one worker, whatever ``W``.

A resize from ``W`` to ``W'`` workers moves, per unit, exactly the ranges whose owner changes
(:func:`moves`): for each new rank, the intersection of its new shard with each old owner's
shard. Nothing is gathered whole anywhere.

Deterministic mode sums the per-VN gradients along the fixed VN tree
(:mod:`virtualflow.plan.vnmap`). With sharded parameters each owner receives, for its shard, the
leaves in VN order and folds them as they come (:class:`InOrderFold`): a stack of finished
subtrees, two siblings combined as soon as both are there, so at most one partial sum per tree
level is held (``log2 V`` shard-sized vectors) and the sum is, operation for operation, the
tree's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from virtualflow.plan.shards import Bounds, shard_bounds
from virtualflow.plan.vnmap import Node, split

__all__ = ["BLOCK_ELEMS", "InOrderFold", "Move", "interleaved_assignment", "moves", "unit_bounds", "unit_cuts"]

BLOCK_ELEMS = 4096
"""The clipping norm's block (:data:`virtualflow.runtime.clipping.BLOCK`; repeated here because
this layer imports nothing above it, and checked equal by a test)."""


def unit_cuts(numels: Sequence[int], block: int = BLOCK_ELEMS) -> list[int]:
    """Where a shard of a unit whose parameters have ``numels`` elements may start: every
    parameter's start and every ``block`` elements into it, then the unit's end."""
    out: list[int] = []
    at = 0
    for n in numels:
        out.extend(range(at, at + n, block))
        at += n
    out.append(at)
    return out


def unit_bounds(numels: Sequence[int], workers: int) -> Bounds:
    """Each of ``workers`` ranks' shard of a unit (its parameters' ``numels`` end to end), in
    rank order, as even as the blocks allow (a shard may be empty only when the unit has fewer
    blocks than workers)."""
    total = sum(numels)
    return shard_bounds(total, workers, 1, unit_cuts(numels))


@dataclass(frozen=True, slots=True)
class Move:
    """Elements ``[lo, hi)`` of a unit (unit coordinates) go from old rank ``src`` to new rank ``dst``."""

    src: int
    dst: int
    lo: int
    hi: int


def moves(old: Bounds, new: Bounds) -> list[Move]:
    """The ranges of one unit that each new rank needs from each old rank: the intersections of
    the new shards with the old ones (a survivor's own elements included: ``src`` is its old rank;
    the caller skips what stays in place)."""
    out = []
    for dst, (a, b) in enumerate(new):
        for src, (c, d) in enumerate(old):
            lo, hi = max(a, c), min(b, d)
            if lo < hi:
                out.append(Move(src, dst, lo, hi))
    return out


def interleaved_assignment(counts: Sequence[int]) -> list[list[int]]:
    """VN ids for workers running ``counts[w]`` VNs each, handed out round by round: in round
    ``i`` every worker with more than ``i`` VNs takes the next id. So each round's leaves are
    consecutive VN ids, and an owner folds them in VN order as they arrive."""
    out: list[list[int]] = [[] for _ in counts]
    vn = 0
    for i in range(max(counts, default=0)):
        for w, c in enumerate(counts):
            if c > i:
                out[w].append(vn)
                vn += 1
    return out


class InOrderFold:
    """Which additions fold the leaves ``0 .. V-1`` of the fixed tree, given in order.

    :meth:`push` takes the next leaf and returns the combinations it completes, as
    ``(left, right, parent)`` nodes, in the order they must be done (each parent is
    ``left + right``, and is then a finished subtree). The caller holds one vector per node on
    the stack (:attr:`stack`); after the last leaf the stack holds the root only."""

    def __init__(self, virtual_nodes: int) -> None:
        if virtual_nodes < 1:
            raise ValueError(f"InOrderFold: virtual_nodes={virtual_nodes} must be at least 1")
        self.virtual_nodes = virtual_nodes
        self.parent: dict[tuple[Node, Node], Node] = {}
        todo = [(0, virtual_nodes)]
        while todo:
            node = todo.pop()
            if node[1] - node[0] > 1:
                left, right = split(node)
                self.parent[(left, right)] = node
                todo += [left, right]
        self.stack: list[Node] = []
        self.next = 0

    def push(self) -> list[tuple[Node, Node, Node]]:
        """Leaf ``self.next`` arrives; returns the combinations now due, innermost first."""
        if self.next >= self.virtual_nodes:
            raise ValueError(f"InOrderFold: all {self.virtual_nodes} leaves were pushed already")
        self.stack.append((self.next, self.next + 1))
        self.next += 1
        done = []
        while len(self.stack) >= 2:
            parent = self.parent.get((self.stack[-2], self.stack[-1]))
            if parent is None:
                break
            right = self.stack.pop()
            left = self.stack.pop()
            self.stack.append(parent)
            done.append((left, right, parent))
        return done

    @property
    def complete(self) -> bool:
        return self.next == self.virtual_nodes and len(self.stack) == 1
