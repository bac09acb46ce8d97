"""Edge-cut partitions with ghost vertices, and the vertex intervals inside them (pure).

Scheme (documented, simple, deterministic): the vertices are ordered by SciPy's reverse
Cuthill-McKee (``scipy.sparse.csgraph.reverse_cuthill_mckee`` on the symmetrised adjacency), which
puts neighbours close together in the order; the order is cut into ``P`` contiguous ranges of
about equal gather work (one unit per vertex plus one per in-edge, self loop included), one per
graph server; each range is cut the same way into ``K`` intervals, the unit of tensor work and
of bounded asynchrony. ``order="natural"`` keeps the vertex ids' order instead.

Every edge ``u -> v`` belongs to the interval owning ``v`` (edge-cut: the edges into a vertex
live with it). An interval's *sources* are its own vertices (first, in order) followed by the
other sources of its in-edges; a source owned by another graph server is a *ghost* of this
interval's server, kept in a local copy refreshed by scatter (one batched message per
destination server per interval and layer).

Invariants: the intervals partition the vertices; every in-edge of an interval's vertex is in
that interval's edge list exactly once; local ids index ``sources`` (edge sources) and the own
vertices (targets, ``[0, n_own)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

ORDERS = ("rcm", "natural")


@dataclass(slots=True)
class Interval:
    index: int
    server: int
    own: Tensor  # global ids of the interval's vertices
    sources: Tensor  # global ids: own first, then the other sources of its in-edges
    edge_ids: Tensor  # positions in the global (self-looped) edge list of its in-edges
    edge_index: Tensor  # local: row 0 indexes sources, row 1 indexes own
    in_neighbours: tuple[int, ...] = ()  # other intervals whose vertices are among the sources
    readers: tuple[int, ...] = ()  # other intervals that read this interval's vertices

    @property
    def n_own(self) -> int:
        return int(self.own.numel())


@dataclass(slots=True)
class Plan:
    """Partitions, intervals and ghost sets of one graph."""

    num_nodes: int
    num_servers: int
    intervals: list[Interval]
    owner_interval: Tensor  # vertex -> interval index
    server_intervals: list[list[int]] = field(default_factory=list)
    server_vertices: list[Tensor] = field(default_factory=list)  # vertices each server keeps rows of

    def ghosts(self, server: int) -> Tensor:
        """Vertices server ``server`` keeps copies of but does not own."""
        rows = self.server_vertices[server]
        owner_server = torch.tensor([self.intervals[k].server for k in range(len(self.intervals))])
        return rows[owner_server[self.owner_interval[rows]] != server]

    def edge_cut(self) -> int:
        """Edges whose source is owned by another server than their target's."""
        owner_server = torch.tensor([iv.server for iv in self.intervals])
        cut = 0
        for iv in self.intervals:
            src = iv.sources[iv.edge_index[0]]
            cut += int((owner_server[self.owner_interval[src]] != iv.server).sum())
        return cut


def check_counts(num_nodes: int, graph_servers: int, intervals_per_server: int) -> None:
    if not isinstance(graph_servers, int) or graph_servers < 1:
        raise ValueError(f"graph_servers={graph_servers!r} must be an int >= 1; pass --graph-servers P")
    if not isinstance(intervals_per_server, int) or intervals_per_server < 1:
        raise ValueError(f"intervals={intervals_per_server!r} (per graph server) must be an int >= 1; pass --intervals K")
    if graph_servers > num_nodes:
        raise ValueError(f"graph_servers={graph_servers} is more than the graph's {num_nodes} vertices; each graph "
                         f"server needs at least one vertex: use --graph-servers <= {num_nodes}")
    if graph_servers * intervals_per_server > num_nodes:
        raise ValueError(f"graph_servers={graph_servers} x intervals={intervals_per_server} = "
                         f"{graph_servers * intervals_per_server} intervals for {num_nodes} vertices; every interval "
                         f"needs a vertex: lower --intervals")


