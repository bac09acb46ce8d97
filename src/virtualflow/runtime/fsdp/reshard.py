"""A resize of sharded parameters: each worker receives exactly the ranges of its new shards.

Purpose: at a planned membership change the old generation's members (leavers included) are all
at the same step boundary and their group still works. :func:`move_shards` runs there: from the
old and new member lists every member computes the same plan (:func:`~virtualflow.plan.param_shards.moves`
per unit) and sends each range of its shards, parameters and optimizer state alike, to the
member that will hold it. A surviving member receives its own new shard; a member that joins has
no place in the old group, so a *deputy* (a surviving member, the same on every side: the
``j``-th newcomer's is the ``j mod s``-th of the ``s`` survivors in new-rank order) receives the
newcomer's shard and hands it over in the new generation (:func:`hand_over`). Nothing is gathered
whole anywhere; every byte crosses the network at most twice (once for a newcomer's).

Invariants: the moved ranges are the parameters' and their optimizer state's own bits (copies,
no arithmetic), so a resized run continues bit for bit. The plan depends only on the member lists
and the units' sizes, so every member computes it alike without a message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from virtualflow.comm.groups import Group
from virtualflow.runtime.transfer import Successor
from virtualflow.plan.param_shards import moves, unit_bounds

__all__ = ["MOVE_TAG", "Prepared", "Successor", "deputies", "hand_over", "move_shards"]

MOVE_TAG = 21
"""Point-to-point tag of a resize's moves."""


@dataclass
class Prepared:
    """What a member holds after the moves: its new shards (per unit, per key: ``param`` and the
    optimizer's elementwise entries), its deputised newcomers' (by new rank), the new layout."""

    rank: int
    size: int
    mine: list[dict[str, torch.Tensor]]
    scalars: dict[str, float]
    handover: dict[int, list[dict[str, torch.Tensor]]] = field(default_factory=dict)


def deputies(survivors: Sequence[int], newcomers: Sequence[int]) -> dict[int, int]:
    """New rank of each newcomer -> new rank of its deputy (survivors in new-rank order)."""
    s = sorted(survivors)
    return {d: s[j % len(s)] for j, d in enumerate(sorted(newcomers))}


def _holders(successor: Successor) -> tuple[dict[int, int], dict[int, int]]:
    """(old rank of each surviving member -> its new rank, new rank -> new rank holding its shard now)."""
    new_of = {r: successor.members.index(m) for r, m in enumerate(successor.previous) if m in successor.members}
    survivors = list(new_of.values())
    if not survivors:
        raise ValueError("fsdp: a planned change keeps none of the old members; the shards cannot be moved in place")
    newcomers = [d for d, m in enumerate(successor.members) if m not in successor.previous]
    holder = {d: d for d in survivors}
    holder.update(deputies(survivors, newcomers))
    return new_of, holder


def move_shards(units: Sequence[Any], chunks: Sequence[dict[str, torch.Tensor]], scalars: dict[str, float],
                group: Group, successor: Successor) -> Prepared | None:
    """Collective in the old group: every range of ``chunks`` (per unit, per key, this member's
    old shard) to the member that holds it next. Returns what this member holds (None for a
    member that leaves)."""
    new_of, holder = _holders(successor)
    old_of_new = {n: o for o, n in new_of.items()}
    me, size = group.rank, len(successor.members)
    mine_new = new_of.get(me)
    held = [d for d, h in holder.items() if h == mine_new] if mine_new is not None else []
    out: dict[int, list[dict[str, torch.Tensor]]] = {d: [] for d in held}
    works = []
    for u, chunk in zip(units, chunks):
        new_bounds = unit_bounds(u.numels, size)
        targets = {d: {k: v.new_zeros(new_bounds[d][1] - new_bounds[d][0]) for k, v in chunk.items()} for d in held}
        for m in moves(u.bounds, new_bounds):
            src_rank, dst_rank = m.src, old_of_new[holder[m.dst]]
            if src_rank == me and dst_rank == me:
                for k, v in chunk.items():
                    targets[m.dst][k][m.lo - new_bounds[m.dst][0] : m.hi - new_bounds[m.dst][0]].copy_(
                        v[m.lo - u.lo : m.hi - u.lo])
                continue
            for k in sorted(chunk):
                if src_rank == me:
                    works.append(group.isend(chunk[k][m.lo - u.lo : m.hi - u.lo].contiguous(), dst_rank, MOVE_TAG))
                elif dst_rank == me:
                    lo = m.lo - new_bounds[m.dst][0]
                    works.append(group.irecv(targets[m.dst][k][lo : lo + m.hi - m.lo], src_rank, MOVE_TAG))
        for d in held:
            out[d].append(targets[d])
    for w in works:
        w.wait()
    if mine_new is None:
        return None
    return Prepared(mine_new, size, out.pop(mine_new), dict(scalars), out)


def hand_over(units: Sequence[Any], group: Group, prepared: Prepared | None, behind: Sequence[int],
              keys: Sequence[str]) -> list[dict[str, torch.Tensor]] | None:
    """Collective in the new generation: each deputy sends its newcomers their shards (``behind``:
    the newcomers' ranks). Returns a newcomer's shards (None for the others)."""
    survivors = [r for r in range(group.size) if r not in behind]
    dep = deputies(survivors, behind)
    works, got = [], None
    if group.rank in behind:
        got = []
        for u in units:
            lo, hi = unit_bounds(u.numels, group.size)[group.rank]
            got.append({k: torch.zeros(hi - lo, dtype=u.dtype, device=u.host) for k in keys})
            for k in sorted(keys):
                if hi > lo:
                    works.append(group.irecv(got[-1][k], dep[group.rank], MOVE_TAG))
    elif prepared is not None:
        for d, chunks in sorted(prepared.handover.items()):
            for chunk in chunks:
                for k in sorted(chunk):
                    if chunk[k].numel():
                        works.append(group.isend(chunk[k], d, MOVE_TAG))
    for w in works:
        w.wait()
    return got
