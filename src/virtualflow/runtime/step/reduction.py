"""The gradient reduction of one step, as objects chosen once per generation.

Purpose: a step's gradients, and the few numbers every worker must agree on, are summed over the
workers in one of the ways below; which one is fixed by the job's mode (default or deterministic), the
optimizer's layout (whole, or ``reduction="sharded"``) and the group's size, so it is chosen once
when a generation forms (:func:`default_reduction`, :func:`tree_reduction`) and a step asks the
chosen object instead of asking the layout again:

- **default, whole** (:class:`BucketSum`): the last VN's backward all-reduces gradient buckets as
  autograd finishes them (:class:`~virtualflow.comm.reduce.BucketReducer`); the step's stats ride
  in the last bucket. The summed gradient ends up in each parameter's ``.grad``.
- **default, sharded** (:class:`ShardSum`): buckets are reduce-scattered into this worker's chunk
  of the flat gradient (:class:`~virtualflow.comm.reduce.ShardReducer`); the stats are
  all-reduced whole after them.
- **deterministic** (:class:`TreeReduction`): each VN's vector ``[gradients | tail]`` (the tail:
  :class:`Tail`) is summed along the fixed VN-id tree into this worker's partial sums, and the
  partial sums are brought together by the ``slots`` exchange (one all-reduce,
  :func:`~virtualflow.comm.reduce.tree_exchange`, or its sharded form) or the ``owners`` exchange
  (:class:`~virtualflow.comm.exchange.OwnerExchange`, sending pieces of the last partial during
  the last backward). The whole tree's flat sum is handed back (the engine moves it into
  ``.grad`` once the step is decided); sharded, this worker's chunk is copied into the flat
  gradient (:class:`Chunk`).
- one worker (:class:`Alone`): nothing is exchanged; default mode's gradients stay where backward
  put them.

Invariants: every worker of a generation builds the same kind of object (the choice reads only
what every member shares), so the collectives match; the deterministic objects give every worker
the bits of :func:`~virtualflow.comm.reduce.tree_reduce_local` over all VNs for any VN map.
"""

from __future__ import annotations

import functools
from typing import Callable, Protocol, Sequence

import torch

from virtualflow.comm.exchange import OwnerExchange
from virtualflow.comm.groups import Group
from virtualflow.comm.reduce import BucketReducer, ShardReducer, tree_exchange, tree_exchange_sharded, tree_reduce_local
from virtualflow.comm.ring import Collectives
from virtualflow.plan.vnmap import Node, TreePlan
from virtualflow.runtime.partials import Partials, RunVN, direct_possible
from virtualflow.runtime.sharded import ShardedOptimizer
from virtualflow.runtime.step.exchange import (ExchangeChoice, bucket_pieces, owner_exchange, send_pieces,
                                               sharded_bounds)

Point = Callable[[str], None]
"""A fault-injection point: called with the phase's name (``"during_reduction"``)."""


class Tail:
    """The part of a reduction vector after the gradients: ``[BatchNorm statistics | loss]``, each
    present as the step needs (``bn_numel`` 0: no statistics; ``loss`` False: no loss, e.g. a
    pipeline stage that does not compute it). ``mean_over``: the statistics are a sum over that
    many virtual nodes, read as their mean (BatchNorm's ``mean`` mode); None: read as they are."""

    __slots__ = ("bn_numel", "loss", "mean_over")

    def __init__(self, bn_numel: int, loss: bool, mean_over: int | None) -> None:
        self.bn_numel = bn_numel
        self.loss = loss
        self.mean_over = mean_over

    @property
    def numel(self) -> int:
        return self.bn_numel + int(self.loss)

    def read(self, vec: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(the BatchNorm statistics, the loss) from ``vec``'s tail starting at ``offset`` (None
        where absent)."""
        bn = None
        if self.bn_numel:
            bn = vec[offset: offset + self.bn_numel]
            if self.mean_over is not None:
                bn = bn / self.mean_over
            offset += self.bn_numel
        return bn, (vec[offset] if self.loss else None)


# -- default mode -------------------------------------------------------------------------------
class Reduction(Protocol):
    """Default mode's reduction: :meth:`arm` before the step's last backward (or, on a worker with
    no VN, before :meth:`finish`), :meth:`finish` after it."""

    def arm(self, stats: torch.Tensor) -> None:
        """The next backward is the step's last one here; ``stats`` is summed with the gradients."""

    def finish(self, stats: torch.Tensor, point: Point) -> torch.Tensor:
        """Wait for the sums (launching what is left); returns the summed ``stats``."""

    def close(self) -> None:
        """The generation ends: drop the gradient hooks."""


