"""Pipeline parallelism, planning side. Pure code, no processes.

- ``schedules``: GPipe, 1F1B, interleaved 1F1B, zero-bubble H1, PipeDream-2BW and asynchronous
  PipeDream as per-rank action lists (a ``Schedule`` of ``Action``s). The job's virtual nodes on
  one pipeline replica are the schedule's micro-batches.
- ``check``: the validity checker (order, matching send/recv, no deadlock, stash and
  weight-version bounds); raises ``ScheduleError`` naming the rank, action index and rule.
- ``simulate``: an event simulation giving per-action times, step time, bubble and peak stash.
- ``schedules.SCHEDULES`` is THE schedule table and ``schedules.build_schedule`` /
  ``schedules.schedule_of`` THE schedule factory; every list of schedule names derives from it.
- ``geometry``: how a model is cut into pieces (bounds, piece modules, tied weights) and the
  worker grid; ``partition``: the PipeDream partitioner; ``predict``: predictions and the auto
  split from a measured layer profile (the measuring is :mod:`virtualflow.runtime.profile`).
"""

from __future__ import annotations

from virtualflow.plan.pipeline.check import CheckResult, ScheduleError, check
from virtualflow.plan.pipeline.schedules import FLUSH_SCHEDULES, SCHEDULE_NAMES, SCHEDULES, Action, Schedule
from virtualflow.plan.pipeline.schedules import build_schedule, schedule_of
from virtualflow.plan.pipeline.schedules import gpipe, interleaved_1f1b, one_f_one_b, zero_bubble_h1
from virtualflow.plan.pipeline.schedules import pipedream_2bw, pipedream_async
from virtualflow.plan.pipeline.simulate import SimResult, Slot, simulate
from virtualflow.plan.pipeline.partition import (
    InfeasiblePartition, LayerProfile, Link, Partition, equal_layer_split, evaluate_split, partition,
)

__all__ = [
    "Action", "Schedule", "SCHEDULES", "SCHEDULE_NAMES", "FLUSH_SCHEDULES", "build_schedule", "schedule_of", "gpipe", "one_f_one_b", "interleaved_1f1b", "zero_bubble_h1", "pipedream_2bw",
    "pipedream_async", "check", "CheckResult", "ScheduleError", "simulate", "SimResult", "Slot", "partition",
    "Partition", "LayerProfile", "Link", "InfeasiblePartition", "equal_layer_split", "evaluate_split",
]
