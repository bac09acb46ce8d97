"""The GNN job: a graph, a model of PyG layers, an optimizer, epochs and a seed.

``GNNJob`` is the hardware-independent description: for a fixed job and ``staleness=0`` the
Dorylus engine computes the same sequence of weights (within float tolerance) as
:func:`virtualflow.gnn.baseline.train_pyg`, single-process full-graph PyTorch Geometric, whatever
the number of graph servers, tensor workers and intervals.

Validation happens in ``__post_init__`` and names the value, the rule and the knob.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor, nn

from virtualflow.gnn.layers import GNNModel

MASKS = ("train_mask", "val_mask", "test_mask")


def default_optimizer(params) -> torch.optim.Optimizer:
    """Adam(lr=0.01, weight_decay=5e-4): the usual full-graph GCN recipe."""
    return torch.optim.Adam(params, lr=0.01, weight_decay=5e-4)


@dataclass(kw_only=True, slots=True)
class GNNJob:
    graph: Any
    """A ``torch_geometric.data.Data`` with ``x`` (features, float [N, F]), ``edge_index`` ([2, E]),
    ``y`` (class per vertex, long [N]) and ``train_mask`` (bool [N]); ``val_mask`` and
    ``test_mask`` are optional. Build one from tensors with :func:`make_graph`."""
    model: Callable[[], GNNModel] | GNNModel
    """A zero-argument function returning a :class:`GNNModel` (called after ``torch.manual_seed(seed)``,
    so the initial weights are a function of the seed), or a model (copied)."""
    optimizer: Callable[[Any], torch.optim.Optimizer] = default_optimizer
    """Called with the model's parameters on the parameter server (and the reference)."""
    epochs: int = 50
    """Full-graph epochs: one forward and backward over every vertex each."""
    seed: int = 0
    """Seeds the model's initial weights."""
    name: str = "gnn"

    def __post_init__(self) -> None:
        check_graph(self.graph)
        if not isinstance(self.epochs, int) or self.epochs < 1:
            raise ValueError(f"epochs={self.epochs!r} must be an int >= 1; pass --epochs")
        if not (callable(self.model) or isinstance(self.model, GNNModel)):
            raise TypeError(f"model must be a GNNModel or a function returning one; got {type(self.model).__name__}")
        if not callable(self.optimizer):
            raise TypeError("optimizer must be a function taking the parameters and returning a torch optimizer")

    @property
    def num_classes(self) -> int:
        return int(self.graph.y.max()) + 1

    def build_model(self) -> GNNModel:
        """The initial model: a function of the seed only."""
        import copy

        if isinstance(self.model, GNNModel):
            model = copy.deepcopy(self.model)
        else:
            torch.manual_seed(self.seed)
            model = self.model()
        if not isinstance(model, GNNModel):
            raise TypeError(f"the job's model function returned {type(model).__name__}, not virtualflow.gnn.GNNModel")
        f = self.graph.x.size(1)
        if model.specs[0].in_channels != f:
            raise ValueError(f"the model's first layer takes in_channels={model.specs[0].in_channels} but the graph "
                             f"has {f} features per vertex; make them equal")
        if model.specs[-1].out_dim < self.num_classes:
            raise ValueError(f"the model's last layer produces {model.specs[-1].out_dim} outputs but the labels "
                             f"have {self.num_classes} classes; give it >= {self.num_classes} out_channels")
        return model


def make_graph(x: Tensor, edge_index: Tensor, y: Tensor, train_mask: Tensor, val_mask: Tensor | None = None,
               test_mask: Tensor | None = None):
    """A PyG ``Data`` from tensors (checked like a job's graph)."""
    from torch_geometric.data import Data

    g = Data(x=x, edge_index=edge_index, y=y, train_mask=train_mask)
    if val_mask is not None:
        g.val_mask = val_mask
    if test_mask is not None:
        g.test_mask = test_mask
    check_graph(g)
    return g


