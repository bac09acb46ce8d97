"""The bounds and the time model the autoscaler searches a pipelined job's sizes with.

A pipelined job of P stages, each run by T tensor-parallel workers, runs whole replicas of
P x T workers: the autoscaler chooses D, the number of replicas, and a size is D x P x T workers
(:attr:`~virtualflow.control.autoscale.base.Limits.unit`). Adding a replica does not shorten the
step in proportion: the job's V virtual nodes are the replicas' micro-batches, the slowest replica
(the one with the most micro-batches) sets the pace, and every replica pays its schedule's fill
and drain whatever its share. :func:`replica_step` predicts the step of D replicas with the
replica time model of :mod:`virtualflow.plan.replica_shares` (per replica ``fixed + m x per_mb``,
its micro-batch counts split by the same solver the controller maps VNs with), in units of one
stage's time per micro-batch (equal stages: only ratios between sizes are read, so that unit
cancels). It leaves out the gradient reduction between replicas, which grows with D, so the gain
it predicts for an addition is an upper bound on the measured one.

Invariant: pure (no processes, no clock); :func:`replica_step` is the one place the autoscaler
reads the replica time model.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from virtualflow.control.autoscale.base import Limits, StepModel
from virtualflow.plan.replica_shares import ReplicaTime, microbatch_rule, replica_time, solve_shares

__all__ = ["pipeline_limits", "pipeline_step_model", "replica_step"]


def replica_step(replicas: int, *, virtual_nodes: int, stages: int, tensor: int = 1, schedule: str = "1f1b",
                 chunks: int = 1, flush: bool = True) -> float:
    """The predicted step of ``replicas`` pipeline replicas sharing ``virtual_nodes`` micro-batches,
    in units of one stage's time per micro-batch (``math.inf`` when they cannot share them under
    the schedule's rule). Each of the ``stages`` stages is run by ``tensor`` workers together, all
    equally fast, so every replica has the same time model; a no-flush schedule streams steps
    without a drain and pays no fill per step."""
    if tensor < 1:
        raise ValueError(f"tensor={tensor} must be at least 1")
    one = replica_time([1.0] * stages, chunks) if flush else ReplicaTime(0.0, 1.0)
    minimum, multiple = microbatch_rule(schedule, stages, chunks)
    try:
        plan = solve_shares(virtual_nodes, [one] * replicas, minimum=minimum, multiple=multiple)
    except ValueError:
        return math.inf
    return plan.predicted_step_s


def pipeline_step_model(pipeline: Any, virtual_nodes: int) -> StepModel:
    """Worker count (a multiple of ``stages x tensor``) -> :func:`replica_step` of that many
    replicas of ``pipeline`` (a resolved :class:`~virtualflow.config.pipeline.Pipeline`)."""
    unit = pipeline.stages * pipeline.tensor

    @functools.lru_cache(maxsize=None)  # a policy reads it at every step: solve each size once
    def step(workers: int) -> float:
        return replica_step(workers // unit, virtual_nodes=virtual_nodes, stages=pipeline.stages,
                            tensor=pipeline.tensor, schedule=pipeline.schedule, chunks=pipeline.chunks,
                            flush=pipeline.flush)
    return step


def pipeline_limits(limits: Limits, pipeline: Any, virtual_nodes: int) -> Limits:
    """``limits`` for a pipelined job: whole replicas of ``stages x tensor`` workers, searched with
    the replica time model (unchanged for an unpipelined job, ``pipeline`` None)."""
    if pipeline is None:
        return limits
    return Limits(limits.min_workers, limits.max_workers, unit=pipeline.stages * pipeline.tensor,
                  step_model=pipeline_step_model(pipeline, virtual_nodes))
