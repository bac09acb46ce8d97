"""A run's batch size, chosen once per engine: one batch (:class:`OneBatch`) or a schedule of
changes applied in place at step boundaries (:class:`ScheduledBatch`).

Purpose: the VN engine's side of ``Job.batch_schedule`` (the rules: :mod:`virtualflow.plan.batch_schedule`).
At the boundary before a step whose V differs from the one the engine runs, the data plan takes
the new V (same per-VN size) and the engine adopts its own group again with the equal contiguous
map of the new V over its members, as a resize does (:meth:`VNEngine.set_membership
<virtualflow.runtime.engine.VNEngine.set_membership>`: the statistics vector and, in deterministic
mode, the fixed VN-id tree are rebuilt for the new V). Every member holds the same schedule, so
every member changes at the same step without a message. The learning rate's multiplier of the
step's batch is applied around the optimizer's step only (a pre- and a post-hook): each group's
``lr`` is multiplied before ``optimizer.step()`` and put back, bit for bit, right after it, so an
LR scheduler keeps stepping the unscaled rate.

A change asked while the run goes on (the cluster service's, through a ``batch`` control
command: :func:`changed`) is appended to the schedule at the step boundary where every member
reads the command, so it applies from the first step not yet run, as a change written in
``Job.batch_schedule`` for that step would; a member that joins later receives the changes from
the member the state comes from (:func:`adopt_changes`).

Invariants: a generation formed at step ``s`` runs the V of step ``s`` (a member joining after a
change runs the changed V); a checkpoint records the changes its steps ran
(:meth:`ScheduledBatch.state_entries`) and a resume whose job's schedule differs there is refused.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from virtualflow.comm.groups import Group
from virtualflow.plan.batch_schedule import BatchSchedule, check_recorded
from virtualflow.plan.data import DataPlan
from virtualflow.plan.vnmap import contiguous_assignment

if TYPE_CHECKING:
    from virtualflow.runtime.engine import VNEngine

__all__ = ["OneBatch", "ScheduledBatch", "adopt_changes", "batch_of", "changed", "parse_rule"]


class OneBatch:
    """A job without ``batch_schedule``: the batch never changes."""

    def assignment(self, plan: DataPlan, step: int, size: int, given: Sequence[Sequence[int]]) -> Sequence[Sequence[int]]:
        """The VN map a generation formed at ``step`` runs: the one the coordinator published."""
        return given

    def before_step(self, vn: VNEngine, step: int) -> None:
        pass

    def rate(self, lr: float) -> float:
        """The rate the next step runs at, given the optimizer's."""
        return lr

    def state_entries(self) -> dict[str, Any]:
        return {}

    def check_resume(self, state: dict[str, Any]) -> None:
        """A checkpoint of a run whose batch changed does not resume without its schedule."""
        check_recorded(state, ())


