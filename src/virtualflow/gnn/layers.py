"""GNN layers in gather / apply-vertex / scatter / apply-edge form, on PyTorch Geometric's own layers.

A model is a stack of PyG convolutions (``GCNConv``, ``GATConv``) with one activation between
them (:class:`GNNModel`, whose ``forward`` *is* the single-process reference). Dorylus runs each
convolution as two kinds of task, and this module says how a PyG layer splits into them:

* **apply-vertex (AV)**, per vertex, on tensor workers: the layer's dense part. ``vertex_op(l)``
  maps the rows of an interval's vertices to the rows the next gather reads:
  ``l = 0``: ``pre_0(x)``; ``0 < l < L``: ``pre_l(act(z + bias_{l-1}))``; ``l = L``:
  ``z + bias_{L-1}`` (the logits; the loss is taken there). ``pre`` is the conv's linear map
  (GCN) or linear map plus the per-vertex attention scores ``<h, att_src>``, ``<h, att_dst>``
  (GAT), stored side by side in one row.
* **scatter**: the rows are sent to the graph servers holding them as owners or ghosts.
* **apply-edge (AE) + gather (GA)**, per edge, on graph servers: the aggregation over in-edges,
  done with the conv's own PyG ``propagate`` (and, for GAT, its ``edge_updater``: LeakyReLU of the
  summed scores and the softmax over each vertex's in-edges, which has no parameters of its own;
  so it runs where the edges are instead of shipping every edge to a tensor worker).

Rewriting ``conv(x)`` this way is exact algebra (GCN: ``A (X W) = propagate(lin(X))``; the bias
and activation move into the next AV), so the distributed result equals ``GNNModel.forward`` up
to float summation order. The parameter names are PyG's (``convs.0.lin.weight``...): the
parameter server holds a :class:`GNNModel` and the workers get plain tensors.

Supported configurations (others raise ``ValueError`` naming the knob): ``GCNConv`` with
``normalize=True, add_self_loops=True``; ``GATConv`` with an int ``in_channels``, ``dropout=0``,
``add_self_loops=True``, no ``edge_dim``, no ``residual``. Every layer of a model shares one edge
set: the graph's edges (self loops removed) plus one self loop per vertex.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ACTIVATIONS = ("relu", "elu")


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """What a worker needs to run one conv's dense part: plain data, cheap to ship."""

    kind: str  # "gcn" | "gat"
    in_channels: int
    out_channels: int  # per head for GAT
    heads: int = 1
    concat: bool = True
    negative_slope: float = 0.2
    improved: bool = False  # GCN: self-loop weight 2

    @property
    def row_dim(self) -> int:
        """Width of the AV output row the gather reads."""
        if self.kind == "gcn":
            return self.out_channels
        return self.heads * self.out_channels + 2 * self.heads

    @property
    def out_dim(self) -> int:
        """Width of the gather's output (before the bias)."""
        if self.kind == "gcn" or not self.concat:
            return self.out_channels
        return self.heads * self.out_channels

    def param_names(self) -> tuple[str, ...]:
        return ("lin.weight",) if self.kind == "gcn" else ("lin.weight", "att_src", "att_dst")


def spec_of(conv: nn.Module, index: int) -> LayerSpec:
    """The :class:`LayerSpec` of a PyG conv, or a ``ValueError`` naming what is not supported."""
    from torch_geometric.nn import GATConv, GCNConv

    where = f"layer {index} ({type(conv).__name__})"
    if isinstance(conv, GCNConv):
        if not conv.normalize or not conv.add_self_loops:
            raise ValueError(f"{where}: normalize={conv.normalize}, add_self_loops={conv.add_self_loops}; the "
                             f"Dorylus engine supports GCNConv(normalize=True, add_self_loops=True) only")
        if conv.lin.bias is not None:
            raise ValueError(f"{where}: its linear map has a bias; build GCNConv with its default lin (no bias)")
        return LayerSpec("gcn", conv.in_channels, conv.out_channels, improved=bool(conv.improved))
    if isinstance(conv, GATConv):
        bad = []
        if conv.lin is None:
            bad.append("in_channels must be an int (no bipartite lin_src/lin_dst)")
        if conv.dropout != 0:
            bad.append(f"dropout={conv.dropout} must be 0 (attention dropout is not supported)")
        if not conv.add_self_loops:
            bad.append("add_self_loops must be True")
        if conv.edge_dim is not None or conv.lin_edge is not None:
            bad.append("edge_dim must be None")
        if getattr(conv, "res", None) is not None:
            bad.append("residual must be False")
        if bad:
            raise ValueError(f"{where}: " + "; ".join(bad))
        return LayerSpec("gat", conv.in_channels, conv.out_channels, heads=conv.heads, concat=bool(conv.concat),
                         negative_slope=float(conv.negative_slope))
    raise TypeError(f"{where}: the Dorylus engine supports torch_geometric.nn.GCNConv and GATConv layers; got "
                    f"{type(conv).__name__}")


