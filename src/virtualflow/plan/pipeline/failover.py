"""Bamboo's failover and reconfiguration, as pure decisions on a pipeline's *layout*.

A layout says which stages each worker of one pipeline replica runs, in pipeline order:
``((0,), (1,), (2,), (3,))`` is the full-depth pipeline of 4 stages; ``((0,), (1, 2), (3,))`` is
the same pipeline after the worker of stage 2 was lost and its predecessor took stage 2 over.
Every worker keeps a replica of its successor worker's stages (``Pipeline.redundancy``), so:

* **Failover.** A lost worker ``m`` is covered by its predecessor ``m - 1``, which holds a
  replica of all of ``m``'s stages and runs them after its own. The first worker is the
  exception: its replica is on the last worker, which cannot run the last and the first stage
  together (not a contiguous piece of the model), so the *second* worker runs the first stage
  before its own, receiving its state from the last worker's replica (one transfer). A loss
  cannot be covered when the replica holder is lost too (two cyclically consecutive workers),
  or when ``m`` already ran more than one stage (a failed-over worker). Then the decision is a
  :class:`Fallback` naming why, and the job ends with the checkpoint to resume from.
* **Reconfiguration.** Newcomers go, one each, to the workers running more than one stage: a
  newcomer takes the *last* stage of such a worker (the stage that worker took over), until every
  worker runs one stage again.
* **Several pipeline replicas.** A job of ``k`` replicas has one layout per replica; its *flat*
  layout (the generation record's) lists every member's run, replica after replica (a replica
  starts at the run holding stage 0). Each replica is judged on its own with :func:`failover`
  (:func:`failover_replicas`): a replica that loses a worker it can cover fails over and goes on
  one worker shorter while the others stay at full depth; a replica that cannot cover its loss
  leaves whole (its survivors are dropped, as a job without redundancy does); only when no
  replica is left is the decision a :class:`Fallback`. Reconfiguration is applied replica by
  replica, in replica order (:func:`reconfigure_replicas`).

Pure: no processes; the membership controller and the worker engine act on these decisions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

Layout = tuple[tuple[int, ...], ...]


def standard(stages: int) -> Layout:
    """One stage per worker."""
    return tuple((s,) for s in range(stages))


def check_layout(layout: Sequence[Sequence[int]], stages: int) -> Layout:
    """``layout`` as a tuple, or ``ValueError`` unless its workers run contiguous, non-empty runs
    of stages that cover ``0 .. stages-1`` in order."""
    out = tuple(tuple(int(s) for s in run) for run in layout)
    flat = [s for run in out for s in run]
    if not out or any(not run for run in out) or flat != list(range(stages)):
        raise ValueError(f"pipeline layout {[list(r) for r in out]} must give each worker a non-empty run of "
                         f"consecutive stages, covering stages 0..{stages - 1} in order")
    return out


def is_standard(layout: Layout) -> bool:
    return all(len(run) == 1 for run in layout)


@dataclass(frozen=True, slots=True)
class Failover:
    layout: Layout
    """The new layout, over the surviving workers in their order."""
    survivors: tuple[int, ...]
    """Indices (in the old layout) of the workers that go on, in order."""
    taken_over: dict[int, int]
    """Old index of each lost worker -> old index of the worker that takes its stages over."""


@dataclass(frozen=True, slots=True)
class Fallback:
    reason: str


def failover(layout: Layout, lost: Sequence[int]) -> Failover | Fallback:
    """What the pipeline becomes when the workers at indices ``lost`` are gone."""
    lost_set = set(lost)
    n = len(layout)
    if not lost_set:
        return Failover(layout, tuple(range(n)), {})
    if any(not 0 <= m < n for m in lost_set):
        raise ValueError(f"lost workers {sorted(lost_set)} are not indices of a {n}-worker layout")
    for m in sorted(lost_set):
        stages = layout[m]
        if len(stages) > 1:
            return Fallback(f"the worker running stages {list(stages)} (it had taken a stage over) was lost; "
                            f"no replica holds both")
        if (m - 1) % n in lost_set:
            return Fallback(f"the workers of consecutive stages {layout[(m - 1) % n][-1]} and {stages[0]} were "
                            f"lost: the replica of stage {stages[0]} was on the other one")
        if m == 0 and (n < 2 or 1 in lost_set):
            return Fallback(f"the worker of the first stage {stages[0]} was lost and no worker of the next "
                            f"stage is left to run it")
    new: list[tuple[int, ...]] = []
    survivors: list[int] = []
    taken: dict[int, int] = {}
    for i, run in enumerate(layout):
        if i in lost_set and i > 0:
            new[-1] = new[-1] + run  # the predecessor (a survivor: checked above) runs them after its own
            taken[i] = survivors[-1]
        elif i in lost_set:
            continue  # the first worker: its stages go to the next worker (below)
        elif 0 in lost_set and not new:
            new.append(layout[0] + run)  # runs the first stage (its state comes from the last worker's replica)
            survivors.append(i)
            taken[0] = i
        else:
            new.append(run)
            survivors.append(i)
    return Failover(tuple(new), tuple(survivors), taken)


@dataclass(frozen=True, slots=True)
class Reconfigure:
    layout: Layout
    order: tuple[int | None, ...]
    """Per worker of the new layout: its index in the old layout, or ``None`` for a newcomer."""


def reconfigure(layout: Layout, newcomers: int) -> Reconfigure:
    """Place up to ``newcomers`` new workers: each takes the last stage of a worker running
    more than one, in pipeline order, until every worker runs one stage (extra newcomers are not
    placed: the layout has no room; whole new pipeline replicas are the controller's business)."""
    new: list[tuple[int, ...]] = []
    order: list[int | None] = []
    left = newcomers
    for i, run in enumerate(layout):
        if len(run) > 1 and left > 0:
            keep = run
            taken: list[tuple[int, ...]] = []
            while len(keep) > 1 and left > 0:
                taken.insert(0, (keep[-1],))
                keep = keep[:-1]
                left -= 1
            new.append(keep)
            order.append(i)
            new.extend(taken)
            order.extend([None] * len(taken))
        else:
            new.append(run)
            order.append(i)
    return Reconfigure(tuple(new), tuple(order))


# ---- several pipeline replicas ------------------------------------------------------------------
def split_replicas(flat: Sequence[Sequence[int]], stages: int) -> tuple[Layout, ...]:
    """A job's flat layout (one run per member, replicas one after another) cut into its replicas'
    layouts: a replica starts at each run that begins with stage 0. ``ValueError`` unless every
    replica is a valid layout (:func:`check_layout`)."""
    runs = [tuple(int(s) for s in run) for run in flat]
    out: list[list[tuple[int, ...]]] = []
    for run in runs:
        if not out or (run and run[0] == 0):
            out.append([])
        out[-1].append(run)
    if not out:
        raise ValueError("a pipeline layout needs at least one worker")
    return tuple(check_layout(rep, stages) for rep in out)


def flatten(layouts: Sequence[Layout]) -> Layout:
    """The flat layout of replicas' layouts (the inverse of :func:`split_replicas`)."""
    return tuple(run for rep in layouts for run in rep)


@dataclass(frozen=True, slots=True)
class ReplicasFailover:
    layouts: tuple[Layout, ...]
    """The surviving replicas' layouts, in replica order."""
    survivors: tuple[int, ...]
    """Flat indices (in the old layout) of the workers that go on, in order."""
    taken_over: dict[int, int]
    """Flat old index of each lost worker -> flat old index of the worker that takes its stages over."""
    failed_over: tuple[int, ...]
    """Old indices of the replicas that covered a loss (they run shorter now)."""
    left: dict[int, str]
    """Old index of each replica that leaves whole -> why its loss could not be covered."""
    kept: tuple[int, ...]
    """Old indices of the replicas that go on, in order (``layouts[i]`` is replica ``kept[i]``'s)."""

    @property
    def layout(self) -> Layout:
        return flatten(self.layouts)


def failover_replicas(layouts: Sequence[Layout], lost: Sequence[int]) -> ReplicasFailover | Fallback:
    """What a job of pipeline replicas becomes when the workers at flat indices ``lost`` are gone
    (see the module docstring). One replica: exactly :func:`failover`'s decision."""
    total = sum(len(rep) for rep in layouts)
    lost_set = set(lost)
    if any(not 0 <= m < total for m in lost_set):
        raise ValueError(f"lost workers {sorted(lost_set)} are not indices of a {total}-worker layout")
    new: list[Layout] = []
    survivors: list[int] = []
    taken: dict[int, int] = {}
    failed_over: list[int] = []
    left: dict[int, str] = {}
    kept: list[int] = []
    offset = 0
    for j, rep in enumerate(layouts):
        local = [m - offset for m in lost_set if offset <= m < offset + len(rep)]
        decision = failover(rep, local)
        if isinstance(decision, Fallback):
            left[j] = decision.reason
        else:
            new.append(decision.layout)
            kept.append(j)
            survivors += [offset + i for i in decision.survivors]
            taken.update({offset + m: offset + q for m, q in decision.taken_over.items()})
            if local:
                failed_over.append(j)
        offset += len(rep)
    if not new:
        if len(layouts) == 1:
            return Fallback(left[0])
        return Fallback("every pipeline replica lost a stage it cannot cover ("
                        + "; ".join(f"replica {j}: {why}" for j, why in left.items()) + ")")
    return ReplicasFailover(tuple(new), tuple(survivors), taken, tuple(failed_over), left, tuple(kept))


def reconfigure_replicas(layouts: Sequence[Layout], newcomers: int) -> Reconfigure:
    """:func:`reconfigure` replica by replica, in replica order, over the flat layout: newcomers
    go to the first failed-over replicas first. ``order`` holds flat old indices (``None``: a
    newcomer); the new flat layout is ``layout``."""
    new: list[tuple[int, ...]] = []
    order: list[int | None] = []
    left, offset = newcomers, 0
    for rep in layouts:
        plan = reconfigure(rep, left)
        placed = sum(1 for i in plan.order if i is None)
        left -= placed
        new.extend(plan.layout)
        order.extend(None if i is None else offset + i for i in plan.order)
        offset += len(rep)
    return Reconfigure(tuple(new), tuple(order))
