"""Replicas of the sharded optimizer's chunks (``shard_replicas=1``): a failure loses no state.

Layout. In a generation of p workers, worker r holds chunk r of the optimizer state (its own,
:class:`~virtualflow.runtime.sharded.ShardedOptimizer`) and a replica of chunk r-1 mod p, its
predecessor's in ring order (:class:`~virtualflow.runtime.sharded.ChunkReplica`), both cut from
the whole state when the generation forms. Cost: the replica's optimizer state (as much as the
own chunk's) and one chunk of gradient to receive into (``replica_bytes`` in the done report).

A step, once the reduced gradient is final (unscaled, clipped) and the step is known to be applied:

1. **exchange**: worker r sends its chunk's reduced gradient to r+1 and receives r-1's into the
   replica's buffer (point-to-point, 1/p of the gradient each way);
2. **commit**: a one-element all-reduce over the generation;
3. **apply**: the own chunk is stepped, then the parameters' all-gather is launched, and while it
   runs the replica is stepped with the predecessor's gradient, on a copy of the predecessor's
   parameters kept in the gradient buffer (free outside the own chunk once the gradient is
   reduced): the owner's kernels on views cut as the owner's, with the same values, so the replica
   holds the owner's state bit for bit (the update is elementwise).

The replica is refreshed with the gradient rather than the new state: the gradient is one vector
where Adam's state is two, and, sent *before* anything is updated, it lets step 2 decide the step.

Commit rule (why every survivor agrees). Nothing is updated before the commit all-reduce completes,
and it completes on a worker only after every worker has entered it, i.e. after every worker holds
its own reduced gradient and its predecessor's (step 1 comes first on each worker). After a failure
in step ``s``:

* **no survivor's commit completed**: no survivor updated anything (a worker that did has failed);
  every survivor holds the state before ``s``, the failed worker's chunk is in its successor's
  replica, and the step is redone, as with the default reduction;
* **some survivor's commit completed**: it applied ``s`` (a failure in the all-gather after that is
  raised at the step boundary, so the step counts as applied: recorded, progress ``s+1``). Every
  survivor whose commit failed entered it, so it holds both gradients: it applies ``s`` when the
  next generation forms, before the state is rebuilt. The failed worker's chunk after ``s`` is in
  its successor's replica, stepped with the gradient it received.

Survivors therefore differ by at most one step, and the rebuild (:func:`rebuild_state`, run by
every member of the next generation before the usual state transfer) gives every member the whole
state at the most advanced step: each old chunk, parameters and optimizer state, is broadcast from
its owner if it survived, else from its successor's replica. The new generation then cuts it again,
as after a planned regroup's gather, and members behind (newcomers, survivors whose commit failed)
receive the rest of the training state from the most advanced member as always.

Lost: a chunk and its only replica, i.e. two neighbours in ring order failing in one generation
(or a failure while the state is being rebuilt after a step was completed there): the job stops
with :class:`~virtualflow.runtime.sharded.ShardLost`, as without replicas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from virtualflow.runtime.sharded import STATE_KEYS, ShardedOptimizer, ShardLost

if TYPE_CHECKING:
    from virtualflow.comm.groups import Group

__all__ = ["REPLICA_TAG", "Holder", "RebuildPlan", "chunk_sources", "exchange_gradients", "plan_rebuild",
           "rebuild_state"]

REPLICA_TAG = 18
"""Point-to-point tag of the replica's gradient exchange (the ring's own tags start at 2**30; the
state gather's is 17)."""

_FIELDS = 7  # a member's row: holds chunks, generation, rank, size, progress, pending, finished

_RESUME = ("resume from the last checkpoint (--resume RUN_DIR; keep --checkpoint-every small)")


# -- pure rules ------------------------------------------------------------------------------------
def chunk_sources(size: int, alive: set[int] | frozenset[int]) -> list[int]:
    """For each chunk of a generation of ``size`` workers, the rank (in that generation) that
    still holds it: its owner if alive, else its successor (the replica's holder). Raises
    :class:`ShardLost` naming the chunks whose owner and successor are both gone."""
    lost = [k for k in range(size) if k not in alive and (k + 1) % size not in alive]
    if lost:
        pairs = ", ".join(f"chunk {k} (ranks {k} and {(k + 1) % size})" for k in lost)
        raise ShardLost(
            f"shard_replicas=1 keeps each chunk of the optimizer state on its owner and on the next worker in ring "
            f"order; of the {size} workers of the last generation, both holders of {pairs} failed, so the state "
            f"cannot be rebuilt in place. {_RESUME[0].upper()}{_RESUME[1:]}")
    return [k if k in alive else (k + 1) % size for k in range(size)]


