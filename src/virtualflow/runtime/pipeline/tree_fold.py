"""Deterministic mode: a stage's per-VN vectors folded into its partial sums during the step, each
partial handed to the exchange as soon as it is final.

Purpose: in deterministic mode a worker's gradients of each virtual node (VN, one micro-batch)
are leaves of the fixed VN-id tree (:mod:`virtualflow.plan.vnmap`); the worker sums them along the
tree into its *partials* (the tree nodes that cover its VN block) and the replicas' partials are
brought together over the stage group, or each job stage's workers after a Bamboo failover
(:class:`~.requests.StageTree`). Done at the step's end,
the whole local sum and the exchange wait for the last backward. :class:`StreamedPerVN` instead
adds each VN's leaf into the tree as soon as every backward of its micro-batch on this worker ran,
opens the stage group's exchange at the first leaf (:class:`~.requests.TreeOpen`: a process driver
posts its receives) and hands each partial over as soon as its last leaf is in
(:class:`~.requests.TreePart`: a process driver sends it to its owners while the remaining
micro-batches compute); the step's :class:`~.requests.StageTree` then only finishes the exchange.
After the last backward what is left is the additions on the path of the last VN and the
exchange's second half.

Invariants:

- Bit for bit the sums of :func:`~virtualflow.comm.reduce.tree_reduce_local`: every tree node is
  its left child plus its right child, added element by element in the leaf's dtype (the dtype
  ``torch.cat`` of the leaf's parts gives), whatever the order in which the leaves complete.
- A partial's vector is one flat tensor from its first leaf on (that leaf's parts are copied into
  it once; every later leaf is added into its views), so the vector handed over needs no copy; a
  vector handed over is not written again in the step (its sum is complete).
- Leaves are kept as the lists of tensors backward produced (owned here: ``.grad`` was cleared),
  so no VN is copied but a partial's first one; the loss and BatchNorm parts are copied (they
  are read again by the step's statistics).
- A weight read by two pieces on two workers (:class:`~.tied.ExactTies`): the holder sends each
  VN's gradients of its copy as soon as its piece's backward of that micro-batch ends (before the
  piece's input gradient goes out), and the owner takes them when its own backward of the
  micro-batch ended, so its leaf is complete then too; a tied weight's gradients no longer wait
  for the step's end.
- After a Bamboo failover a worker running several job stages opens one exchange per job stage
  (over that stage's workers) and sends each job stage's elements of a completed partial to it.
- Chosen once per step, where it applies: deterministic mode with shared weights (if any) whose
  per-VN sums can be formed as the micro-batches end (:func:`~.tied.tie_traffic`: not with
  zero-bubble's split backward, nor ``reduction="sharded"``'s paired copies). Elsewhere
  :class:`~.flush.PerVN` keeps the leaves and sums them at the step's end.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Generator, Sequence

import torch

from virtualflow.plan.vnmap import Node, split
from virtualflow.runtime.pipeline.pieces import flat_grads
from virtualflow.runtime.pipeline.requests import Request, StageTree, TreeOpen, TreePart

__all__ = ["TreeFold", "StreamedPerVN"]


class TreeFold:
    """One step's partial sums of one worker, built leaf by leaf (see the module docstring)."""

    def __init__(self, partials: Sequence[Node]) -> None:
        self.partials = tuple(partials)
        self.firsts = {node[0]: node for node in self.partials}
        self.values: dict[Node, list[torch.Tensor]] = {}
        """Complete tree nodes not yet added into their parent: their parts (views of a flat
        vector on the leftmost path of a partial)."""
        self.flat: dict[Node, torch.Tensor] = {}
        """Per partial, its flat vector (from its first leaf on)."""
        self.done: dict[Node, torch.Tensor] = {}
        """The partials complete so far, flat."""
        self.dtype: torch.dtype | None = None
        """The leaf vector's dtype and size (known from the first leaf)."""
        self.numel = 0

    def add(self, vn: int, parts: list[torch.Tensor]) -> list[Node]:
        """Leaf ``vn`` (its parts, in the leaf vector's order); returns the partials it completes."""
        if self.dtype is None:  # the dtype torch.cat of the parts gives (every leaf has the same)
            self.dtype = functools.reduce(torch.promote_types, [t.dtype for t in parts])
            self.numel = sum(t.numel() for t in parts)
        dtype = self.dtype
        parts = [t if t.dtype == dtype else t.to(dtype) for t in parts]
        node = self.firsts.get(vn)
        if node is not None:  # a partial's first leaf: its flat vector, once
            flat = self.flat[node] = torch.cat(parts)
            parts = list(flat.split([t.numel() for t in parts]))
        self.values[(vn, vn + 1)] = parts
        completed = [p for p in self.partials if p[0] <= vn < p[1] and self._fold(p)]
        for p in completed:
            self.values.pop(p)
            self.done[p] = self.flat.pop(p)
        return completed

    def _fold(self, node: Node) -> bool:
        """Is ``node`` complete (adding its children where both are)?"""
        if node in self.values:
            return True
        if node[1] - node[0] == 1:
            return False
        left, right = split(node)
        if not (self._fold(left) and self._fold(right)):
            return False
        acc = self.values.pop(left)
        torch._foreach_add_(acc, self.values.pop(right))
        self.values[node] = acc
        return True


