"""What a finished job returns (:class:`Result`) and how a failed one is reported
(:class:`TrainingError`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


class TrainingError(RuntimeError):
    """The job failed; the message names the worker, what happened and where the logs are."""

    fallback_restart: bool = False
    """A pipeline lost workers its redundant stages could not cover: :func:`virtualflow.train`
    (and ``virtualflow run``) restart it from its last checkpoint."""


@dataclass(slots=True)
class Result:
    state_dict: dict[str, torch.Tensor]
    """Final model weights (CPU tensors)."""
    optimizer_state_dict: dict[str, Any]
    lr_scheduler_state_dict: dict[str, Any] | None
    history: list[dict[str, Any]]
    """One record per step: step (0-based), loss, samples, step_time_s, workers, generation,
    vns (the VN ids each worker ran)."""
    metrics: dict[str, float]
    """The last evaluation's metrics (empty without ``Job.evaluate``)."""
    eval_history: list[dict[str, Any]] = field(default_factory=list)
    run_dir: str | None = None
    steps: int = 0
    """Steps completed."""
    stopped: bool = False
    """True when :meth:`JobHandle.stop` ended the job before ``steps``."""
    peak_rss_mib: dict[int, float] = field(default_factory=dict)
    """Peak resident memory of each worker process (worker id -> MiB)."""
    optimizer_bytes: dict[int, int] = field(default_factory=dict)
    """Bytes of optimizer state each worker held at the end (worker id -> bytes): the whole state
    with the default reduction, its chunk with ``reduction="sharded"`` (0 for pipelined jobs)."""
    replica_bytes: dict[int, int] = field(default_factory=dict)
    """``Pipeline(redundancy=True)``: bytes of each worker's replica of its successor's stage at
    the end (parameters, buffers, optimizer state; worker id -> bytes; 0 without redundancy)."""
    replica_refresh_s: dict[int, float] = field(default_factory=dict)
    """``Pipeline(redundancy=True)``: the redundant compute, seconds each worker spent taking its
    successor's steps on its replica (worker id -> seconds; since the worker's last re-layout)."""
    redundant_forwards: dict[int, dict[str, float]] = field(default_factory=dict)
    """``Pipeline(redundancy=True, redundant_compute="eager")``: per worker (id -> counts), its
    eager redundant forwards over the run: ``seconds`` spent in them, ``forwards`` run,
    ``skipped`` (no idle slot left for them in their step), ``reused`` (forwards a failover's
    redone step took from them instead of running the lost stage again), ``peak_bytes`` (the most
    memory one step's kept forwards held: the activations their graphs saved and their outputs)."""
    generations: int = 1
    """Membership generations the job went through (1: no resize, no failure)."""
    failures: list[dict[str, Any]] = field(default_factory=list)
    """Workers lost and survived: worker id, cause, generation."""
    autoscale: dict[str, Any] | None = None
    """With ``autoscale=``: the policy, its decisions, the measurement of every worker count
    tried and where it settled (None without autoscaling)."""