class BucketSum:
    """Default mode, the whole gradient on every worker: buckets all-reduced during the last
    backward, the stats in the last bucket; the sums end up in ``.grad``."""

    def __init__(self, params: Sequence[torch.nn.Parameter], group: Group) -> None:
        self.reducer = BucketReducer(params, group)

    def arm(self, stats: torch.Tensor) -> None:
        self.reducer.arm(extra=stats)

    def finish(self, stats: torch.Tensor, point: Point) -> torch.Tensor:
        point("during_reduction")
        return self.reducer.finish()

    def close(self) -> None:
        self.reducer.close()


class ShardSum:
    """``reduction="sharded"``: buckets reduce-scattered into this worker's chunk of the flat
    gradient during the last backward (the rest of the flat gradient is scratch afterwards), then
    the stats, which everyone needs whole, all-reduced."""

    def __init__(self, params: Sequence[torch.nn.Parameter], offsets: Sequence[int], grad: torch.Tensor,
                 bounds: Sequence[tuple[int, int]], comm: Collectives, group: Group) -> None:
        self.reducer = ShardReducer(params, offsets, grad, bounds, comm)
        self.group = group

    def arm(self, stats: torch.Tensor) -> None:
        self.reducer.arm()

    def finish(self, stats: torch.Tensor, point: Point) -> torch.Tensor:
        point("during_reduction")
        self.reducer.finish()  # gradients: reduce-scattered into this worker's chunk
        self.group.all_reduce(stats)  # the few numbers everyone needs whole
        return stats

    def close(self) -> None:
        self.reducer.close()


class Alone:
    """One worker: nothing to sum; the gradients stay where backward put them."""

    def arm(self, stats: torch.Tensor) -> None:
        pass

    def finish(self, stats: torch.Tensor, point: Point) -> torch.Tensor:
        return stats

    def close(self) -> None:
        pass


def default_reduction(params: Sequence[torch.nn.Parameter], group: Group, shard: ShardedOptimizer | None = None,
                      comm: Collectives | None = None) -> Reduction:
    """Default mode's reduction for ``group``: :class:`ShardSum` with a sharded optimizer (its
    :class:`~virtualflow.runtime.sharded.ShardedOptimizer` ``shard`` and ring ``comm``),
    :class:`BucketSum` without, :class:`Alone` for one worker."""
    if group.size == 1:
        return Alone()
    if shard is not None:
        return ShardSum(params, shard.flat.offsets, shard.flat.grad, shard.bounds, comm, group)
    return BucketSum(params, group)


# -- deterministic mode -------------------------------------------------------------------------
class Whole:
    """Where the tree's summed gradient ends up without a sharded optimizer: every worker keeps the
    whole flat sum (handed back; moved into ``.grad`` once the step is decided)."""

    def __init__(self, grad_numel: int) -> None:
        self.grad_numel = grad_numel

    def of(self, root: torch.Tensor) -> torch.Tensor:
        return root[: self.grad_numel]

    def keep(self, grads: torch.Tensor) -> torch.Tensor | None:
        return grads

    def after_partials(self) -> None:
        pass


class Chunk:
    """``reduction="sharded"``: this worker's chunk of the summed gradient is copied into the
    sharded optimizer's flat gradient; nothing is handed back."""

    def __init__(self, shard: ShardedOptimizer) -> None:
        self.shard = shard

    def of(self, root: torch.Tensor) -> torch.Tensor:
        lo, hi = self.shard.chunk()
        return root[lo:hi]

    def keep(self, grads: torch.Tensor) -> torch.Tensor | None:
        lo, hi = self.shard.chunk()
        self.shard.flat.grad[lo:hi].copy_(grads)
        return None

    def after_partials(self) -> None:
        self.shard.flat.attach_grads()  # the sharded optimizer's gradients are views of its vector


class Slots:
    """The ``slots`` exchange (and a generation of one worker): the crossing partial sums in one
    all-reduce, each slot with one writer."""

    def __init__(self, plan: TreePlan, group: Group, grad_numel: int) -> None:
        self.plan, self.group, self.grad_numel = plan, group, grad_numel

    def begin(self) -> None:
        pass

    def send(self, node: Node, vec: torch.Tensor) -> None:
        pass  # everything crosses in finish()'s all-reduce

    def partials(self, parts: Partials, nodes: Sequence[Node], run_vn: RunVN) -> dict[Node, torch.Tensor]:
        return parts.partials(nodes, run_vn)

    def finish(self, local: dict[Node, torch.Tensor], like: Callable[[], torch.Tensor],
               where: Whole | Chunk) -> tuple[torch.Tensor, torch.Tensor]:
        """(the gradient part ``where`` keeps, the tail of the root sum); ``like`` is asked on a
        worker with no node."""
        total = tree_exchange(self.plan, self.group, local, like=None if local else like())
        return total[: self.grad_numel], total[self.grad_numel:]

    def abandon(self) -> None:
        pass

    def close(self) -> None:
        pass


