"""Deterministic mode's partial sums, computed into reused flat buffers.

A *leaf* is one VN's vector ``[gradients (parameter order) | BatchNorm statistics | weighted
loss]``; a tree node is the sum of its two children (:mod:`virtualflow.plan.vnmap`). The
straightforward way (one fresh vector per leaf: the VN's gradients concatenated, then added into
the left sibling) costs a fresh allocation and a copy of the whole gradient per VN. Here:

* every vector lives in a buffer of a small pool, allocated once and reused every step (a fresh
  vector of hundreds of MB is faulted in page by page each time);
* a node whose right child is a single VN lets that VN's backward **accumulate into the left
  sum's buffer**: the parameters' ``.grad`` are views of the buffer and autograd adds each
  gradient in place (``grad += g``), which is, element for element, the tree's
  ``left + leaf`` (one IEEE addition; addition is commutative). A parameter the VN leaves
  without a gradient gets ``+ 0.0``, as a leaf of zeros would (it turns ``-0.0`` into ``0.0``);
* any other leaf (the first of a buffer) keeps the gradients autograd produced and copies them in,
  zeros for parameters without one: exactly the leaf vector.

So each node holds the same bits as :func:`virtualflow.comm.reduce.tree_reduce_local` gives it,
while a worker pays, beyond the default mode's accumulation, a copy per left-most leaf and an
addition per node with a non-leaf right child.

The ``owners`` exchange wants the last partial sum piece by piece during the last backward
(:meth:`Partials.streamed`): its last VN accumulates into the innermost left sibling on the
partial's right spine (or, with no spine, is copied in bucket by bucket), and as soon as a
gradient bucket is complete its slice is added up the spine (``S_1 + (S_2 + (... + leaf))``,
innermost first, written in place into the spine's buffers) and handed to ``send(piece)``.

Used only when every trainable parameter has one dtype and dense strided storage (the buffers
are of that dtype; the statistics and the loss are stored in it too); the engine falls back to
fresh vectors otherwise.
"""

from __future__ import annotations

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


class Partials:
    """Flat buffers and the leaf arithmetic of one worker (reused across steps and generations)."""

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
            if b is not None and b.numel() == self.numel and not any(b is q for q in self._pool):
                self._pool.append(b)

    def detach_grads(self) -> None:
        """No ``.grad`` points into a buffer any more."""
        for p in self.params:
            p.grad = None

    # -- leaves -----------------------------------------------------------------------------------
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

    def fresh(self, buf: torch.Tensor, run_vn: RunVN, vn: int) -> None:
        """``buf`` = the VN's leaf vector, exactly."""
        self.detach_grads()
        tail = run_vn(vn)
        for p, (o, n) in zip(self.params, self.slices):
            if p.grad is None:
                buf[o:o + n].zero_()
            else:
                buf[o:o + n].copy_(p.grad.reshape(-1))
        self.detach_grads()
        buf[self.grad_numel:].copy_(tail)

    def _point_grads(self, buf: torch.Tensor) -> None:
        for p, (o, n) in zip(self.params, self.slices):
            p.grad = buf[o:o + n].view_as(p)
        self._touched.clear()

    def _untouched_plus_zero(self, buf: torch.Tensor, only: Sequence[int] | None = None) -> None:
        """``+ 0.0`` where the VN gave no gradient (what adding a leaf of zeros does)."""
        for i in (range(len(self.params)) if only is None else only):
            p = self.params[i]
            if id(p) not in self._touched:
                o, n = self.slices[i]
                buf[o:o + n].add_(0.0)

    def accumulate(self, buf: torch.Tensor, run_vn: RunVN, vn: int) -> None:
        """``buf`` = ``buf + leaf(vn)``, the addition done by autograd's in-place accumulation."""
        self._point_grads(buf)
        tail = run_vn(vn)
        self._untouched_plus_zero(buf)
        self.detach_grads()
        buf[self.grad_numel:].add_(tail)

    def compute_into(self, node: Node, buf: torch.Tensor, run_vn: RunVN) -> None:
        """``buf`` = the tree's sum of ``node`` (the bits of ``tree_reduce_local``)."""
        lo, hi = node
        if hi - lo == 1:
            self.fresh(buf, run_vn, lo)
            return
        left, right = split(node)
        self.compute_into(left, buf, run_vn)
        if right[1] - right[0] == 1:
            self.accumulate(buf, run_vn, right[0])
            return
        tmp = self.take()
        try:
            self.compute_into(right, tmp, run_vn)
            buf.add_(tmp)
        finally:
            self.give_back([tmp])

    def partials(self, nodes: Sequence[Node], run_vn: RunVN) -> dict[Node, torch.Tensor]:
        """Each node's sum, in a buffer of the pool (give them back after the exchange)."""
        out: dict[Node, torch.Tensor] = {}
        for node in nodes:
            buf = self.take()
            self.compute_into(node, buf, run_vn)
            out[node] = buf
        return out

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
            buf = self.take()
            self.compute_into(node, buf, run_vn)
            out[node] = buf
            send(node, buf, None)
        last = nodes[-1]
        spine: list[torch.Tensor] = []  # sums of the left children along the last node's right spine
        node = last
        while node[1] - node[0] > 1:
            left, node = split(node)
            buf = self.take()
            self.compute_into(left, buf, run_vn)
            spine.append(buf)
        if spine:  # the last VN accumulates into the innermost left sibling
            result = spine[0]
            self._point_grads(spine[-1])
        else:  # the last node is the VN itself: copied in piece by piece
            result = self.take()
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
        self.give_back(spine[1:])
        out[last] = result
        return out

    def _piece_done(self, b: int, st: dict[str, Any] | None = None) -> None:
        st = st if st is not None else self._stream
        assert st is not None
        lo, hi = self.pieces[b]
        spine = st["spine"]
        tail = b == len(self.piece_params)
        if spine:
            acc = spine[-1]
            if tail:
                acc[lo:hi].add_(st["tail"])
            else:
                self._untouched_plus_zero(acc, self.piece_params[b])
            t = acc[lo:hi]
            for left in reversed(spine[:-1]):  # S_j + t, innermost first, in place into S_j
                torch.add(left[lo:hi], t, out=left[lo:hi])
                t = left[lo:hi]
        else:
            out = st["result"]
            if tail:
                out[lo:hi].copy_(st["tail"])
            else:
                for i in self.piece_params[b]:
                    p = self.params[i]
                    o, n = self.slices[i]
                    if p.grad is None:
                        out[o:o + n].zero_()
                    else:
                        out[o:o + n].copy_(p.grad.reshape(-1))
        st["send"](st["node"], st["result"], b)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._pool = []
