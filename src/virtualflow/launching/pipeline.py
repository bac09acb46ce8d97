"""Launch-time planning of a pipelined job: check it against its model and workers, profile it,
resolve ``split="auto"`` and log the predicted time per piece.

Runs in the launching process before any worker starts (called by
:mod:`virtualflow.launching.prepare`). It builds the job's model and measures it
(:mod:`virtualflow.runtime.profile`), so it lives above the runtime; the config it reads
(:class:`~virtualflow.config.pipeline.Pipeline`), the geometry, the schedule factory and the
predictions are below it and import nothing from here.

Invariant: the pipeline returned has explicit layer counts, the split every worker builds.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch
from torch import nn

from virtualflow.config.composition import check
from virtualflow.config.job import Job
from virtualflow.config.pipeline import Pipeline
from virtualflow.launching.composition import check_shared_parameters
from virtualflow.plan.pipeline.geometry import Grid, check_workers, describe_split, layers_of, resolve_bounds
from virtualflow.plan.pipeline.predict import predict
from virtualflow.plan.pipeline.schedules import schedule_of
from virtualflow.plan.vnmap import contiguous_assignment
from virtualflow.runtime.pipeline.loop import check_checkpoint_spec
from virtualflow.runtime.profile import auto_split, profile_model

__all__ = ["check_tensor_parallel", "plan_pipeline"]


def check_tensor_parallel(pipeline: Pipeline, layers: list[nn.Module]) -> None:
    """Check, before any worker starts, that tensor-parallel stages (``Pipeline.tensor > 1``) have
    something to split: some layer has a block virtualflow can convert, and every block splits
    ``tensor`` ways (heads and widths divisible)."""
    t = pipeline.tensor
    if t == 1:
        return
    from virtualflow.parallel.convert import tensor_parallel_candidates, tensor_splits

    if not any(tensor_parallel_candidates(layers)):
        raise ValueError(
            f"Pipeline.tensor={t} (--tensor-parallel) splits transformer blocks over {t} workers, but no layer of "
            f"this model has a block virtualflow knows how to split (virtualflow.parallel.tensor_parallel_layer: "
            f"nanoGPT's and Hugging Face GPT-2's blocks, virtualflow's MLPBlock/AttentionBlock, or a class given "
            f"to register_tensor_parallel): use tensor=1 or register the block")
    for layer in layers:
        tensor_splits(layer, t)  # raises naming the block when its heads or widths do not divide


def plan_pipeline(job: Job, dataset: Any, workers: int, log: Any = None, device: str = "cpu",
                  deterministic: bool = False, cpu_count: int | None = None) -> Pipeline:
    """Check a pipelined job against its model and worker count, resolve ``split="auto"`` with the
    profiler (on ``device``, the workers' kind of device), and return the pipeline with explicit
    layer counts (what every worker uses). ``cpu_count`` (default ``os.cpu_count()``) sets the
    profile's thread budget, a local worker's share of the cores.
    Raises ``ValueError`` naming the value, the rule and the knob when something does not fit."""
    log = log or logging.getLogger(__name__)
    if cpu_count is None:
        cpu_count = os.cpu_count()
    pipeline: Pipeline = job.pipeline
    replicas = check_workers(pipeline, workers)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(job.seed)
        model = job.model()
    layers = layers_of(model)
    check_tensor_parallel(pipeline, layers)
    # The training loop's knobs, refused here (before any worker starts) where the schedule or
    # the model cannot honour them; each worker checks them again when it builds its stage.
    check("no_flush+loop", flush=pipeline.flush, schedule=pipeline.schedule, precision=job.precision,
          max_grad_norm=job.max_grad_norm, activation_checkpointing=job.activation_checkpointing)
    check_checkpoint_spec(layers, job.activation_checkpointing)
    check("no_flush+batchnorm", flush=pipeline.flush, schedule=pipeline.schedule,
          batchnorm=any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()))
    sizes = sorted({len(b) for b in contiguous_assignment(job.virtual_nodes, replicas)})
    for m in sizes:
        schedule_of(pipeline, m)  # raises with the schedule's own rule and knob
    # The profile costs a few ms for a small model (about 0.75 s more on first use in a process):
    # worth it for the split and the predicted time per stage printed before the run.
    if pipeline.split != "auto":
        check_shared_parameters(layers, resolve_bounds(pipeline, len(layers)), pipeline, deterministic)
    threads = max(1, (cpu_count or 1) // workers)  # a local worker's thread budget
    profile = profile_model(job, weight_grad=pipeline.schedule == "zb_h1", threads=threads, device=device)
    if pipeline.split == "auto":
        counts, _ = auto_split(job, pipeline, workers=workers, profiles=profile)
        pipeline = dataclasses.replace(pipeline, split=tuple(counts))
    bounds = resolve_bounds(pipeline, len(layers))
    check_shared_parameters(layers, bounds, pipeline, deterministic)
    pipeline = dataclasses.replace(pipeline, split=tuple(b - a for a, b in bounds))
    grid = Grid(pipeline.stages, replicas, 0)
    shape = grid.describe() if pipeline.tensor == 1 else (
        f"{workers} workers = {replicas} replica{'s' if replicas != 1 else ''} x {pipeline.stages} stages x "
        f"{pipeline.tensor} tensor-parallel workers per stage")
    log.info("pipeline: %s, schedule %s, %d micro-batches (virtual nodes) per replica; split:\n%s",
             shape, pipeline.schedule, sizes[-1], describe_split(layers, bounds, pipeline.stages, replicas=replicas,
                                                                tensor=pipeline.tensor))
    try:
        pred = predict(job, pipeline, pipeline.split, profile, workers=workers)
        stage_ms = ", ".join(f"{1e3 * t:.2f}" for t in pred["piece_time_s"])
        log.info("pipeline prediction (profiled on this machine): time per piece per micro-batch [%s] ms; step %.1f ms; "
                 "bubble %.0f%%", stage_ms, 1e3 * pred["step_time_s"], 100 * pred["bubble"])
    except Exception as exc:  # noqa: BLE001 - the prediction is information, never a reason to refuse a run
        log.info("pipeline prediction unavailable: %s", exc)
    return pipeline