def check_graph(g: Any) -> None:
    """Raise ``ValueError``/``TypeError`` for a graph the engine cannot train on."""
    for attr in ("edge_index", "y"):
        if getattr(g, attr, None) is None:
            raise ValueError(f"the graph has no {attr}; a GNN job needs x, edge_index, y and train_mask")
    x = getattr(g, "x", None)
    if x is None:
        raise ValueError("the graph has no vertex features (graph.x is None); give every vertex a feature row, "
                         "e.g. graph.x = torch.eye(num_nodes) for one-hot ids")
    if not isinstance(x, Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"graph.x must be a float tensor [num_nodes, num_features]; got "
                         f"{getattr(x, 'dtype', type(x).__name__)} of shape {tuple(getattr(x, 'shape', ()))}")
    n = x.size(0)
    if n < 1:
        raise ValueError("the graph has no vertices")
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        v, f = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"graph.x has {int(bad.sum())} non-finite feature value(s) (first: vertex {v}, feature {f} "
                         f"= {float(x[v, f])}); every feature must be a finite number (training on them gives a "
                         f"NaN loss)")
    ei = g.edge_index
    if not isinstance(ei, Tensor) or ei.dim() != 2 or ei.size(0) != 2 or ei.dtype != torch.long:
        raise ValueError(f"graph.edge_index must be a long tensor [2, num_edges]; got "
                         f"{getattr(ei, 'dtype', '?')} {tuple(getattr(ei, 'shape', ()))}")
    if ei.numel() and (int(ei.min()) < 0 or int(ei.max()) >= n):
        raise ValueError(f"graph.edge_index holds vertex ids in [{int(ei.min())}, {int(ei.max())}] but graph.x has "
                         f"{n} rows; ids must lie in [0, {n})")
    y = g.y
    if not isinstance(y, Tensor) or y.shape != (n,) or y.dtype != torch.long or (n and int(y.min()) < 0):
        raise ValueError(f"graph.y must be a long tensor [{n}] of class ids >= 0 (one per vertex); got "
                         f"{getattr(y, 'dtype', '?')} of shape {tuple(getattr(y, 'shape', ()))}")
    for name in MASKS:
        m = getattr(g, name, None)
        if m is None:
            if name == "train_mask":
                raise ValueError("the graph has no train_mask; set graph.train_mask (bool [num_nodes])")
            continue
        if not isinstance(m, Tensor) or m.dtype != torch.bool or m.dim() != 1:
            raise ValueError(f"graph.{name} must be a bool tensor [num_nodes]; got "
                             f"{getattr(m, 'dtype', type(m).__name__)} {tuple(getattr(m, 'shape', ()))}")
        if m.numel() != n:
            raise ValueError(f"graph.{name} has {m.numel()} entries but the graph has {n} vertices; a mask must "
                             f"cover every vertex (one bool per vertex)")
    if not bool(g.train_mask.any()):
        raise ValueError("graph.train_mask selects no vertex; mark at least one training vertex")


@dataclass(slots=True)
class PreparedGraph:
    """The graph as every layer sees it: self loops removed, then one per vertex added."""

    x: Tensor
    y: Tensor
    masks: dict[str, Tensor]
    edge_index: Tensor  # without self loops: the reference model's input
    looped: Tensor  # with one self loop per vertex: what the engine's layers aggregate over
    num_nodes: int
    edge_weights: dict[int, Tensor] = field(default_factory=dict)  # GCN layer -> normalised weights of `looped`


def prepare(job: GNNJob, model: nn.Module) -> PreparedGraph:
    from torch_geometric.nn.conv.gcn_conv import gcn_norm
    from torch_geometric.utils import add_self_loops, remove_self_loops

    g = job.graph
    n = g.x.size(0)
    ei, _ = remove_self_loops(g.edge_index)
    looped, _ = add_self_loops(ei, num_nodes=n)
    masks = {m: getattr(g, m) for m in MASKS if getattr(g, m, None) is not None}
    pg = PreparedGraph(g.x.float(), g.y, masks, ei, looped, n)
    for l, spec in enumerate(model.specs):
        if spec.kind == "gcn":
            # Normalised with the global degrees, as GCNConv does on the whole graph.
            # Exactly GCNConv's own normalisation of the whole graph (global degrees); its edge list
            # is the graph's edges followed by one self loop per vertex, i.e. ``looped``.
            ei_n, w = gcn_norm(ei, None, n, improved=spec.improved, add_self_loops=True, dtype=pg.x.dtype)
            if not torch.equal(ei_n, looped):  # a PyG version that orders them differently: align
                pos = {(int(a), int(b)): j for j, (a, b) in enumerate(ei_n.t().tolist())}
                w = w[torch.tensor([pos[(int(a), int(b))] for a, b in looped.t().tolist()])]
            pg.edge_weights[l] = w
    return pg
