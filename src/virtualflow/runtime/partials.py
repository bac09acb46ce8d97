"""Deterministic mode's partial sums, built without copying each VN's gradient.

A *leaf* is one VN's vector ``[gradients (parameter order) | BatchNorm statistics | weighted
loss]``; a tree node is the sum of its two children (:mod:`virtualflow.plan.vnmap`). The
straightforward way (one fresh vector per leaf: the VN's gradients concatenated, then added into
the left sibling) costs an allocation and a copy of the whole gradient per VN. Here a node's sum
is held, while it is built, as one tensor per parameter (a :class:`Sum`):

* the first VN of a sum keeps the gradients autograd produced for it (they are owned from then
  on: no copy), zeros for a parameter without one: exactly the leaf;
* a node whose right child is a single VN lets that VN's backward **accumulate into the left
  sum**: the parameters' ``.grad`` are the left sum's tensors and autograd adds each gradient in
  place (``grad += g``), which is, element for element, the tree's ``left + leaf`` (one IEEE
  addition; addition is commutative). A parameter the VN leaves without a gradient gets
  ``+ 0.0``, as a leaf of zeros would (it turns ``-0.0`` into ``0.0``);
* any other node adds its right sum into its left one, tensor by tensor;
* a finished partial sum is exchanged as it is: the ``owners`` exchange sends its pieces straight
  from its per-parameter tensors (:class:`Segmented`: a range inside one tensor is a view; the
  exchange's pieces are cut at large parameters' edges, so only runs of small parameters are
  gathered); the ``slots`` exchange, which sums whole vectors, has it copied once into a flat
  buffer of a pool (reused every step: a fresh vector of hundreds of MB is faulted in page by
  page).

So each node holds the same bits as :func:`virtualflow.comm.reduce.tree_reduce_local` gives it,
while a worker pays, beyond the default mode's accumulation, one copy per partial sum and an
addition per node whose right child is not a single VN.

The ``owners`` exchange wants the last partial sum piece by piece during the last backward
(:meth:`Partials.streamed`): its last VN accumulates into the innermost left sum on the
partial's right spine (or, with no spine, is copied in bucket by bucket), and as soon as a
gradient bucket is complete its tensors are added up the spine (``S_1 + (S_2 + (... + leaf))``,
innermost first, in place into the spine's tensors) and handed to ``send(piece)`` from there.

Used only when every trainable parameter has one dtype and dense strided storage (the statistics
and the loss are stored in that dtype too); the engine falls back to fresh vectors otherwise.
"""

from __future__ import annotations

import bisect
from typing import Any, Callable, Sequence

import torch

from virtualflow.plan.vnmap import Node, split

RunVN = Callable[[int], torch.Tensor]
"""Forward and backward of one VN: returns its tail (statistics and weighted loss); the VN's
gradients are in (or were accumulated into) the parameters' ``.grad``."""


def direct_possible(params: Sequence[torch.Tensor]) -> bool:
    """Whether leaves can be built in flat buffers: one dtype, one device, dense strided storage."""
    if not params:
        return False
    p0 = params[0]
    return all(p.dtype == p0.dtype and p.device == p0.device and p.layout == torch.strided for p in params)


class Sum:
    """A tree node's sum while it is built: one tensor per parameter, and the tail."""

    __slots__ = ("grads", "tail")

    def __init__(self, grads: list[torch.Tensor], tail: torch.Tensor) -> None:
        self.grads = grads
        self.tail = tail


class Segmented:
    """A finished partial sum read as one vector ``[gradients | tail]`` without being copied into
    one: it stays the per-parameter tensors it was summed in (:class:`Sum`). A range inside one of
    them is a view of it; a range across several (a run of small parameters) is gathered, a copy
    of that range only. Parameter ``i``'s tensor is set by :meth:`put` (the last partial's are set
    piece by piece, as the last backward finishes them)."""

    __slots__ = ("parts", "starts", "total", "dtype", "device")

    def __init__(self, starts: Sequence[int], total: int, dtype: torch.dtype, device: torch.device) -> None:
        self.starts = list(starts)  # each part's first element; the tail's is the last
        self.parts: list[torch.Tensor | None] = [None] * len(self.starts)
        self.total = total
        self.dtype = dtype
        self.device = device

    def put(self, i: int, tensor: torch.Tensor) -> None:
        self.parts[i] = tensor.reshape(-1)

    def numel(self) -> int:
        return self.total

    def __getitem__(self, where: slice) -> torch.Tensor:
        lo, hi = where.start, where.stop
        k = bisect.bisect_right(self.starts, lo) - 1
        out = []
        while lo < hi:
            part, start = self.parts[k], self.starts[k]
            end = start + part.numel()
            take = part[lo - start:min(hi, end) - start]
            if not out and hi <= end:
                return take  # inside one tensor: a view
            out.append(take)
            lo, k = min(hi, end), k + 1
        return torch.cat(out) if out else torch.empty(0, dtype=self.dtype, device=self.device)


