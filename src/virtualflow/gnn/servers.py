"""Graph servers: each owns one partition's intervals, their in-edges and the rows of their
sources (own and ghost), and runs the graph-parallel tasks: gather forward and backward (with
GAT's apply-edge), the scatter of rows and gradient contributions into its tables, and the
fetches that feed tensor workers.

The same :class:`GraphServer` object runs in the driver's process (simulated mode) or in a
process of its own (``serve`` in :mod:`virtualflow.backends.gnn`); requests are plain tuples and the replies plain tensors, so
both modes run the same code.

Invariants: a table row is overwritten only by a newer epoch's value of the same vertex (the
driver scatters in epoch order per interval); a gather's inputs are stashed until its backward
(so the backward differentiates exactly what the forward computed); gradient contributions are
kept per (layer, target interval, source interval), the latest of each, and summed in source
order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from virtualflow.gnn.layers import LayerSpec, graph_op
from virtualflow.gnn.workers import run_tensor_task


@dataclass(slots=True)
class IntervalPart:
    """What a graph server holds of one of its intervals."""

    n_own: int
    src_pos: Tensor  # table positions of the interval's sources
    edge_index: Tensor  # local ids
    edge_weight: dict[int, Tensor]  # GCN layer -> weights of the interval's in-edges
    x: Tensor  # features of the own vertices
    # Where the gradients w.r.t. the sources go: (target interval, rows of sources, rows of its own)
    contrib_to: list[tuple[int, Tensor, Tensor]] = field(default_factory=list)


@dataclass(slots=True)
class ServerPart:
    """Everything a graph server process starts from (picklable)."""

    server: int
    num_rows: int  # own + ghost rows in its tables
    intervals: dict[int, IntervalPart]
    feed_pos: dict[int, Tensor]  # interval k -> table positions of the rows of k this server receives
    convs: list[nn.Module]
    specs: tuple[LayerSpec, ...]
    activation: str
    interval_server: list[int]  # interval -> its graph server


class GraphServer:
    def __init__(self, part: ServerPart) -> None:
        self.part = part
        self.tables = [torch.zeros(part.num_rows, s.row_dim) for s in part.specs]
        self.stash_in: dict[tuple[int, int, int], Tensor] = {}
        self.stash_z: dict[tuple[int, int, int], Tensor] = {}
        self.contrib: dict[tuple[int, int], dict[int, tuple[int, Tensor, Tensor]]] = {}
        for c in part.convs:
            c.eval()  # GAT's attention dropout is 0 anyway; no training-mode branches on servers

    # ---- one-way messages (scatter) -------------------------------------------------------

    def put_rows(self, l: int, k: int, epoch: int, rows: Tensor) -> None:
        self.tables[l][self.part.feed_pos[k]] = rows

    def put_contrib(self, l: int, k: int, src: int, epoch: int, idx: Tensor, rows: Tensor) -> None:
        self.contrib.setdefault((l, k), {})[src] = (epoch, idx, rows)

    # ---- requests -------------------------------------------------------------------------

    def gather(self, l: int, i: int, epoch: int) -> Tensor:
        """Forward apply-edge + gather of layer ``l`` for interval ``i``: its rows before the bias."""
        iv = self.part.intervals[i]
        x_src = self.tables[l][iv.src_pos]
        self.stash_in[(l, i, epoch)] = x_src
        with torch.no_grad():
            z = graph_op(self.part.convs[l], self.part.specs[l], x_src, iv.n_own, iv.edge_index,
                         iv.edge_weight.get(l))
        if l + 1 < len(self.part.specs):  # the input of apply-vertex l + 1's backward (the last one gets it directly)
            self.stash_z[(l, i, epoch)] = z
        return z

    def gather_backward(self, l: int, i: int, epoch: int, grad_z: Tensor) -> dict[int, list[tuple[int, Tensor, Tensor]]]:
        """Backward of ``gather(l, i, epoch)``: the gradients w.r.t. its sources' rows, kept here for
        this server's intervals and returned, grouped by graph server, for the others'."""
        iv = self.part.intervals[i]
        x_src = self.stash_in.pop((l, i, epoch)).detach().requires_grad_(True)
        with torch.enable_grad():
            z = graph_op(self.part.convs[l], self.part.specs[l], x_src, iv.n_own, iv.edge_index,
                         iv.edge_weight.get(l))
            (g,) = torch.autograd.grad(z, x_src, grad_z)
        remote: dict[int, list[tuple[int, Tensor, Tensor]]] = {}
        for k, sel, idx in iv.contrib_to:
            rows = g[sel]
            p = self.part.interval_server[k]
            if p == self.part.server:
                self.put_contrib(l, k, i, epoch, idx, rows)
            else:
                remote.setdefault(p, []).append((k, idx, rows))
        return remote

    def fetch(self, l: int, i: int, epoch: int, with_grad: bool) -> tuple[Tensor, Tensor | None, list[int]]:
        """The input rows of apply-vertex ``l`` of interval ``i`` in ``epoch`` (features, or the
        stashed gather output of layer ``l - 1``) and, with ``with_grad``, the summed gradient
        contributions to its output rows (and the epochs they came from)."""
        iv = self.part.intervals[i]
        if l == 0:
            x = iv.x
        elif with_grad:
            x = self.stash_z.pop((l - 1, i, epoch))
        else:
            x = self.stash_z[(l - 1, i, epoch)]
        if not with_grad:
            return x, None, []
        g = torch.zeros(iv.n_own, self.part.specs[l].row_dim)
        epochs = []
        for src, (e, idx, rows) in sorted(self.contrib.get((l, i), {}).items()):
            g.index_add_(0, idx, rows)
            epochs.append(e)
        return x, g, epochs

    def tensor(self, task: dict) -> dict:
        """CPU-only mode: this server also does the tensor work."""
        return run_tensor_task(self.part.specs, self.part.activation, task)

    def handle(self, req: tuple) -> Any:
        op, *args = req
        if op == "rows":
            return self.put_rows(*args)
        if op == "contrib":
            for k, idx, rows in args[3]:
                self.put_contrib(args[0], k, args[1], args[2], idx, rows)
            return None
        if op == "gather":
            return self.gather(*args)
        if op == "gather_backward":
            return self.gather_backward(*args)
        if op == "fetch":
            return self.fetch(*args)
        if op == "ping":
            return "pong"
        if op == "tensor":
            return self.tensor(*args)
        raise ValueError(f"graph server: unknown request {op!r}")
