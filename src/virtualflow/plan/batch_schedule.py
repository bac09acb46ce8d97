"""A run's batch schedule: the global batch changing at recorded steps, as a change of V.

Purpose: the rules that make a run whose batch size changes reproducible, as pure functions of
the job (``Job.batch_schedule``, ``Job.lr_rule``); nothing here depends on ranks or workers.

* The per-VN size ``n = B / V`` of the job (``global_batch_size / virtual_nodes``) is fixed. A
  change ``(first_step, V')`` runs ``V'`` virtual nodes, a global batch of ``V' n`` samples, from
  step ``first_step`` on, until the next change. Step 0 runs the job's own ``V``; first steps are
  strictly increasing and at least 1.
* Data: steps read consecutive positions of their epoch's order (:mod:`virtualflow.plan.data`). A
  step of batch ``B`` whose first free position is ``p`` reads ``[p, p + B)``; when the rest of the
  epoch cannot hold it (``p + B > N``, ``N`` samples) it starts the next epoch at position 0 and
  the tail is dropped. With one batch this is the fixed-batch rule (``N // B`` steps per epoch,
  step ``i`` of an epoch at ``i B``), so a schedule with no change reads exactly the same samples.
* Learning rate: the optimizer's step at batch ``B`` runs with each parameter group's ``lr``
  multiplied by ``m(B)``, relative to the job's batch ``B0``: ``"linear"`` ``B / B0``, ``"sqrt"``
  ``sqrt(B / B0)``, or a ``{batch: multiplier}`` mapping that names every batch the schedule
  runs. The multiplier is applied around the optimizer step only, so an LR scheduler keeps
  stepping the unscaled rate (:mod:`virtualflow.runtime.batch_change`).

Invariants: every check raises one line naming the value, the rule and the knob, when the job is
built (at submit); :class:`SchedulePositions` and :class:`FixedPositions` agree on a schedule
without a change.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

__all__ = ["BatchSchedule", "FixedPositions", "batch_events", "check_recorded", "fewest_virtual_nodes", "LR_RULES", "SchedulePositions", "schedule_from_events"]

LR_RULES = ("linear", "sqrt")
"""The named learning-rate rules (a ``{batch: multiplier}`` mapping is the third form)."""


@dataclass(frozen=True, slots=True)
class BatchSchedule:
    """The job's batch at every step, and its learning-rate multiplier."""

    base_batch: int
    """``B0``: the job's ``global_batch_size`` (step 0's batch; the one ``lr_rule`` is relative to)."""
    base_vns: int
    """``V0``: the job's ``virtual_nodes``."""
    changes: tuple[tuple[int, int], ...]
    """``((first_step, virtual_nodes), ...)``, first steps strictly increasing, each >= 1."""
    lr_rule: str | Mapping[int, float]
    """``"linear"``, ``"sqrt"`` or ``{batch: multiplier}``."""
    _firsts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_changes(self.changes)
        object.__setattr__(self, "changes", tuple((int(s), int(v)) for s, v in self.changes))
        object.__setattr__(self, "_firsts", tuple(s for s, _ in self.changes))
        _check_rule(self.lr_rule, sorted({v * self.vn_size for v in self.vn_counts}))

    @classmethod
    def of(cls, global_batch_size: int, virtual_nodes: int, batch_schedule: Any, lr_rule: Any
           ) -> BatchSchedule | None:
        """The schedule of a job's knobs, checked; None for a job that keeps its batch (no
        ``batch_schedule``). An ``lr_rule`` without a schedule, or a schedule without one, is refused."""
        if isinstance(batch_schedule, (str, bytes)) or not isinstance(batch_schedule, Sequence):
            raise ValueError(f"Job.batch_schedule={batch_schedule!r} must be a list of (first_step, virtual_nodes) "
                             f"pairs")
        if not batch_schedule:
            if lr_rule is not None:
                raise ValueError(f"Job.lr_rule={lr_rule!r} is set but Job.batch_schedule is empty; a run that keeps "
                                 f"its batch has no learning-rate rule (give batch_schedule=[(step, virtual_nodes)]"
                                 f" or drop lr_rule)")
            return None
        if lr_rule is None:
            raise ValueError(f"Job.batch_schedule={list(batch_schedule)!r} has no Job.lr_rule; give 'linear', 'sqrt'"
                             f" or {{batch: multiplier}} so the learning rate follows the batch size")
        return cls(global_batch_size, virtual_nodes, tuple(batch_schedule), lr_rule)

    @property
    def vn_size(self) -> int:
        """Samples per virtual node, fixed for the run."""
        return self.base_batch // self.base_vns

    @property
    def vn_counts(self) -> tuple[int, ...]:
        """Every V the run uses, in order of use (the job's first)."""
        return (self.base_vns, *(v for _, v in self.changes))

    @property
    def segments(self) -> tuple[tuple[int, int], ...]:
        """``((first_step, batch), ...)`` from step 0: the batch of each run of steps."""
        return ((0, self.base_batch), *((s, v * self.vn_size) for s, v in self.changes))

    def virtual_nodes_at(self, step: int) -> int:
        """V at ``step``."""
        k = bisect.bisect_right(self._firsts, step)
        return self.changes[k - 1][1] if k else self.base_vns

    def lr_multiplier(self, batch: int) -> float:
        """The learning rate's multiplier at ``batch`` (``lr_rule``, relative to ``base_batch``)."""
        rule = self.lr_rule
        if isinstance(rule, Mapping):
            return float(rule[batch])
        ratio = batch / self.base_batch
        return ratio if rule == "linear" else math.sqrt(ratio)

    def multiplier_at(self, step: int) -> float:
        """The learning rate's multiplier at ``step``."""
        return self.lr_multiplier(self.virtual_nodes_at(step) * self.vn_size)

    def before(self, step: int) -> tuple[tuple[int, int], ...]:
        """The changes that took effect at or before ``step`` (what a checkpoint at ``step`` ran)."""
        return tuple(c for c in self.changes if c[0] <= step)

    def events(self) -> list[dict[str, Any]]:
        """The fields of one ``batch`` record of ``events.jsonl`` per change (:func:`schedule_from_events`
        reads them back)."""
        n = self.vn_size
        rule = self.lr_rule if isinstance(self.lr_rule, str) else {str(b): m for b, m in self.lr_rule.items()}
        return [{"step": s, "virtual_nodes": v, "global_batch_size": v * n,
                 "lr_multiplier": self.lr_multiplier(v * n), "lr_rule": rule} for s, v in self.changes]