class StreamedPerVN:
    """Deterministic mode's gradients of a flush step, folded as they come (see the module
    docstring): the same interface as :class:`~.flush.PerVN` (``before``/``after`` around each
    backward, ``backward_done`` after a micro-batch's last one, ``partials`` at the reduction)."""

    def __init__(self, work: Any,
                 requests: Callable[[dict[Node, torch.Tensor], torch.Tensor],
                                    list[tuple[torch.Tensor | None, StageTree]]]) -> None:
        """``work``: the :class:`~.flush.FlushStep`; ``requests``: its StageTree requests for the
        partials and one vector like theirs, each with its elements' indices (one per job stage
        after a Bamboo failover; the same exchanges for the open, the parts and the finish)."""
        self.work = work
        e = work.engine
        self.requests = requests
        self.fold = TreeFold(e.tree.per_worker[e.replica])
        self.by_vn: dict[int, dict[int, list[torch.Tensor]]] = {}
        self.n_pieces = len(e.pieces)
        self.opened: list[tuple[torch.Tensor | None, StageTree]] | None = None

    def before(self, params: Sequence[torch.Tensor]) -> None:
        for q in params:
            q.grad = None

    def after(self, params: Sequence[torch.Tensor], vn: int, k: int) -> None:
        self.by_vn.setdefault(vn, {})[k] = flat_grads(params)
        for q in params:
            q.grad = None

    def backward_done(self, k: int, mb: int) -> Generator[Request, Any, None]:
        """After a micro-batch's last backward on piece ``k``: a shared weight's gradients of this
        VN go to its owner (:meth:`~.tied.ExactTies.stream_sends`); once every piece of this worker
        ran it, the VN's leaf (with the holders' gradients of the weights this worker owns) goes
        into the tree, and a partial it completes goes to the exchange."""
        w = self.work
        index = mb % w.m
        vn = w.vns[index]
        got = self.by_vn.get(vn, {})
        yield from w.tied.after_backward(k, vn, index, got, w.step)
        if len(got) < self.n_pieces:
            return
        remote = yield from w.tied.receive(index, w.step)
        completed = self.fold.add(vn, w.leaf_parts(vn, self.by_vn.pop(vn), remote))
        if self.opened is None:  # the first leaf: the exchanges may post their receives now
            like = torch.empty(self.fold.numel, dtype=self.fold.dtype, device=w.engine.device)
            self.opened = self.requests({}, like)
            for _, tree in self.opened:
                yield TreeOpen(tree)
        for node in completed:
            vec = self.fold.done[node]
            for idx, tree in self.opened:  # (a job stage's elements: a copy, read again at the finish)
                yield TreePart(tree, node, vec if idx is None else vec.index_select(0, idx))

    def partials(self, nodes: Sequence[Node]) -> Generator[Request, Any, dict[Node, torch.Tensor]]:
        """This worker's partial sums ``nodes``, folded already (complete by the step's reduction)."""
        yield from ()
        missing = [n for n in self.fold.partials if n not in self.fold.done]
        if missing:
            raise RuntimeError(f"deterministic pipeline step: partial sums {missing} incomplete after the last "
                               f"backward (leaves of VNs {sorted(self.by_vn)} still waiting)")
        return dict(self.fold.done)

