"""Dorylus-style GNN training: graph servers, stateless tensor workers, a parameter server with
weight stashing, and bounded asynchrony (see docs/gnn.md).

    from torch_geometric.nn import GCNConv
    from virtualflow.gnn import GNNJob, GNNModel, sbm_graph, train_dorylus

    job = GNNJob(graph=sbm_graph(10_000), model=lambda: GNNModel([GCNConv(32, 16), GCNConv(16, 8)]), epochs=50)
    result = train_dorylus(job, graph_servers=2, tensor_workers=2, intervals=4, staleness=0)

Needs PyTorch Geometric (``pip install torch_geometric``).

This ``__init__`` is the package's public surface, not part of the engine layer: it re-exports
``train_dorylus`` from :mod:`virtualflow.backends.gnn` (the entry point that builds the executor
the options ask for, starting processes where they ask for them), on first use (PEP 562), since
``backends.gnn`` itself imports the engine modules of this package. The modules of ``gnn/``
import nothing from ``backends/``.
"""

from typing import Any

from virtualflow.gnn.baseline import train_pyg
from virtualflow.gnn.data import karate_club, sbm_graph
from virtualflow.gnn.engine import DorylusOptions, GNNResult, ParameterServer
from virtualflow.gnn.job import GNNJob, make_graph
from virtualflow.gnn.layers import GNNModel
from virtualflow.gnn.price import PriceModel, value
from virtualflow.gnn.workers import WorkerLimits

__all__ = ["DorylusOptions", "GNNJob", "GNNModel", "GNNResult", "ParameterServer", "PriceModel", "WorkerLimits",
           "karate_club", "make_graph", "sbm_graph", "train_dorylus", "train_pyg", "value"]


def __getattr__(name: str) -> Any:
    if name == "train_dorylus":
        from virtualflow.backends.gnn import train_dorylus

        return train_dorylus
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