@dataclass(frozen=True, slots=True)
class Holder:
    """What one member of a forming generation holds of the chunks of the one before."""

    member: int
    """Its rank in the forming generation."""
    generation: int
    """The generation its chunks are cut by."""
    rank: int
    """Its rank there."""
    size: int
    progress: int
    """Steps it has applied."""
    pending: bool
    """It entered the commit of step ``progress`` (it holds both gradients) but did not apply it."""
    finished: bool = False
    """It applied a pending step in an earlier attempt to rebuild (which then failed)."""


@dataclass(frozen=True, slots=True)
class RebuildPlan:
    size: int
    """Workers of the generation the chunks are cut by."""
    target: int
    """The step every holder is at once the plan is carried out."""
    sources: tuple[int, ...]
    """For each chunk, the member (rank in the forming generation) that broadcasts it."""
    finish: frozenset[int]
    """Members that apply their pending step (some survivor applied it)."""
    drop: frozenset[int]
    """Members that drop their pending step (nobody applied it: it is redone)."""


def plan_rebuild(holders: Sequence[Holder]) -> RebuildPlan:
    """What the members of a forming generation do with the chunks they hold (see the module
    docstring's commit rule). Raises :class:`ShardLost` when the state cannot be rebuilt."""
    if not holders:
        raise ValueError("plan_rebuild: no member holds a chunk")
    layouts = sorted({(h.generation, h.size) for h in holders})
    if len(layouts) > 1:
        raise ShardLost(f"shard_replicas=1: the surviving workers hold chunks of different generations "
                        f"{[g for g, _ in layouts]} (a generation formed without some of them), so the optimizer "
                        f"state cannot be rebuilt in place; {_RESUME}")
    size = layouts[0][1]
    ranks = [h.rank for h in holders]
    if len(set(ranks)) != len(ranks) or not all(0 <= r < size for r in ranks):
        raise ShardLost(f"shard_replicas=1: the surviving workers name the ranks {sorted(ranks)} of a generation of "
                        f"{size}, so the optimizer state cannot be rebuilt in place; {_RESUME}")
    if any(h.finished for h in holders):
        raise ShardLost("shard_replicas=1: a worker failed while the optimizer state was being rebuilt after a step "
                        f"had been completed there, so the survivors no longer agree on it; {_RESUME}")
    target = max(h.progress for h in holders)
    behind = [h for h in holders if h.progress < target and not (h.pending and h.progress == target - 1)]
    if behind:
        raise ShardLost(f"shard_replicas=1: survivors at step {target} and at {sorted({h.progress for h in behind})} "
                        f"without the gradients to catch up (the commit rule was broken), so the optimizer state "
                        f"cannot be rebuilt in place; {_RESUME}")
    by_rank = {h.rank: h.member for h in holders}
    sources = tuple(by_rank[r] for r in chunk_sources(size, frozenset(by_rank)))
    finish = frozenset(h.member for h in holders if h.pending and h.progress < target)
    drop = frozenset(h.member for h in holders if h.pending and h.progress == target)
    return RebuildPlan(size=size, target=target, sources=sources, finish=finish, drop=drop)


# -- the step's exchange ---------------------------------------------------------------------------
def exchange_gradients(shard: ShardedOptimizer, group: Group) -> None:
    """Step 1: send this worker's reduced chunk of the gradient to its successor, receive its
    predecessor's into the replica's buffer (every member calls it at the same point)."""
    r = shard.replica
    if r is None:
        return
    lo, hi = shard.chunk()
    # An empty chunk sends nothing, which both sides know from the bounds. The receive gives up
    # at once when the coordinator declares the generation broken (Group.recv).
    sent = group.isend(shard.flat.grad[lo:hi], (group.rank + 1) % group.size, tag=REPLICA_TAG) if hi > lo else None
    if r.hi > r.lo:
        group.recv(r.grad, r.rank, tag=REPLICA_TAG)
    if sent is not None:
        sent.wait()


