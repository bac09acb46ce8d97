"""Which engine a worker runs: the one place that looks at the job's kind.

Purpose: :func:`build_engine` builds the worker's :class:`~virtualflow.runtime.engines.Engine`
from the job - the pipeline worker engine when the job has a ``Pipeline``, else the VN engine
(with ``cfg.reduction``). The worker loop (:mod:`virtualflow.runtime.worker`) only calls it and
then talks to the protocol, so it never names an engine's kind.

Invariant: every engine leaves here with its emulated ``slowdown`` set from the configuration.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from virtualflow.comm.groups import Group, make_subgroup
from virtualflow.config.job import Job
from virtualflow.runtime.engines import Engine
from virtualflow.runtime.streaming import data_plan_of
from virtualflow.runtime.vn_worker import VNWorkerEngine
from virtualflow.runtime.worker_config import WorkerConfig

__all__ = ["build_engine"]


def build_engine(cfg: WorkerConfig, worker_id: int, job: Job, dataset: Any, store: dist.Store,
                 device: torch.device, *, eager_every_wait: bool = False) -> Engine:
    """The engine of ``job`` on this worker: pipelined when the job has a ``Pipeline``, else the
    VN engine (with ``cfg.reduction``). The one place that looks at the job's kind.
    ``eager_every_wait``: a pipeline diagnostic (:attr:`StageEngine.eager_every_wait`), read by
    the process's entry point."""
    plan = data_plan_of(dataset, job)  # checks the sizes
    if job.pipeline is not None:
        from virtualflow.runtime.pipeline.worker_engine import PipelineWorkerEngine

        def subgroup(generation: int, name: str, rank: int, size: int, *, duplex: bool = False) -> Group:
            # ``duplex``: a connection per direction, for groups that carry pipeline hops
            return make_subgroup(store, generation, name, rank, size, cfg.collective_timeout_s, device,
                                 bind=cfg.gloo_bind(), duplex=duplex)

        stages = PipelineWorkerEngine(job, dataset, deterministic=cfg.deterministic, device=device,
                                      subgroup=subgroup, eager_every_wait=eager_every_wait,
                                      deterministic_exchange=cfg.deterministic_exchange, reduction=cfg.reduction,
                                      breakdown=cfg.breakdown)
        stages.total_steps = cfg.total_steps
        stages.timeline_dir = os.path.join(cfg.state_dir, "pipeline")
        engine: Engine = stages
    else:
        engine = VNWorkerEngine.build(job, dataset, plan, cfg, device)
    engine.slowdown = float(cfg.slowdowns.get(worker_id, 1.0))
    return engine
