"""Bamboo's failover policy for a job of redundant pipeline replicas: pure, returns decisions.

A job with Bamboo's redundancy (``Pipeline(redundancy=True)``) keeps, in each pipeline replica,
a copy of every stage on its predecessor. When workers are lost (or noticed for preemption), the
lost workers' predecessors take their stages over (:func:`decide_failover`,
:func:`decide_planned_failover`); a replica that cannot cover its loss leaves whole; with no
replica left the run falls back to a restart. Ready newcomers later take stages back
(:func:`decide_reconfigure`), and a resize below the current size drops whole replicas from
the last one (:func:`decide_shrink`). A pipelined job *without* redundancy keeps whole replicas
only (:func:`whole_replicas`).

The per-replica rules are :mod:`virtualflow.plan.pipeline.failover`'s; this module applies them
to the controller's members and turns them into :mod:`.decisions`. Pure: no store, no processes,
no clock; the controller carries every decision out.

Invariants: members keep their order (every survivor keeps its stage); a published layout is
the flat layout of the surviving replicas; ``layout_after`` is None exactly when every replica
is back at full depth.

Tensor parallelism (``Pipeline(tensor=T)``, ``tensor`` below): a stage is a *tensor group* of
``T`` consecutive members, and the rules apply to tensor groups as they apply to workers without
it (:func:`decide_failover`, :func:`decide_planned_failover`): a group with a lost member is lost
whole (its survivors leave with it) and its predecessor group takes its stages over. Layouts
still name one run per member, every member of a group its group's run (each plane of the grid
re-lays its pipeline by every ``T``-th run); a ``failover`` event's layout names tensor groups.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from virtualflow.control.membership.decisions import (
    FallBack,
    Failover,
    Layout,
    NoChange,
    Reconfigure,
    ReplicaCovered,
    ReplicaLeft,
    Shrink,
)
from virtualflow.plan.pipeline.failover import (
    Fallback,
    ReplicasFailover,
    failover_replicas,
    flatten,
    is_standard,
    reconfigure_replicas,
    split_replicas,
    standard,
)


def replica_layouts(layout: Layout | None, size: int, stages: int) -> tuple[Layout, ...]:
    """Per pipeline replica, its layout (``layout`` None: every replica at full depth)."""
    if layout is None:
        return tuple(standard(stages) for _ in range(size // stages))
    return split_replicas(layout, stages)


def member_runs(layout: Layout | None, size: int, stages: int, tensor: int = 1) -> tuple[list[int], list[int]]:
    """(job stages each of ``size`` members runs, workers per pipeline replica) for the VN map;
    ``stages``: workers per full replica (``P T``)."""
    layouts = replica_layouts(_narrow(layout, tensor), size // tensor, stages // tensor)
    return [len(run) for rep in layouts for run in rep for _ in range(tensor)], [len(rep) * tensor for rep in layouts]


def _tensor_groups(members: Sequence[int], tensor: int) -> dict[int, tuple[int, ...]]:
    """Each tensor group of ``members`` (``tensor`` consecutive members), by its first member."""
    return {members[i]: tuple(members[i:i + tensor]) for i in range(0, len(members), tensor)}


def _narrow(layout: Layout | None, tensor: int) -> Layout | None:
    """A layout of members as one of tensor groups (each group's first member's run)."""
    return None if layout is None else tuple(layout[::tensor])


def _widen_layout(layout: Layout | None, tensor: int) -> Layout | None:
    return None if layout is None else tuple(run for run in layout for _ in range(tensor))


def _widen(d: Failover, groups: dict[int, tuple[int, ...]], tensor: int) -> Failover:
    """A decision about tensor groups (each named by its first member) as one about workers."""
    def wide(ws: Sequence[int]) -> tuple[int, ...]:
        return tuple(w for g in ws for w in groups[g])

    covered = tuple(replace(c, taken_over={str(a): b for lost, taker in c.taken_over.items()
                                           for a, b in zip(groups[int(lost)], groups[taker])})
                    for c in d.covered)
    return replace(d, members=wide(d.members), target=d.target * tensor, replacements=d.replacements * tensor,
                   dropped=wide(d.dropped), covered=covered, layout=_widen_layout(d.layout, tensor),
                   layout_after=_widen_layout(d.layout_after, tensor),
                   left=tuple(replace(left, workers=wide(left.workers)) for left in d.left))


def _by_groups(members: Sequence[int], hit: set[int] | Sequence[int], tensor: int
               ) -> tuple[dict[int, tuple[int, ...]], list[int], set[int]]:
    """(the tensor groups of ``members``, their first members, the groups with a member in ``hit``)."""
    groups = _tensor_groups(members, tensor)
    return groups, list(groups), {g for g, ws in groups.items() if any(w in hit for w in ws)}


def whole_replicas(members: Sequence[int], lost: set[int] | dict[int, str], stages: int) -> list[int]:
    """A pipelined job without redundancy goes on with its whole replicas only: the members of
    every replica that lost none of its workers, in order (empty: no whole replica is left)."""
    replicas = [list(members[i:i + stages]) for i in range(0, len(members), stages)]
    return [w for rep in replicas if not any(x in lost for x in rep) for w in rep]


def _judged(members: Sequence[int], layouts: tuple[Layout, ...], decision: ReplicasFailover,
            current: Sequence[int], layout_before: Layout | None, *, stages: int,
            replace_failed: bool) -> Failover:
    """A replicas' failover as the controller's decision (see :class:`Failover`)."""
    offsets, offset = [], 0
    for rep in layouts:
        offsets.append(offset)
        offset += len(rep)
    left = tuple(ReplicaLeft(j, tuple(members[offsets[j]: offsets[j] + len(layouts[j])]), why)
                 for j, why in decision.left.items())
    covered = []
    for j in decision.failed_over:
        lo, hi = offsets[j], offsets[j] + len(layouts[j])
        new = [list(r) for r in decision.layouts[decision.kept.index(j)]]
        taken = {str(members[m]): members[q] for m, q in decision.taken_over.items() if lo <= m < hi}
        covered.append(ReplicaCovered(j, taken, new, numbered=len(layouts) > 1))
    survivors = tuple(members[i] for i in decision.survivors)
    dropped = tuple(w for w in members if w not in survivors and w in current)
    missing = sum(len(run) - 1 for run in decision.layout)  # workers short of full depth
    target = len(survivors) + ((missing + stages * len(decision.left)) if replace_failed else 0)
    new_layout = decision.layout
    standard_before = layout_before is None or is_standard(layout_before)
    return Failover(
        members=survivors,
        kind="failover" if decision.failed_over else "failure",
        layout=None if is_standard(new_layout) and standard_before else new_layout,
        layout_after=None if is_standard(new_layout) else new_layout,
        target=target,
        replacements=len(dropped) if replace_failed else 0,
        dropped=dropped,
        covered=tuple(covered),
        left=left,
    )


def decide_failover(*, stages: int, members: Sequence[int], layout: Layout | None,
                    formed: tuple[Sequence[int], Layout | None] | None, dead: set[int],
                    replace_failed: bool, tensor: int = 1) -> Failover | FallBack:
    """Workers ``dead`` (every worker lost so far) are gone from a redundant pipelined job.

    Decided from the last generation that *formed* (``formed``: its members and layout, what the
    workers really hold), so losses in quick succession are judged together; when the current
    members include newcomers of an unformed generation, from the current ``members`` and
    ``layout``. ``tensor`` > 1: judged by tensor groups (see the module docstring)."""
    base_members, base_layout = formed if formed is not None else (members, layout)
    if any(w not in base_members for w in members):  # newcomers of an unformed generation: judge now
        base_members, base_layout = members, layout
    base_members = list(base_members)
    if tensor > 1:
        groups, firsts, lost = _by_groups(base_members, dead, tensor)
        current = [g for g in firsts if any(w in members for w in groups[g])]
        narrow = _narrow(base_layout, tensor)
        d = decide_failover(stages=stages // tensor, members=current, layout=narrow, formed=(firsts, narrow),
                            dead=lost, replace_failed=replace_failed)
        return d if isinstance(d, FallBack) else _widen(d, groups, tensor)
    layouts = replica_layouts(base_layout, len(base_members), stages)
    decision = failover_replicas(layouts, [i for i, w in enumerate(base_members) if w in dead])
    if isinstance(decision, Fallback):
        return FallBack(decision.reason)
    return _judged(base_members, layouts, decision, members, base_layout, stages=stages,
                   replace_failed=replace_failed)


def decide_planned_failover(*, stages: int, members: Sequence[int], layout: Layout | None,
                            noticed: Sequence[int], replace_failed: bool,
                            min_workers: int, tensor: int = 1) -> Failover | FallBack:
    """Workers ``noticed`` got a preemption notice: they leave at the next step boundary and
    their predecessors take their stages over, as after a loss but with no step redone. A
    notice no replica survives, or one that would leave fewer than ``min_workers``, is a
    :class:`FallBack` (the controller does not act on it: the loss is judged when it comes).
    ``tensor`` > 1: judged by tensor groups (see the module docstring)."""
    members = list(members)
    if tensor > 1:
        groups, firsts, hit = _by_groups(members, set(noticed), tensor)
        d = decide_planned_failover(stages=stages // tensor, members=firsts, layout=_narrow(layout, tensor),
                                    noticed=sorted(hit),
                                    replace_failed=replace_failed, min_workers=-(-min_workers // tensor))
        return d if isinstance(d, FallBack) else _widen(d, groups, tensor)
    layouts = replica_layouts(layout, len(members), stages)
    decision = failover_replicas(layouts, [i for i, w in enumerate(members) if w in noticed])
    if isinstance(decision, Fallback):
        return FallBack(decision.reason)
    if len(decision.survivors) < min_workers:
        return FallBack(f"below min_workers={min_workers}")
    return _judged(members, layouts, decision, members, layout, stages=stages, replace_failed=replace_failed)


def decide_reconfigure(*, stages: int, members: Sequence[int], layout: Layout | None,
                       ready: Sequence[int], tensor: int = 1) -> Reconfigure | NoChange:
    """Ready newcomers take back the stages a failover gave to other workers (full depth again,
    at a step boundary), replica by replica; the first ready workers are placed first.
    ``tensor`` > 1: newcomers come in as tensor groups of ``tensor`` (in the order they got ready)."""
    if tensor > 1:
        groups = _tensor_groups(members, tensor)
        fresh = _tensor_groups(list(ready)[:len(ready) // tensor * tensor], tensor)
        d = decide_reconfigure(stages=stages // tensor, members=list(groups), layout=_narrow(layout, tensor),
                               ready=list(fresh))
        if isinstance(d, NoChange):
            return d
        every = {**groups, **fresh}

        def wide(ws: Sequence[int]) -> tuple[int, ...]:
            return tuple(w for g in ws for w in every[g])

        return Reconfigure(wide(d.members), wide(d.added), _widen_layout(d.layout, tensor),
                           _widen_layout(d.layout_after, tensor))
    if layout is None or not ready:
        return NoChange("full depth" if layout is None else "no newcomer ready")
    plan = reconfigure_replicas(replica_layouts(layout, len(members), stages), len(ready))
    added = tuple(ready[: sum(1 for slot in plan.order if slot is None)])
    it = iter(added)
    order = tuple(members[i] if i is not None else next(it) for i in plan.order)
    return Reconfigure(order, added, plan.layout, None if is_standard(plan.layout) else plan.layout)


def decide_shrink(*, stages: int, members: Sequence[int], layout: Layout, target: int, tensor: int = 1) -> Shrink:
    """A failed-over job shrinks to ``target``: whole replicas leave from the last one (at least
    one stays). The new target is the size reached (a shrink with no ``removed`` when none can
    leave). ``tensor`` > 1: replicas of tensor groups (see the module docstring)."""
    layouts = replica_layouts(_narrow(layout, tensor), len(members) // tensor, stages // tensor)
    while len(layouts) > 1 and sum(len(rep) for rep in layouts) * tensor > target:
        layouts = layouts[:-1]
    n = sum(len(rep) for rep in layouts) * tensor
    flat = _widen_layout(flatten(layouts), tensor)
    return Shrink(tuple(members[:n]), tuple(members[n:]), n, layout=flat,
                  layout_after=None if all(len(run) == 1 for run in flat) else flat)
