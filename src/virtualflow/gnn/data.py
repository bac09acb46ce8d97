"""Graphs that need no download.

* :func:`karate_club`: Zachary's karate club (34 vertices, 78 edges, 4 communities as PyG's
  ``KarateClub`` labels them), from networkx's bundled copy; one-hot features.
* :func:`sbm_graph`: a generated stochastic-block graph (``num_nodes`` vertices in ``classes``
  blocks; an edge inside a block with probability ``p_in``, across with ``p_out``, chosen from
  the average degrees) with class-conditional Gaussian features (a class mean plus noise), and
  random train/val/test masks. Generated with torch in ``O(edges)`` memory (edges drawn per block
  pair from a binomial count, no dense matrix), so 10k-200k vertices take seconds. Deterministic
  in ``seed``.
"""

from __future__ import annotations

import torch

from virtualflow.gnn.job import make_graph


def karate_club(train_per_class: int = 1, seed: int = 0):
    """Karate club with PyG's 4-community labels; ``train_per_class`` training vertices per class,
    the rest split between validation and test."""
    import networkx as nx
    from torch_geometric.datasets import KarateClub

    g = nx.karate_club_graph()
    n = g.number_of_nodes()
    edges = torch.tensor(list(g.edges()), dtype=torch.long).t()
    edge_index = torch.cat([edges, edges.flip(0)], dim=1)
    y = KarateClub()[0].y.clone()  # generated in-memory by PyG from the same graph; nothing is downloaded
    return make_graph(torch.eye(n), edge_index, y, *_masks(y, train_per_class, seed))


def sbm_graph(num_nodes: int = 10_000, classes: int = 8, features: int = 32, avg_degree_in: float = 8.0,
              avg_degree_out: float = 2.0, feature_noise: float = 3.0, train_per_class: int = 20, seed: int = 0):
    """A stochastic-block graph with class-conditional features (see the module docstring)."""
    if num_nodes < classes:
        raise ValueError(f"num_nodes={num_nodes} must be >= classes={classes}")
    if avg_degree_in < 0 or avg_degree_out < 0:
        raise ValueError("avg_degree_in and avg_degree_out must be >= 0")
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (num_nodes,), generator=gen)
    members = [(y == c).nonzero().flatten() for c in range(classes)]
    src_all, dst_all = [], []
    for a in range(classes):
        for b in range(a, classes):
            na, nb = members[a].numel(), members[b].numel()
            if na == 0 or nb == 0:
                continue
            if a == b:  # each vertex has na - 1 candidates inside its block
                pairs, p = na * (na - 1) / 2, min(1.0, avg_degree_in / max(na - 1, 1))
            else:  # and about num_nodes - num_nodes / classes outside it
                pairs, p = na * nb, min(1.0, avg_degree_out / max(num_nodes - num_nodes / classes, 1))
            m = int(round(pairs * p))  # edges drawn uniformly among the pairs (duplicates merged below)
            if m == 0:
                continue
            i = torch.randint(0, na, (m,), generator=gen)
            j = torch.randint(0, nb, (m,), generator=gen)
            s, d = members[a][i], members[b][j]
            keep = s != d
            src_all.append(s[keep])
            dst_all.append(d[keep])
    src, dst = torch.cat(src_all), torch.cat(dst_all)
    ei = torch.cat([torch.stack([src, dst]), torch.stack([dst, src])], dim=1)
    ei = torch.unique(ei, dim=1)
    means = torch.randn(classes, features, generator=gen)
    x = means[y] + feature_noise * torch.randn(num_nodes, features, generator=gen)
    return make_graph(x, ei, y, *_masks(y, train_per_class, seed))


def _masks(y: torch.Tensor, train_per_class: int, seed: int):
    n = y.numel()
    gen = torch.Generator().manual_seed(seed + 1)
    train = torch.zeros(n, dtype=torch.bool)
    for c in range(int(y.max()) + 1):
        idx = (y == c).nonzero().flatten()
        idx = idx[torch.randperm(idx.numel(), generator=gen)[:train_per_class]]
        train[idx] = True
    rest = (~train).nonzero().flatten()
    rest = rest[torch.randperm(rest.numel(), generator=gen)]
    half = rest.numel() // 2
    val = torch.zeros(n, dtype=torch.bool)
    test = torch.zeros(n, dtype=torch.bool)
    val[rest[:half]] = True
    test[rest[half:]] = True
    return train, val, test