# -- the rebuild -----------------------------------------------------------------------------------
def rebuild_state(shard: ShardedOptimizer, group: Group, progress: int) -> RebuildPlan | None:
    """Collective (every member of a forming generation calls it before the state transfer): if
    members hold chunks of the last generation (after a failure), give every member the whole
    optimizer state and parameters at the most advanced step; returns the plan carried out, or
    None when no member holds chunks (the start, a resume, a planned regroup). ``progress``: the
    steps this member has applied."""
    device = shard.flat.flat.device
    rows = torch.zeros(group.size, _FIELDS, dtype=torch.float64, device=device)
    if not shard.holds_full or shard.finished:  # finished: an earlier attempt failed after a completed step
        rows[group.rank] = torch.tensor([1.0, shard.generation, shard.rank, shard.size, progress,
                                         float(shard.pending), float(shard.finished)], dtype=torch.float64)
    group.all_reduce(rows.view(-1))
    holders = [Holder(member=m, generation=int(row[1]), rank=int(row[2]), size=int(row[3]), progress=int(row[4]),
                      pending=row[5] > 0, finished=row[6] > 0)
               for m, row in enumerate(rows.tolist()) if row[0] > 0]
    if not holders:
        return None
    plan = plan_rebuild(holders)
    if group.rank in plan.finish:
        shard.step()  # the step some survivor applied: with the gradients this member holds
        shard.finished = True
    elif group.rank in plan.drop:
        shard.pending = False  # nobody applied it: redone
    flat, n = shard.flat, len(shard.flat.params)
    K = len(STATE_KEYS)
    owned = torch.zeros(K + 1, n, dtype=torch.float64, device=device)  # flags per key, then step values
    whole: dict[str, torch.Tensor] = {}
    for k, (lo, hi) in enumerate(shard.bounds_for(plan.size)):
        src = plan.sources[k]
        pieces, opt = _held_chunk(shard, k) if src == group.rank else ({}, None)
        state = opt.state if opt is not None else {}
        # header: [owned flags and steps of the parameters starting in the chunk | keys present]
        header = torch.zeros((K + 1) * n + K, dtype=torch.float64, device=device)
        if src == group.rank:
            head = header[: (K + 1) * n].view(K + 1, n)
            for i, (a, view) in pieces.items():
                for key, v in state.get(view, {}).items():
                    if key not in STATE_KEYS:
                        raise ValueError(f"shard_replicas=1 cannot move optimizer state {key!r} of "
                                         f"{type(shard.user).__name__}")
                    if v is None:
                        continue
                    j = STATE_KEYS.index(key)
                    header[(K + 1) * n + j] = 1.0
                    if a == flat.offsets[i]:
                        head[j, i] = 1.0
                        if key == "step":
                            head[K, i] = float(v)
        group.broadcast(header, src)
        owned += header[: (K + 1) * n].view(K + 1, n)
        if hi == lo:
            continue
        group.broadcast(flat.flat[lo:hi], src)  # the parameters, in place
        for j, key in enumerate(STATE_KEYS):
            if key == "step" or header[(K + 1) * n + j] == 0:
                continue
            seg = whole.setdefault(key, torch.zeros(flat.numel, dtype=flat.flat.dtype, device=device))[lo:hi]
            for i, (a, view) in pieces.items():
                value = state.get(view, {}).get(key)
                if value is not None:
                    seg[a - lo : a - lo + view.numel()].copy_(value.reshape(-1))
            group.broadcast(seg, src)
    step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    for j, key in enumerate(STATE_KEYS):
        for i in torch.nonzero(owned[j] > 0).flatten().tolist():
            p, o = flat.params[i], flat.offsets[i]
            if key == "step":
                value = torch.tensor(owned[K, i].item(), dtype=step_dtype)
            else:
                value = whole[key][o : o + p.numel()].view_as(p).clone()
            per_param.setdefault(i, {})[key] = value
    shard.keep_full(shard.assemble(per_param))
    flat.zero_grad()  # a finished step's gradient is spent
    return plan


def _held_chunk(shard: ShardedOptimizer, k: int):
    """(pieces, optimizer) of chunk ``k`` of the last generation as this member holds it."""
    if shard.rank == k and not shard.holds_full:
        return shard.pieces, shard.local
    r = shard.replica
    if r is not None and r.rank == k:
        return r.pieces, r.optimizer
    raise RuntimeError(f"rebuild: rank {shard.rank} holds no copy of chunk {k}")  # plan_rebuild's invariant
