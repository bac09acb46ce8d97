"""The in-process backend: every worker's engine in this process.

Purpose: the entry points that build a pipelined job's engines in this process
(:func:`build_engine`) and train it without processes (:func:`train_local`: driven cooperatively
by :class:`virtualflow.runtime.pipeline.local.LocalDriver`, or a thread per worker with
tensor-parallel stages) - the proof harness of the executor, profiling, notebooks - and any job on
any grid with a thread per worker, through generations (:func:`train_threads`,
:class:`Generation`: resizes, uneven VN maps, a member lost mid-step; the real worker engines over
real gloo groups, :mod:`virtualflow.runtime.grid_threads`), with the process-level diagnostics
read here, where the environment may be read, and handed to the runtime as arguments.

Invariants: the only reader of ``VIRTUALFLOW_EAGER_EVERY_WAIT`` (:func:`eager_every_wait_from_env`;
the worker process entry point should use it too); everything else is
:mod:`virtualflow.runtime.pipeline.local`'s, with ``eager_every_wait`` given explicitly.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from virtualflow.runtime.grid_threads import Generation, ThreadedRun, train_threads
from virtualflow.runtime.pipeline import local as in_process
from virtualflow.runtime.pipeline.engine import StageEngine
from virtualflow.runtime.pipeline.local import LocalDriver, PipelineDeadlock
from virtualflow.runtime.pipeline.requests import StepResult

__all__ = ["Generation", "LocalDriver", "PipelineDeadlock", "ThreadedRun", "build_engine", "eager_every_wait_from_env",
           "train_local", "train_threads"]

EAGER_EVERY_WAIT_ENV = "VIRTUALFLOW_EAGER_EVERY_WAIT"


def eager_every_wait_from_env() -> bool:
    """``VIRTUALFLOW_EAGER_EVERY_WAIT=1``: run Bamboo's eager redundant forwards at every wait,
    bubble or not, from the first step (a diagnostic; :attr:`StageEngine.eager_every_wait`)."""
    return os.environ.get(EAGER_EVERY_WAIT_ENV) == "1"


def build_engine(job: Any, pipeline: Any, bounds: Sequence[tuple[int, int]], stage_rank: int, *,
                 dataset: Any, deterministic: bool, device: torch.device,
                 eager_every_wait: bool | None = None, loader_workers: int = 0) -> StageEngine:
    """:func:`virtualflow.runtime.pipeline.local.build_engine`, ``eager_every_wait`` defaulting to
    :func:`eager_every_wait_from_env`."""
    if eager_every_wait is None:
        eager_every_wait = eager_every_wait_from_env()
    return in_process.build_engine(job, pipeline, bounds, stage_rank, dataset=dataset,
                                   deterministic=deterministic, device=device, eager_every_wait=eager_every_wait,
                                   loader_workers=loader_workers)


def train_local(job: Any, steps: int, *, replicas: int = 1, deterministic: bool = False,
                bounds: Sequence[tuple[int, int]] | None = None, device: torch.device = torch.device("cpu"),
                eager_every_wait: bool | None = None, reduction: str = "allreduce",
                engines_out: list[Any] | None = None,
                loader_workers: int = 0) -> tuple[dict[str, torch.Tensor], list[StepResult]]:
    """:func:`virtualflow.runtime.pipeline.local.train_local`, ``eager_every_wait`` defaulting to
    :func:`eager_every_wait_from_env`."""
    if eager_every_wait is None:
        eager_every_wait = eager_every_wait_from_env()
    return in_process.train_local(job, steps, replicas=replicas, deterministic=deterministic, bounds=bounds,
                                  device=device, eager_every_wait=eager_every_wait, reduction=reduction,
                                  engines_out=engines_out, loader_workers=loader_workers)