def batch_events(job: Any) -> list[dict[str, Any]]:
    """The ``batch`` records of a :class:`~virtualflow.config.job.Job`'s schedule (none without one):
    what the launch writes to ``events.jsonl`` before the first step."""
    schedule = BatchSchedule.of(job.global_batch_size, job.virtual_nodes, job.batch_schedule, job.lr_rule)
    return schedule.events() if schedule is not None else []


def schedule_from_events(events: Iterable[Mapping[str, Any]]) -> tuple[list[tuple[int, int]], Any]:
    """``(batch_schedule, lr_rule)`` recorded by a run's ``batch`` events: the knobs that replay its
    changes (``job.replace(batch_schedule=..., lr_rule=...)``); ``([], None)`` when it made none.
    Each launch (a ``start`` record) writes its whole schedule, whose changes before its resume step
    are the checkpoint's: the last launch's records are the run's."""
    batch: list[Mapping[str, Any]] = []
    for e in events:
        if e.get("event") == "start":
            batch = []
        elif e.get("event") == "batch":
            batch.append(e)
    if not batch:
        return [], None
    rule = batch[0]["lr_rule"]
    rule = rule if isinstance(rule, str) else {int(b): float(m) for b, m in rule.items()}
    return [(int(e["step"]), int(e["virtual_nodes"])) for e in batch], rule


def fewest_virtual_nodes(job: Any) -> tuple[int, int]:
    """``(V, first step)`` of the smallest V a job runs (its own, or a ``batch_schedule`` change's):
    the most workers it can have at any step, each needing a virtual node."""
    return min([(job.virtual_nodes, 0)] + [(v, s) for s, v in job.batch_schedule])