class ShardedSlots(Slots):
    """The ``slots`` exchange for ``reduction="sharded"``: the crossing partial sums laid out
    element-major, reduce-scattered (each worker receives its chunk of every slot), the tail
    all-reduced (:func:`~virtualflow.comm.reduce.tree_exchange_sharded`)."""

    def __init__(self, plan: TreePlan, group: Group, grad_numel: int, shard: ShardedOptimizer,
                 comm: Collectives | None) -> None:
        super().__init__(plan, group, grad_numel)
        self.shard, self.comm = shard, comm

    def finish(self, local: dict[Node, torch.Tensor], like: Callable[[], torch.Tensor],
               where: Whole | Chunk) -> tuple[torch.Tensor, torch.Tensor]:
        return tree_exchange_sharded(self.plan, self.group, local, None if local else like(), self.comm,
                                     self.shard.bounds, self.grad_numel)


class Owners:
    """The ``owners`` exchange: each owner combines its chunk of every partial sum; the partials
    (and the last one's pieces, during the last backward) are sent as soon as they are final."""

    def __init__(self, exchange: OwnerExchange, grad_numel: int, groups: Sequence[Sequence[int]] | None = None) -> None:
        """``groups``: per piece :class:`~virtualflow.runtime.partials.Partials` streams (a gradient
        bucket, then the tail), the exchange's pieces it consists of (:func:`send_pieces`)."""
        self.exchange = exchange
        self.grad_numel = grad_numel
        self.groups = [list(g) for g in groups] if groups is not None else None

    def begin(self) -> None:
        self.exchange.begin()  # every receive of the step is posted before the first send

    def send(self, node: Node, vec: torch.Tensor) -> None:
        self.exchange.send(node, vec)

    def _send(self, node: Node, vec: torch.Tensor, piece: int | None = None) -> None:
        if piece is None or self.groups is None:
            self.exchange.send(node, vec, piece)
            return
        for j in self.groups[piece]:
            self.exchange.send(node, vec, j)

    def partials(self, parts: Partials, nodes: Sequence[Node], run_vn: RunVN) -> dict[Node, torch.Tensor]:
        return parts.streamed(nodes, run_vn, self._send)

    def finish(self, local: dict[Node, torch.Tensor], like: Callable[[], torch.Tensor],
               where: Whole | Chunk) -> tuple[torch.Tensor, torch.Tensor]:
        root = self.exchange.finish(local)
        return where.of(root), root[self.grad_numel:]

    def abandon(self) -> None:
        self.exchange.abandon()

    def close(self) -> None:
        self.exchange.close()  # (its send thread stops)


