"""The deterministic exchange a tree reduction runs, chosen in one place for every layout.

Purpose: deterministic mode sums per-VN vectors along the fixed tree (:mod:`virtualflow.plan.vnmap`)
and brings the workers' partial sums together by one of two exchanges
(:mod:`virtualflow.plan.exchange`: ``owners`` or ``slots``). The VN engine chooses once per
generation for its one vector; a pipeline stage chooses per stage group's vector
(:class:`virtualflow.runtime.pipeline.links.StageExchanges`). Both ask :class:`ExchangeChoice`
and build the ``owners`` exchange with :func:`owner_exchange`, so the knob's check, the choice
and the cut of the vector into owners' chunks are written once.

Invariants: the choice depends only on the VN map, the vector's size and element size and the
knob, so every member of a group makes the same one; with ``reduction="sharded"`` each owner
keeps its chunk of the gradients (:func:`sharded_bounds`) and only the tail after them is
gathered by everyone.
"""

from __future__ import annotations

from typing import Sequence

import torch

from virtualflow.comm.exchange import OwnerExchange
from virtualflow.comm.groups import Group
from virtualflow.comm.reduce import plan_buckets
from virtualflow.plan.exchange import EXCHANGES, OwnerSchedule, choose_exchange, depth_for
from virtualflow.plan.vnmap import TreePlan

Ranges = Sequence[tuple[int, int]]


class ExchangeChoice:
    """The ``deterministic_exchange`` knob, checked when built, and the choice it makes for a vector."""

    def __init__(self, asked: str = "auto") -> None:
        if asked not in EXCHANGES:
            raise ValueError(f"deterministic_exchange={asked!r} is not one of {', '.join(EXCHANGES)} "
                             f"(--deterministic-exchange)")
        self.asked = asked

    def choose(self, plan: TreePlan, like: torch.Tensor) -> tuple[str, str]:
        """(the exchange, why) for ``plan``'s tree over vectors shaped like ``like``
        (:func:`~virtualflow.plan.exchange.choose_exchange`)."""
        return choose_exchange(plan, like.numel(), like.element_size(), self.asked)


def sharded_bounds(chunks: Ranges, numel: int) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
    """``reduction="sharded"``: (the owners' chunks, what everyone gathers) for a vector of
    ``numel`` elements whose gradients the sharded optimizer cut into ``chunks``: each owner keeps
    its chunk of the gradients, the last one also the tail after them, and the tail
    ``[chunks[-1][1], numel)`` (BatchNorm statistics, loss) goes to everyone."""
    grads = chunks[-1][1]
    bounds = tuple((a, b) for a, b in chunks[:-1]) + ((chunks[-1][0], numel),)
    return bounds, (((grads, numel),) if numel > grads else ())


def bucket_pieces(params: Sequence[torch.Tensor]) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """The gradient part of a leaf vector cut into the default mode's buckets, in launch order:
    (each bucket's element range, its parameters' indices), so the ``owners`` exchange can send
    a bucket as soon as the last backward completes it."""
    offsets, at = [], 0
    for p in params:
        offsets.append(at)
        at += p.numel()
    pieces, piece_params = [], []
    for idx in plan_buckets(params):
        lo = min(offsets[i] for i in idx)
        hi = max(offsets[i] + params[i].numel() for i in idx)
        pieces.append((lo, hi))
        piece_params.append(sorted(idx))
    return pieces, piece_params


SPLIT_NUMEL = 1 << 16
"""A parameter of at least this many elements is a piece of its own in the ``owners`` exchange
(:func:`send_pieces`): a partial sum held per parameter sends it without a copy."""


def send_pieces(params: Sequence[torch.Tensor], bucket_params: Sequence[Sequence[int]],
                split_numel: int = SPLIT_NUMEL) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """The ``owners`` exchange's pieces: each gradient bucket (``bucket_params``: its parameters'
    indices, consecutive) cut at the edges of every parameter of at least ``split_numel``
    elements; smaller neighbours stay together. Returns (the pieces' flat ranges, per bucket the
    indices of its pieces). A unit of a piece then lies inside one large parameter (sent from that
    parameter's tensor, no copy) or inside a run of small ones (a short copy)."""
    offsets, at = [], 0
    for p in params:
        offsets.append(at)
        at += p.numel()
    pieces: list[tuple[int, int]] = []
    groups: list[list[int]] = []
    for idx in bucket_params:
        mine: list[int] = []
        run: tuple[int, int] | None = None
        for i in sorted(idx):
            lo, hi = offsets[i], offsets[i] + params[i].numel()
            if params[i].numel() >= split_numel:
                if run is not None:
                    mine.append(len(pieces))
                    pieces.append(run)
                    run = None
                mine.append(len(pieces))
                pieces.append((lo, hi))
            else:
                run = (lo, hi) if run is None else (run[0], hi)
        if run is not None:
            mine.append(len(pieces))
            pieces.append(run)
        groups.append(mine)
    return pieces, groups


def owner_exchange(plan: TreePlan, group: Group, numel: int, *, dtype: torch.dtype, device: torch.device | str,
                   bounds: Ranges | None = None, gather: Ranges | None = None,
                   pieces: Ranges | None = None) -> OwnerExchange:
    """This worker's side of the ``owners`` exchange of ``plan``'s vectors of ``numel`` elements
    (``bounds``/``gather``: :func:`sharded_bounds`, or even chunks gathered whole; ``pieces``:
    the ranges :meth:`~virtualflow.comm.exchange.OwnerExchange.send` may send one at a time); the
    chunks are cut into fewer messages when the group shares one machine (:attr:`Group.local
    <virtualflow.comm.groups.Group.local>`)."""
    schedule = OwnerSchedule.build(plan, numel, bounds=bounds, pieces=pieces, gather=gather,
                                   depth=depth_for(group.local))
    pieces_units = None
    if pieces is not None:
        pieces_units = [[j for j, u in enumerate(schedule.units) if lo <= u.lo and u.hi <= hi] for lo, hi in pieces]
    return OwnerExchange(schedule, group, dtype=dtype, device=device, pieces_units=pieces_units)
