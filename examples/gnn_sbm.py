"""A GNN job for ``virtualflow gnn``: a 2-layer GCN on a generated stochastic-block graph
(class-conditional features, nothing downloaded).

    virtualflow gnn examples/gnn_sbm.py --graph-servers 2 --tensor-workers 2 --staleness 0 --baselines cpu,pyg
    virtualflow gnn examples/gnn_sbm.py:make_gat_job -P 2 -L 2 -S 1 --mode simulated

Size with the environment-free knobs below (edit ``NUM_NODES``) or call ``make_job(num_nodes=...)``.
"""

from __future__ import annotations

from torch_geometric.nn import GATConv, GCNConv

from virtualflow.gnn import GNNJob, GNNModel, sbm_graph

NUM_NODES = 10_000
CLASSES = 8
FEATURES = 32


def make_job(num_nodes: int = NUM_NODES, epochs: int = 30, hidden: int = 32) -> GNNJob:
    graph = sbm_graph(num_nodes=num_nodes, classes=CLASSES, features=FEATURES, avg_degree_in=8, avg_degree_out=4,
                      feature_noise=3.0, seed=0)
    return GNNJob(graph=graph, model=lambda: GNNModel([GCNConv(FEATURES, hidden), GCNConv(hidden, CLASSES)]),
                  epochs=epochs, seed=0, name="gcn-sbm")


def make_gat_job(num_nodes: int = 2_000, epochs: int = 20) -> GNNJob:
    graph = sbm_graph(num_nodes=num_nodes, classes=CLASSES, features=FEATURES, avg_degree_in=8, avg_degree_out=4,
                      feature_noise=3.0, seed=0)
    return GNNJob(graph=graph, epochs=epochs, seed=0, name="gat-sbm",
                  model=lambda: GNNModel([GATConv(FEATURES, 8, heads=4), GATConv(32, CLASSES, heads=1)],
                                         activation="elu"))