class GNNModel(nn.Module):
    """A stack of PyG convolutions with ``activation`` between them: the single-process reference.

    ``forward(x, edge_index)`` is plain PyTorch Geometric; the Dorylus engine computes the same
    function split into tasks (see the module docstring).
    """

    def __init__(self, convs: Sequence[nn.Module], activation: str = "relu") -> None:
        super().__init__()
        if not convs:
            raise ValueError("a GNNModel needs at least one convolution; pass convs=[GCNConv(...), ...]")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not supported; choose one of {ACTIVATIONS}")
        self.convs = nn.ModuleList(convs)
        self.activation = activation
        self.specs = tuple(spec_of(c, i) for i, c in enumerate(convs))
        for i in range(1, len(self.specs)):
            if self.specs[i].in_channels != self.specs[i - 1].out_dim:
                raise ValueError(f"layer {i} takes in_channels={self.specs[i].in_channels} but layer {i - 1} "
                                 f"produces {self.specs[i - 1].out_dim}; make them equal")
        covered = {f"convs.{i}.{n}" for i, s in enumerate(self.specs) for n in s.param_names()}
        covered |= {f"convs.{i}.bias" for i, c in enumerate(convs) if c.bias is not None}
        extra = sorted(n for n, _ in self.named_parameters() if n not in covered)
        if extra:
            raise ValueError(f"parameters {extra} are not part of the gather/apply-vertex split; remove them")

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        for i, conv in enumerate(self.convs):
            if i:
                x = activate(x, self.activation)
            x = conv(x, edge_index)
        return x


def activate(x: Tensor, activation: str) -> Tensor:
    return F.relu(x) if activation == "relu" else F.elu(x)


def vertex_param_names(specs: Sequence[LayerSpec], has_bias: Sequence[bool], l: int) -> tuple[str, ...]:
    """The parameters vertex op ``l`` reads (``0 <= l <= L``)."""
    names: list[str] = []
    if l > 0 and has_bias[l - 1]:
        names.append(f"convs.{l - 1}.bias")
    if l < len(specs):
        names += [f"convs.{l}.{n}" for n in specs[l].param_names()]
    return tuple(names)


def vertex_op(specs: Sequence[LayerSpec], activation: str, l: int, params: dict[str, Tensor], x: Tensor) -> Tensor:
    """Apply-vertex ``l`` on the rows ``x`` of one interval (see the module docstring)."""
    if l > 0:
        bias = params.get(f"convs.{l - 1}.bias")
        if bias is not None:
            x = x + bias
        if l == len(specs):
            return x
        x = activate(x, activation)
    s = specs[l]
    h = F.linear(x, params[f"convs.{l}.lin.weight"])
    if s.kind == "gcn":
        return h
    hv = h.view(-1, s.heads, s.out_channels)
    a_src = (hv * params[f"convs.{l}.att_src"]).sum(-1)
    a_dst = (hv * params[f"convs.{l}.att_dst"]).sum(-1)
    return torch.cat([h, a_src, a_dst], dim=1)


def graph_op(conv: nn.Module, spec: LayerSpec, x_src: Tensor, n_dst: int, edge_index: Tensor,
             edge_weight: Tensor | None) -> Tensor:
    """Apply-edge + gather of one interval with the conv's own PyG message passing.

    ``x_src``: AV rows of every source vertex of the interval's in-edges, the interval's own
    ``n_dst`` vertices first; ``edge_index``: local ids (sources index ``x_src``, targets
    ``[0, n_dst)``). Returns the aggregated rows of the ``n_dst`` vertices, before the bias.
    """
    size = (x_src.size(0), n_dst)
    if spec.kind == "gcn":
        return conv.propagate(edge_index, x=x_src, edge_weight=edge_weight, size=size)
    H, C = spec.heads, spec.out_channels
    h = x_src[:, : H * C].view(-1, H, C)
    a_src = x_src[:, H * C: H * C + H]
    a_dst = x_src[:n_dst, H * C + H:]
    alpha = conv.edge_updater(edge_index, alpha=(a_src, a_dst), edge_attr=None, size=size)
    out = conv.propagate(edge_index, x=(h, None), alpha=alpha, size=size)
    return out.reshape(-1, H * C) if spec.concat else out.mean(dim=1)