class ScheduledBatch:
    """A job with ``batch_schedule``: V changes at the schedule's steps, the learning rate with it."""

    def __init__(self, schedule: BatchSchedule, optimizer: torch.optim.Optimizer) -> None:
        self.schedule = schedule
        self.multiplier = 1.0
        """The learning rate's multiplier of the step being run."""
        self._saved: list[Any] = []
        self._last = -1
        """The last step begun here."""
        optimizer.register_step_pre_hook(self._scale)
        optimizer.register_step_post_hook(self._restore)

    def _scale(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._saved = [g["lr"] for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g["lr"] = g["lr"] * self.multiplier

    def _restore(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for g, lr in zip(optimizer.param_groups, self._saved):
            g["lr"] = lr

    def assignment(self, plan: DataPlan, step: int, size: int, given: Sequence[Sequence[int]]) -> list[list[int]]:
        """The VN map a generation formed at ``step`` runs: the equal contiguous map of that step's
        V over ``size`` members (the coordinator's map is of the job's first V); the plan takes the V."""
        v = self.schedule.virtual_nodes_at(step)
        plan.set_virtual_nodes(v)
        self._last = step - 1
        return contiguous_assignment(v, size)

    def before_step(self, vn: VNEngine, step: int) -> None:
        """At the boundary before ``step``: its learning-rate multiplier and, when its V differs, the
        new V adopted in place (the same group, the new map)."""
        self.multiplier, self._last = self.schedule.multiplier_at(step), step
        v = self.schedule.virtual_nodes_at(step)
        if v != vn.plan.virtual_nodes:
            assert vn.group is not None
            vn.set_membership(vn.group, self.assignment(vn.plan, step, vn.group.size, ()))
            if vn.leaves is not None:  # the tree's BatchNorm statistics are a mean over the step's V
                vn.leaves.tail.mean_over = v

    def rate(self, lr: float) -> float:
        """The rate the next step runs at, given the optimizer's (the step's multiplier applied)."""
        return lr * self.schedule.multiplier_at(self._last + 1)

    def state_entries(self) -> dict[str, Any]:
        """What a checkpoint taken now records: the changes that ran up to the last step."""
        return {"batch_schedule": [list(c) for c in self.schedule.before(self._last)]}

    def check_resume(self, state: dict[str, Any]) -> None:
        """Refuse a checkpoint whose recorded changes are not the job's up to its step."""
        check_recorded(state, self.schedule.changes)


def batch_of(plan: DataPlan, optimizer: torch.optim.Optimizer) -> OneBatch | ScheduledBatch:
    """The engine's batch behaviour, chosen once from the plan's schedule (a streaming job's
    :class:`~virtualflow.plan.streams.StreamPlan` has none: a schedule with a stream is refused)."""
    schedule = getattr(plan, "schedule", None)
    return OneBatch() if schedule is None else ScheduledBatch(schedule, optimizer)


def parse_rule(text: str) -> str | dict[int, float]:
    """A ``batch`` command's ``lr_rule`` (JSON text): ``"linear"``, ``"sqrt"`` or ``{batch: multiplier}``."""
    rule = json.loads(text)
    return {int(b): float(m) for b, m in rule.items()} if isinstance(rule, Mapping) else rule


def changed(batch: OneBatch | ScheduledBatch, plan: DataPlan, optimizer: torch.optim.Optimizer, step: int,
            virtual_nodes: int, lr_rule: Any) -> ScheduledBatch:
    """``batch`` with the change ``(step, virtual_nodes)`` appended (``step``: the first step not
    yet run), the learning rate following ``lr_rule``; the plan's positions follow it. A job
    without a schedule gets one whose base is its own batch (the plan's, never changed before)."""
    if isinstance(batch, ScheduledBatch):
        old = batch.schedule
        schedule = BatchSchedule(old.base_batch, old.base_vns, (*old.changes, (step, virtual_nodes)), lr_rule)
    else:
        schedule = BatchSchedule(plan.global_batch_size, plan.virtual_nodes, ((step, virtual_nodes),), lr_rule)
    return _with_schedule(batch, plan, optimizer, schedule, step)


def adopt_changes(batch: OneBatch | ScheduledBatch, plan: DataPlan, optimizer: torch.optim.Optimizer, group: Group,
                  src: int, behind: Sequence[int], step: int, device: torch.device) -> OneBatch | ScheduledBatch:
    """A generation forming with the ranks ``behind`` receiving the state from rank ``src``: they
    take ``src``'s schedule (changes asked while the run went on are in no job's knobs), as JSON
    bytes in two broadcasts every member enters. Returns the batch this member runs."""
    mine = b""
    if group.rank == src and isinstance(batch, ScheduledBatch):
        s = batch.schedule
        rule = s.lr_rule if isinstance(s.lr_rule, str) else {str(b): m for b, m in s.lr_rule.items()}
        mine = json.dumps([s.base_batch, s.base_vns, [list(c) for c in s.changes], rule]).encode()
    size = torch.tensor([len(mine)], dtype=torch.int64, device=device)
    group.broadcast(size, src)
    n = int(size.item())
    if not n:
        return batch
    data = (torch.tensor(list(mine), dtype=torch.uint8) if group.rank == src else torch.zeros(n, dtype=torch.uint8))
    data = data.to(device)
    group.broadcast(data, src)
    if group.rank not in behind:
        return batch  # the source, or a member at the target step: it ran the same changes
    base_batch, base_vns, changes, rule = json.loads(bytes(data.cpu().tolist()).decode())
    return _with_schedule(batch, plan, optimizer, BatchSchedule(base_batch, base_vns, tuple(map(tuple, changes)),
                                                                parse_rule(json.dumps(rule))), step)


def _with_schedule(batch: OneBatch | ScheduledBatch, plan: DataPlan, optimizer: torch.optim.Optimizer,
                   schedule: BatchSchedule, step: int) -> ScheduledBatch:
    """``batch`` running ``schedule`` from ``step`` on (the plan's positions follow it)."""
    plan.set_schedule(schedule)
    if isinstance(batch, ScheduledBatch):
        batch.schedule = schedule
        return batch
    out = ScheduledBatch(schedule, optimizer)
    out._last = step - 1
    return out
