"""Settling a step that a failure interrupted in its statistics all-reduce.

A failure in a flush step's stats all-reduce can complete the step on some members only: they
applied it, the others did not (their gradients are reduced: only the stats are missing). When
the next generation forms, :func:`settle_commit` lets those others finish the step from the
stats a member that completed it hands over, so that every stage reaches the generation's target
step again (without it, a stage whose every member missed the stats could not be made
consistent). :class:`InterruptedCommit` keeps a worker's side of it from the failure to the next
generation.

Invariants: collective over the new generation's group only when the members' steps (known to
all) differ by one, so every member enters the same collectives; a member's pending step is
either finished with the handed-over stats or discarded (back to the step's start), never kept.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from virtualflow.comm.groups import Group

__all__ = ["InterruptedCommit", "settle_commit"]


def settle_commit(group: Group, steps: list[int], target: int,
                  pending: tuple[int, Callable[[torch.Tensor], Any]] | None, stage: Any, stats_numel: Callable[[], int],
                  device: torch.device) -> list[int] | None:
    """Finish ``pending`` (this member's step interrupted in its stats all-reduce: ``(step,
    finish)``) from the stats of a member that completed it, or discard it. ``stage``: this
    member's :class:`~.engine.StageEngine` (``None``: a newcomer); ``stats_numel()``: the stats
    vector's size. Returns the members' steps after settling, ``None`` where nothing was settled."""
    me = group.rank
    if not (target >= 1 and target - 1 in steps and target in steps):
        if pending is not None:
            stage.discard_step()
        return None
    mine = pending is not None and pending[0] == steps[me] == target - 1
    holds = stage is not None and stage.last_commit is not None and \
        stage.last_commit[0] == target - 1 and steps[me] == target
    flags = torch.zeros(2 * group.size, dtype=torch.float64, device=device)
    flags[2 * me], flags[2 * me + 1] = float(mine), float(holds)
    group.all_reduce(flags)
    waiting = [r for r in range(group.size) if flags[2 * r] > 0]
    sources = [r for r in range(group.size) if flags[2 * r + 1] > 0]
    if not waiting or not sources:
        if pending is not None:
            stage.discard_step()
        return None
    stats = stage.last_commit[1][: stats_numel()].clone() if me == sources[0] else \
        torch.zeros(stats_numel(), dtype=torch.float64, device=device)
    group.broadcast(stats, sources[0])
    if mine:
        pending[1](stats)
        stage.last_commit = (target - 1, stats)
    elif pending is not None:
        stage.discard_step()  # back to the step's start; nothing changes once the step settled
    return [target if r in waiting else s for r, s in enumerate(steps)]


class InterruptedCommit:
    """A worker's step that a failure interrupted in its stats all-reduce, from the failure
    (:meth:`keep`) to the next generation (:meth:`settle`, then :meth:`steps_of`)."""

    def __init__(self) -> None:
        self.pending: tuple[int, Callable[[torch.Tensor], Any]] | None = None
        """(step, finish) of this worker's step waiting for its stats."""
        self.settled: tuple[int, list[int]] | None = None
        """(generation, the members' steps after settling) of the last settling."""

    def keep(self, stage: Any) -> None:
        """A failure: keep ``stage``'s step waiting for its stats; without one, put the stage back
        at the step's start."""
        self.pending = stage.pending_commit if stage is not None else None
        if stage is not None:
            stage.pending_commit = None
        if stage is not None and self.pending is None:
            stage.discard_step()

    def settle(self, group: Group, steps: list[int], target: int, stage: Any, stats_numel: Callable[[], int],
               device: torch.device) -> list[int]:
        """:func:`settle_commit` of the kept step; returns the members' steps after settling."""
        pending, self.pending = self.pending, None
        settled = settle_commit(group, steps, target, pending, stage, stats_numel, device)
        if settled is None:
            return steps
        self.settled = (group.generation, settled)
        return settled

    def steps_of(self, generation: int, steps: list[int]) -> list[int]:
        """The members' steps in ``generation``: after a settling, those that finished the
        interrupted step need nothing."""
        if self.settled is not None and self.settled[0] == generation:
            return self.settled[1]
        return steps