class Partials:
    """The leaf arithmetic of one worker and the pool of flat buffers its partial sums end in
    (reused across steps and generations)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], tail_numel: int) -> None:
        self.params = list(params)
        self.dtype = self.params[0].dtype
        self.device = self.params[0].device
        self.slices: list[tuple[int, int]] = []
        at = 0
        for p in self.params:
            self.slices.append((at, p.numel()))
            at += p.numel()
        self.grad_numel = at
        self.numel = at + tail_numel
        self._pool: list[torch.Tensor] = []
        self._touched: set[int] = set()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        # the last partial's pieces (the owners exchange), set by ``set_pieces``
        self.pieces: list[tuple[int, int]] = []
        self.piece_params: list[list[int]] = []
        self._piece_of: dict[int, int] = {}
        self._stream: dict[str, Any] | None = None

    # -- buffers ----------------------------------------------------------------------------------
    def take(self) -> torch.Tensor:
        if self._pool:
            return self._pool.pop()
        return torch.empty(self.numel, dtype=self.dtype, device=self.device)

    def give_back(self, bufs: Any) -> None:
        for b in bufs:
            if isinstance(b, torch.Tensor) and b.numel() == self.numel and not any(b is q for q in self._pool):
                self._pool.append(b)

    def detach_grads(self) -> None:
        """No ``.grad`` points into a buffer any more."""
        for p in self.params:
            p.grad = None

    # -- leaves -----------------------------------------------------------------------------------
    # A node's sum while it is built is a ``Sum``: one tensor per parameter (the gradients autograd
    # produced for its first VN, owned from then on, so no copy is made) and the tail; it becomes
    # one flat vector only when it is complete (:meth:`flatten`).

    def _on_grad(self, p: torch.Tensor) -> None:
        self._touched.add(id(p))
        st = self._stream
        if st is None:
            return
        b = self._piece_of[id(p)]
        st["pending"][b] -= 1
        while st["next"] < len(self.piece_params) and st["pending"][st["next"]] == 0:
            self._piece_done(st["next"])
            st["next"] += 1

    def fresh(self, run_vn: RunVN, vn: int) -> "Sum":
        """The VN's leaf, exactly: its gradients (zeros for a parameter without one) and tail."""
        self.detach_grads()
        tail = run_vn(vn)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        self.detach_grads()
        return Sum(grads, tail.to(self.dtype).clone())

    def _point_grads(self, acc: "Sum") -> None:
        for p, g in zip(self.params, acc.grads):
            p.grad = g
        self._touched.clear()

    def _untouched_plus_zero(self, acc: "Sum", only: Sequence[int] | None = None) -> None:
        """``+ 0.0`` where the VN gave no gradient (what adding a leaf of zeros does)."""
        for i in (range(len(self.params)) if only is None else only):
            if id(self.params[i]) not in self._touched:
                acc.grads[i].add_(0.0)

    def accumulate(self, acc: "Sum", run_vn: RunVN, vn: int) -> None:
        """``acc`` = ``acc + leaf(vn)``, the addition done by autograd's in-place accumulation."""
        self._point_grads(acc)
        tail = run_vn(vn)
        self._untouched_plus_zero(acc)
        self.detach_grads()
        acc.tail.add_(tail)

    def sum(self, node: Node, run_vn: RunVN) -> "Sum":
        """The tree's sum of ``node`` (the bits of ``tree_reduce_local``)."""
        lo, hi = node
        if hi - lo == 1:
            return self.fresh(run_vn, lo)
        left, right = split(node)
        acc = self.sum(left, run_vn)
        if right[1] - right[0] == 1:
            self.accumulate(acc, run_vn, right[0])
        else:
            other = self.sum(right, run_vn)
            for a, b in zip(acc.grads, other.grads):
                a.add_(b)
            acc.tail.add_(other.tail)
        return acc

    def flatten(self, acc: "Sum") -> torch.Tensor:
        """``acc`` as one vector (a buffer of the pool)."""
        buf = self.take()
        for g, (o, n) in zip(acc.grads, self.slices):
            buf[o:o + n].copy_(g.reshape(-1))
        buf[self.grad_numel:].copy_(acc.tail)
        return buf

    def segmented(self, acc: "Sum | None" = None) -> Segmented:
        """``acc`` read as one vector without a copy (:class:`Segmented`); None: an empty one, its
        tensors put in later."""
        seg = Segmented([o for o, _ in self.slices] + [self.grad_numel], self.numel, self.dtype, self.device)
        if acc is not None:
            for i, g in enumerate(acc.grads):
                seg.put(i, g)
            seg.put(len(self.slices), acc.tail)
        return seg

    def partials(self, nodes: Sequence[Node], run_vn: RunVN) -> dict[Node, torch.Tensor]:
        """Each node's sum, in a buffer of the pool (give them back after the exchange)."""
        return {node: self.flatten(self.sum(node, run_vn)) for node in nodes}

    # -- the last partial, piece by piece ---------------------------------------------------------
    def set_pieces(self, pieces: Sequence[tuple[int, int]], piece_params: Sequence[Sequence[int]]) -> None:
        """The gradient buckets (flat ranges in launch order, the parameter indices of each); the
        tail is the last piece (added here)."""
        self.pieces = list(pieces) + [(self.grad_numel, self.numel)]
        self.piece_params = [list(b) for b in piece_params]
        self._piece_of = {id(self.params[i]): b for b, idx in enumerate(self.piece_params) for i in idx}

    def streamed(self, nodes: Sequence[Node], run_vn: RunVN,
                 send: Callable[[Node, torch.Tensor, int | None], None]) -> dict[Node, torch.Tensor]:
        """:meth:`partials`, with each sent as soon as it is final: ``send(node, vec, None)`` for a
        whole one, ``send(node, vec, piece)`` for a piece of the last."""
        out: dict[Node, torch.Tensor] = {}
        for node in nodes[:-1]:
            out[node] = self.segmented(self.sum(node, run_vn))  # sent from its own tensors: no copy
            send(node, out[node], None)
        last = nodes[-1]
        spine: list[Sum] = []  # sums of the left children along the last node's right spine
        node = last
        while node[1] - node[0] > 1:
            left, node = split(node)
            spine.append(self.sum(left, run_vn))
        result = self.segmented()  # each parameter's final tensor is put in as its piece completes
        if spine:  # the last VN accumulates into the innermost left sibling
            self._point_grads(spine[-1])
        else:  # the last node is the VN itself: copied in piece by piece
            self.detach_grads()
        n_buckets = len(self.piece_params)
        st = self._stream = {"node": last, "result": result, "spine": spine, "tail": None, "send": send,
                             "pending": [len(b) for b in self.piece_params], "next": 0}
        try:
            st["tail"] = run_vn(node[0])
            self._stream = None
            while st["next"] < n_buckets:  # buckets with parameters the VN left without a gradient
                self._piece_done(st["next"], st)
                st["next"] += 1
            self._piece_done(n_buckets, st)  # the tail
        finally:
            self._stream = None
            self.detach_grads()
        out[last] = result
        return out

    def _piece_done(self, b: int, st: dict[str, Any] | None = None) -> None:
        """Piece ``b`` of the last partial is final: add it up the spine (``S_1 + (S_2 + (... +
        leaf))``, innermost first; ``S_d`` already holds ``S_d + leaf``), into the result, and send."""
        st = st if st is not None else self._stream
        assert st is not None
        spine: list[Sum] = st["spine"]
        out: Segmented = st["result"]
        tail = b == len(self.piece_params)
        at_tail = len(self.slices)
        if tail:
            parts = [(None, self.grad_numel, self.numel - self.grad_numel)]
        else:
            parts = [(i, *self.slices[i]) for i in self.piece_params[b]]
        if spine:
            acc = spine[-1]
            if tail:
                acc.tail.add_(st["tail"])
            else:
                self._untouched_plus_zero(acc, self.piece_params[b])
            for i, o, n in parts:
                t = acc.tail if i is None else acc.grads[i]
                for left in reversed(spine[:-1]):  # S_j + t, in place into S_j (same shapes)
                    s_j = left.tail if i is None else left.grads[i]
                    s_j.add_(t)
                    t = s_j
                out.put(at_tail if i is None else i, t)
        else:
            for i, o, n in parts:
                if i is None:
                    out.put(at_tail, st["tail"].to(self.dtype))
                else:
                    g = self.params[i].grad
                    out.put(i, torch.zeros(n, dtype=self.dtype, device=self.device) if g is None else g)
        st["send"](st["node"], out, b)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._pool = []