def check_recorded(state: Mapping[str, Any], changes: Sequence[Sequence[int]]) -> None:
    """A checkpoint's recorded changes (``state["batch_schedule"]``, the changes its steps ran) must
    be the job's ``changes`` before its step: the rest of the run reads on from where they left off."""
    step = state.get("step")
    expected = [tuple(c) for c in changes if isinstance(step, int) and c[0] < step]
    recorded = [tuple(c) for c in state.get("batch_schedule") or []]
    if recorded != expected:
        raise ValueError(f"the checkpoint (step {step}) ran batch_schedule={recorded}, the job's schedule up to that "
                         f"step is {expected}; resume with Job.batch_schedule starting {recorded} (a run's batch "
                         f"changes are part of its result)")


def _check_changes(changes: Sequence[Any]) -> None:
    previous = 0
    for change in changes:
        if (not isinstance(change, (tuple, list)) or len(change) != 2
                or any(isinstance(x, bool) or not isinstance(x, int) for x in change)):
            raise ValueError(f"Job.batch_schedule holds {change!r}; each change is a pair (first_step, virtual_nodes)"
                             f" of ints")
        step, v = change
        if step <= previous:
            raise ValueError(f"Job.batch_schedule change {tuple(change)} starts at step {step}, not after step "
                             f"{previous}; first steps must be >= 1 and strictly increasing (step 0 runs "
                             f"Job.virtual_nodes)")
        if v < 1:
            raise ValueError(f"Job.batch_schedule change {tuple(change)} has virtual_nodes={v}; a step needs at "
                             f"least one virtual node")
        previous = step


def _check_rule(rule: Any, batches: list[int]) -> None:
    if isinstance(rule, str):
        if rule not in LR_RULES:
            raise ValueError(f"Job.lr_rule={rule!r} must be 'linear', 'sqrt' or {{batch: multiplier}}")
        return
    if not isinstance(rule, Mapping):
        raise ValueError(f"Job.lr_rule={rule!r} must be 'linear', 'sqrt' or {{batch: multiplier}}")
    missing = [b for b in batches if b not in rule]
    if missing:
        raise ValueError(f"Job.lr_rule has no multiplier for batch sizes {missing} that Job.batch_schedule runs; "
                         f"a {{batch: multiplier}} rule names every batch (virtual_nodes x samples per virtual node)")
    bad = {k: v for k, v in rule.items()
           if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0}
    if bad:
        raise ValueError(f"Job.lr_rule multipliers {bad} must be positive finite numbers")


class FixedPositions:
    """Where each step's samples start in a run of one batch ``B`` over ``N`` samples."""

    def __init__(self, dataset_size: int, batch: int) -> None:
        self.n, self.b = dataset_size, batch

    def locate(self, step: int) -> tuple[int, int, int, int]:
        """``(epoch, first position, batch, steps from here on reading on contiguously at this batch)``."""
        per_epoch = self.n // self.b
        epoch, i = divmod(step, per_epoch)
        return epoch, i * self.b, self.b, per_epoch - i


class SchedulePositions:
    """The same for a :class:`BatchSchedule` (the module's data rule): each run of steps at one
    batch starts from where the previous one left off."""

    def __init__(self, dataset_size: int, schedule: BatchSchedule) -> None:
        self.n = dataset_size
        self.firsts = [s for s, _ in schedule.segments]
        self.batches = [b for _, b in schedule.segments]
        self.starts: list[tuple[int, int]] = [(0, 0)]
        """Per run of steps, the first free position (epoch, position) before its first step."""
        for k in range(1, len(self.firsts)):
            e, p, b, _ = self._within(k - 1, self.firsts[k] - 1)
            self.starts.append((e, p + b))

    def _within(self, k: int, step: int) -> tuple[int, int, int, int]:
        (e0, p0), s0, b = self.starts[k], self.firsts[k], self.batches[k]
        d, first = step - s0, (self.n - p0) // b  # ``first``: steps the rest of epoch e0 holds
        if d < first:
            return e0, p0 + d * b, b, first - d
        per_epoch = self.n // b
        epoch, i = divmod(d - first, per_epoch)
        return e0 + 1 + epoch, i * b, b, per_epoch - i

    def locate(self, step: int) -> tuple[int, int, int, int]:
        """As :meth:`FixedPositions.locate`; the contiguous run ends where the batch changes."""
        k = bisect.bisect_right(self.firsts, step) - 1
        e, p, b, run = self._within(k, step)
        if k + 1 < len(self.firsts):
            run = min(run, self.firsts[k + 1] - step)
        return e, p, b, run
