"""Which engine a worker runs: the one place that looks at the job's kind.

Purpose: :func:`build_engine` builds the worker's :class:`~virtualflow.runtime.engines.Engine`
from the job - the pipeline worker engine when the job has a ``Pipeline``, else the VN engine -
and hands each the job's worker knobs whole (``cfg.options``, a
:class:`~virtualflow.config.worker_options.WorkerOptions`). The worker loop
(:mod:`virtualflow.runtime.worker`) only calls it and then talks to the protocol, so it never
names an engine's kind or a layout.

Invariants: every engine leaves here with its emulated ``slowdown`` set from the configuration
and with :attr:`~virtualflow.runtime.engines.Engine.generation_hops_duplex` set from the job's
layout (the worker builds each generation's group with it).
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
    VN engine; both read the worker knobs from ``cfg.options``. The one place that looks at the
    job's kind. ``eager_every_wait``: a pipeline diagnostic (:attr:`StageEngine.eager_every_wait`),
    read by the process's entry point."""
    plan = data_plan_of(dataset, job)  # checks the sizes
    if job.pipeline is not None:
        from virtualflow.runtime.pipeline.worker_engine import PipelineWorkerEngine

        def subgroup(generation: int, name: str, rank: int, size: int, *, duplex: bool = False) -> Group:
            # ``duplex``: a connection per direction, for groups that carry pipeline hops
            return make_subgroup(store, generation, name, rank, size, cfg.options.collective_timeout_s, device,
                                 bind=cfg.gloo_bind(), duplex=duplex)

        stages = PipelineWorkerEngine(job, dataset, cfg.options, device=device, subgroup=subgroup,
                                      eager_every_wait=eager_every_wait)
        stages.total_steps = cfg.total_steps
        stages.timeline_dir = os.path.join(cfg.state_dir, "pipeline")
        # Without tensor parallelism a pipeline's hops travel on the generation's group itself
        # (with it, on the grid's planes): a connection per direction (see make_group's duplex).
        stages.generation_hops_duplex = job.pipeline.tensor == 1
        engine: Engine = stages
    else:
        engine = VNWorkerEngine.build(job, dataset, plan, cfg, device)
        engine.generation_hops_duplex = False
    engine.slowdown = float(cfg.slowdowns.get(worker_id, 1.0))
    return engine