class TreeReduction:
    """Deterministic mode's reduction for one generation: this worker's partial sums along the
    fixed tree (:class:`~virtualflow.runtime.partials.Partials`' reused buffers, or a fresh vector
    per leaf when the parameters' dtypes differ), brought together by ``exchange`` (:class:`Slots`
    , :class:`ShardedSlots` or :class:`Owners`); the summed gradient ends up as ``where`` says (:class:`Whole` or
    :class:`Chunk`)."""

    def __init__(self, plan: TreePlan, rank: int, exchange: Slots | ShardedSlots | Owners, where: Whole | Chunk,
                 partials: Partials | None) -> None:
        self.nodes = plan.per_worker[rank]
        self.exchange = exchange
        self.where = where
        self.partials = partials
        self._held: list[torch.Tensor] = []

    def local(self, run_vn: RunVN, leaf: Callable[[int], torch.Tensor]) -> dict[Node, torch.Tensor]:
        """This worker's partial sums (``run_vn``: a VN's forward and backward, its tail returned;
        ``leaf``: a VN's whole vector, fresh), each sent as soon as the exchange may send it.
        Call after :meth:`begin`."""
        if self.partials is None:
            local = tree_reduce_local(self.nodes, leaf)
            for node, vec in local.items():
                self.exchange.send(node, vec)
            return local
        local = self.exchange.partials(self.partials, self.nodes, run_vn)
        self._held = list(local.values())
        self.where.after_partials()
        return local

    def begin(self) -> None:
        self.exchange.begin()

    def finish(self, local: dict[Node, torch.Tensor], like: Callable[[], torch.Tensor]
               ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Bring the partial sums together: (the whole flat sum of the gradients, or None when
        this worker's chunk was copied into the flat gradient; the tail of the root sum).
        ``like``: one leaf's shape and dtype, asked only on a worker with no node."""
        try:
            grads, tail = self.exchange.finish(local, like, self.where)
            return self.where.keep(grads), tail
        finally:
            if self.partials is not None:
                self.partials.give_back(self._held)  # reused next step (what is read from them is used before)
                self._held = []

    def abandon(self) -> None:
        self.exchange.abandon()

    def close(self) -> None:
        self.exchange.close()


def tree_reduction(plan: TreePlan, group: Group, params: Sequence[torch.nn.Parameter], like: torch.Tensor,
                   choice: ExchangeChoice, partials: Partials | None, shard: ShardedOptimizer | None = None,
                   comm: Collectives | None = None) -> tuple[TreeReduction, tuple[str, str] | None]:
    """Deterministic mode's reduction for ``group`` and (the exchange chosen, why), None with one
    worker. ``like``: one leaf vector's shape and dtype (:meth:`ExchangeChoice.choose`); ``shard``
    and ``comm``: the sharded optimizer and its ring (``reduction="sharded"``). For ``owners`` the
    leaf is cut into the pieces the last backward sends as it finishes them: the gradient buckets
    in launch order (as the default mode's), then the tail."""
    grad_numel, numel = sum(p.numel() for p in params), like.numel()
    if shard is None:
        where, slots, bounds, gather = Whole(grad_numel), Slots(plan, group, grad_numel), None, None
    else:  # each owner keeps its chunk of the gradients; the tail goes to all
        where, slots = Chunk(shard), ShardedSlots(plan, group, grad_numel, shard, comm)
        bounds, gather = sharded_bounds(shard.bounds, numel)
    picked = None if group.size == 1 else choice.choose(plan, like)
    if picked is None or picked[0] != "owners":
        return TreeReduction(plan, group.rank, slots, where, partials), picked
    pieces, piece_params = bucket_pieces(params)
    groups = None
    if partials is not None:  # partials held per parameter: large parameters are pieces of their own
        partials.set_pieces(pieces, piece_params)
        pieces, groups = send_pieces(params, piece_params)
        groups.append([len(pieces)])
    pieces.append((grad_numel, numel))  # the tail: BatchNorm statistics and loss
    ex = owner_exchange(plan, group, numel, dtype=like.dtype, device=like.device, bounds=bounds, gather=gather,
                        pieces=pieces)
    return TreeReduction(plan, group.rank, Owners(ex, grad_numel, groups), where, partials), picked


class TreeLeaves:
    """Deterministic mode on one worker, for the engine's life: a VN's leaf vector ``[gradients |
    tail]`` (the tail: :class:`Tail`, BatchNorm statistics in ``mean`` mode, then the weighted
    loss), the partial sums' reused buffers and leaf arithmetic
    (:class:`~virtualflow.runtime.partials.Partials`; None when the parameters' dtypes differ:
    a fresh vector per leaf then), and each generation's :class:`TreeReduction`."""

    def __init__(self, params: Sequence[torch.nn.Parameter], bn_bufs: Sequence[torch.Tensor], mean_bn: bool,
                 virtual_nodes: int, device: torch.device) -> None:
        self.params = list(params)
        self.grad_numel = sum(p.numel() for p in self.params)
        bn_numel = sum(b.numel() for b in bn_bufs) if mean_bn else 0
        self.tail = Tail(bn_numel, True, virtual_nodes)
        self.bn_dtypes = [b.dtype for b in bn_bufs] if mean_bn else []
        self.device = device
        self.partials = Partials(self.params, self.tail.numel) if direct_possible(self.params) else None

    def like(self, loss_dtype: torch.dtype | None) -> torch.Tensor:
        """An (uninitialised) vector of one leaf's size and dtype (what a worker with no VN hands
        to the tree exchange); ``loss_dtype``: the loss's, once a forward ran here."""
        if self.partials is not None:  # the buffers' dtype: the parameters'
            return torch.empty(self.partials.numel, dtype=self.partials.dtype, device=self.device)
        dtypes = [p.dtype for p in self.params] + [loss_dtype or self.params[0].dtype] + self.bn_dtypes
        return torch.empty(self.grad_numel + self.tail.numel, dtype=functools.reduce(torch.promote_types, dtypes),
                           device=self.device)

    def reduction(self, plan: TreePlan, group: Group, loss_dtype: torch.dtype | None, choice: ExchangeChoice,
                  shard: ShardedOptimizer | None = None,
                  comm: Collectives | None = None) -> tuple[TreeReduction, tuple[str, str] | None]:
        """This generation's reduction and exchange choice (:func:`tree_reduction`)."""
        return tree_reduction(plan, group, self.params, self.like(loss_dtype), choice, self.partials, shard, comm)