def vertex_order(edge_index: Tensor, num_nodes: int, order: str = "rcm") -> Tensor:
    """The vertex order the contiguous ranges are cut from."""
    if order == "natural":
        return torch.arange(num_nodes)
    if order != "rcm":
        raise ValueError(f"order={order!r} is not a partition order; choose one of {ORDERS}")
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import reverse_cuthill_mckee

    src, dst = edge_index.numpy()
    a = coo_matrix((np.ones(len(src), dtype=np.int8), (src, dst)), shape=(num_nodes, num_nodes)).tocsr()
    a = (a + a.T).tocsr()
    return torch.from_numpy(reverse_cuthill_mckee(a, symmetric_mode=True).astype(np.int64))


def balanced_cuts(weights: Tensor, parts: int) -> list[int]:
    """Cut points ``0 = c_0 < ... < c_parts = n`` of contiguous ranges of about equal weight sum,
    each range non-empty (``parts <= n``)."""
    n = int(weights.numel())
    cum = torch.cumsum(weights.double(), 0)
    total = float(cum[-1])
    cuts = [0]
    for j in range(1, parts):
        c = int(torch.searchsorted(cum, total * j / parts).item()) + 1
        c = max(c, cuts[-1] + 1)  # non-empty
        c = min(c, n - (parts - j))  # leave one vertex per remaining range
        cuts.append(c)
    cuts.append(n)
    return cuts


def partition(edge_index: Tensor, num_nodes: int, graph_servers: int, intervals_per_server: int,
              order: str = "rcm") -> Plan:
    """Partition a graph whose ``edge_index`` already holds every edge the layers use (self loops
    included)."""
    check_counts(num_nodes, graph_servers, intervals_per_server)
    perm = vertex_order(edge_index, num_nodes, order)
    indeg = torch.bincount(edge_index[1], minlength=num_nodes)
    work = (1 + indeg)[perm]
    server_cuts = balanced_cuts(work, graph_servers)
    bounds: list[tuple[int, int, int]] = []  # (server, lo, hi) in the order
    for p in range(graph_servers):
        lo, hi = server_cuts[p], server_cuts[p + 1]
        k = min(intervals_per_server, hi - lo)
        cuts = balanced_cuts(work[lo:hi], k)
        bounds += [(p, lo + cuts[j], lo + cuts[j + 1]) for j in range(k)]
    owner = torch.empty(num_nodes, dtype=torch.long)
    for k, (_, lo, hi) in enumerate(bounds):
        owner[perm[lo:hi]] = k
    # Edges grouped by their target's interval, keeping the global edge order inside a group.
    edge_owner = owner[edge_index[1]]
    sorted_ids = torch.sort(edge_owner, stable=True).indices
    counts = torch.bincount(edge_owner, minlength=len(bounds)).tolist()
    groups = torch.split(sorted_ids, counts)
    local = torch.full((num_nodes,), -1, dtype=torch.long)
    intervals: list[Interval] = []
    for k, (p, lo, hi) in enumerate(bounds):
        own = perm[lo:hi].clone()
        eids = groups[k]
        src, dst = edge_index[0, eids], edge_index[1, eids]
        others = torch.unique(src[owner[src] != k])
        sources = torch.cat([own, others])
        local[sources] = torch.arange(sources.numel())
        ei = torch.stack([local[src], local[dst]])
        local[sources] = -1
        nbrs = tuple(sorted(set(owner[others].tolist())))
        intervals.append(Interval(k, p, own, sources, eids, ei, nbrs))
    readers: list[set[int]] = [set() for _ in intervals]
    for iv in intervals:
        for k in iv.in_neighbours:
            readers[k].add(iv.index)
    for iv in intervals:
        iv.readers = tuple(sorted(readers[iv.index]))
    server_intervals = [[iv.index for iv in intervals if iv.server == p] for p in range(graph_servers)]
    server_vertices = [torch.unique(torch.cat([intervals[k].sources for k in ks])) for ks in server_intervals]
    return Plan(num_nodes, graph_servers, intervals, owner, server_intervals, server_vertices)
