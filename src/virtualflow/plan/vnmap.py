"""Virtual-node maps and the fixed reduction tree over VN ids. Pure code, no processes.

A *VN map* says which virtual nodes each worker runs in one generation. The default map gives
every worker a contiguous block of VN ids, as equal as possible (V=8 on 3 workers:
``[0, 1, 2] [3, 4, 5] [6, 7]``).

The *reduction tree* fixes the order in which per-VN gradients are summed in deterministic mode:
``node(lo, hi) = node(lo, mid) + node(mid, hi)`` with ``mid = (lo + hi) // 2``, leaves being single
VNs. It depends on V only, so every mapping of VNs onto workers sums in the same order and the
result is bit-identical. A worker computes the largest subtrees that lie inside its own VN block;
the few nodes that cross workers are combined after an exchange. A worker may have no VN at all
(the heterogeneous solver gives none to a worker too slow to help): it contributes no node and
still takes part in the exchange, so the sum is the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

Node = tuple[int, int]  # half-open VN range [lo, hi) of one tree node


def contiguous_assignment(virtual_nodes: int, workers: int) -> list[list[int]]:
    """Split ``range(virtual_nodes)`` into ``workers`` contiguous blocks, sizes differing by <= 1."""
    if workers < 1:
        raise ValueError(f"workers={workers} must be at least 1")
    if virtual_nodes < workers:
        raise ValueError(
            f"virtual_nodes={virtual_nodes} is smaller than workers={workers}; every worker needs "
            f"at least one virtual node: use at most {virtual_nodes} workers or raise virtual_nodes"
        )
    base, extra = divmod(virtual_nodes, workers)
    out, start = [], 0
    for w in range(workers):
        n = base + (1 if w < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


def pipeline_assignment(virtual_nodes: int, workers: int, stages: int) -> list[list[int]]:
    """VN map of a pipelined job: worker ``r`` is in pipeline replica ``r // stages`` and runs, as
    micro-batches, the contiguous VN block of its replica (every stage of a replica runs the same
    VNs). ``workers`` must be a multiple of ``stages``; every replica needs a VN."""
    if workers % stages:
        raise ValueError(f"workers={workers} is not a multiple of stages={stages}; a pipelined job runs whole "
                         f"pipelines: use a multiple of {stages} workers")
    replicas = workers // stages
    if virtual_nodes < replicas:
        raise ValueError(
            f"virtual_nodes={virtual_nodes} is smaller than the {replicas} pipeline replicas ({workers} workers / "
            f"{stages} stages); every replica needs at least one virtual node: use at most "
            f"{virtual_nodes * stages} workers or raise virtual_nodes"
        )
    blocks = contiguous_assignment(virtual_nodes, replicas)
    return [list(blocks[r // stages]) for r in range(workers)]


def describe_assignment(assignment: Sequence[Sequence[int]]) -> str:
    """``worker 0 runs VNs 0-3, worker 1 runs VNs 4-7`` (ranges collapsed)."""
    parts = []
    for w, vns in enumerate(assignment):
        if not vns:
            parts.append(f"worker {w} runs no VN")
            continue
        parts.append(f"worker {w} runs VN{'s' if len(vns) != 1 else ''} {_ranges(vns)}")
    return ", ".join(parts)


def _ranges(vns: Sequence[int]) -> str:
    if not vns:
        return "none"
    out, start, prev = [], vns[0], vns[0]
    for v in list(vns[1:]) + [None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ",".join(out)


def split(node: Node) -> tuple[Node, Node]:
    lo, hi = node
    mid = (lo + hi) // 2
    return (lo, mid), (mid, hi)


def covering_nodes(virtual_nodes: int, lo: int, hi: int) -> list[Node]:
    """Maximal tree nodes lying inside ``[lo, hi)``, left to right.

    These are what one worker holding VNs ``lo..hi-1`` can reduce on its own.
    """
    out: list[Node] = []

    def visit(node: Node) -> None:
        a, b = node
        if b <= lo or a >= hi:
            return
        if lo <= a and b <= hi:
            out.append(node)
            return
        left, right = split(node)
        visit(left)
        visit(right)

    visit((0, virtual_nodes))
    return out


@dataclass(frozen=True, slots=True)
class TreePlan:
    """Which tree nodes each worker contributes, for one VN map.

    ``slots`` lists every contributed node in a fixed order (worker by worker); a worker writes
    its nodes into its slots of a shared buffer and one all-reduce of that buffer gives every
    worker every contribution (each slot has exactly one non-zero writer, and ``x + 0 == x``
    exactly, so the exchange itself adds no rounding).
    """

    virtual_nodes: int
    per_worker: tuple[tuple[Node, ...], ...]

    @classmethod
    def build(cls, assignment: Sequence[Sequence[int]]) -> "TreePlan":
        v = sum(len(a) for a in assignment)
        per_worker = []
        for vns in assignment:
            if not vns:  # a worker with no VN contributes no node (it still takes part in the exchange)
                per_worker.append(())
                continue
            if list(vns) != list(range(vns[0], vns[0] + len(vns))):
                raise ValueError(f"deterministic reduction needs contiguous VN blocks, got {vns}")
            per_worker.append(tuple(covering_nodes(v, vns[0], vns[0] + len(vns))))
        return cls(v, tuple(per_worker))

    @property
    def slots(self) -> list[Node]:
        return [n for nodes in self.per_worker for n in nodes]
