"""The pipeline description of a job, and how a model is cut into stages.

A job opts into pipeline parallelism with ``Job(..., pipeline=Pipeline(stages=4))``. The model is
then a chain of *layers*: the children of the ``nn.Sequential`` that ``Job.model`` returns (a
model that is not a ``Sequential`` is first turned into one by a tracer, see
:func:`virtualflow.tracing.sequential_from`). Layer ``k`` takes the output of layer ``k-1`` (one
tensor, or a tuple of tensors) and the first layer takes ``Job.model_input(batch)``; the last
layer's output goes to ``Job.output_loss(outputs, batch)``. So the same job without its pipeline
computes ``output_loss(model(model_input(batch)), batch)``, and a pipelined run trains the same
model (see ``docs/pipeline.md`` for the exact semantics of each schedule).

A pipeline replica has ``stages`` workers; with ``chunks = v > 1`` (the interleaved schedule) the
model is cut into ``stages * v`` pieces and worker ``r`` holds pieces ``r, r + p, r + 2p, ...``.
A run with ``W`` workers has ``d = W / stages`` pipeline replicas; worker rank ``r`` of a
generation is stage-rank ``r % p`` of replica ``r // p``.

Stage modules keep the parameter names of the whole model (a stage is an ``nn.Sequential`` whose
children are named by their index in the whole model), so the union of the stages' state dicts
is the whole model's state dict.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence, Union

import torch
from torch import nn

from virtualflow.plan.pipeline.partition import equal_layer_split

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "2bw", "async")
FLUSH_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")
SplitSpec = Union[str, Sequence[int]]


@dataclass(kw_only=True, slots=True, frozen=True)
class Pipeline:
    """How a job's model is cut into stages and which schedule streams micro-batches through them.

    The job's virtual nodes are the micro-batches: each pipeline replica runs its VNs (as the VN
    engine hands them out over replicas) as the schedule's ``m`` micro-batches.
    """

    stages: int
    """p: workers per pipeline replica. The run's worker count must be a multiple of it."""
    schedule: str = "1f1b"
    """``gpipe``, ``1f1b`` (PipeDream-Flush), ``interleaved_1f1b`` (Megatron, ``chunks`` model
    pieces per worker), ``zb_h1`` (zero bubble: backward split into input and weight gradient),
    ``2bw`` (PipeDream-2BW: no flush, 2 weight versions) or ``async`` (PipeDream: no flush, weight
    stashing)."""
    chunks: int = 1
    """v: model pieces per worker (``interleaved_1f1b`` only); the model is cut into
    ``stages * chunks`` pieces."""
    split: SplitSpec = "equal"
    """Where to cut: ``"equal"`` (equal layer counts), ``"auto"`` (profile each layer on this
    machine and let the PipeDream partitioner minimise the slowest stage under
    ``memory_limit_gib``), or explicit layer counts per piece (``stages * chunks`` positive
    integers summing to the layer count)."""
    memory_limit_gib: float | None = None
    """Per-worker memory limit the ``"auto"`` split must respect (weights, gradients, optimizer
    state and stashed activations); ``None``: no limit."""
    window: int = 4
    """``2bw`` / ``async`` only: steps streamed back to back without a flush; the pipeline drains
    every ``window`` steps (where checkpoints, resizes and evaluation happen)."""
    record_timeline: bool = False
    """Record each action's start and end on every worker (``pipeline_timeline.jsonl`` in the
    run directory, drawn by ``virtualflow plot RUN_DIR --pipeline``)."""
    redundancy: bool = False
    """Bamboo: every worker also keeps a replica of its successor's stage (stage ``(s+1) mod p``
    of its pipeline replica): parameters, buffers, optimizer and scheduler state, brought up to
    date after every step from the successor's reduced gradients (flush schedules only)."""
    redundant_compute: str = "eager"
    """With ``redundancy``: ``"eager"`` (default) - each worker also runs its successor stage's
    forward on its replica for every micro-batch it sent, in the schedule's idle slots (while it
    waits for a message), and keeps those forwards until the step commits, so that a failover's
    redone step takes the lost stage's forwards from them instead of recomputing them;
    ``"lazy"`` - no redundant forward: a failover recomputes the lost stage's forwards in the
    redone step. Eager forwards apply to ``1f1b`` and ``gpipe`` with ``chunks=1`` (the schedules a
    failover re-lays); elsewhere the mode is lazy."""

    def __post_init__(self) -> None:
        _positive("stages", self.stages)
        _positive("chunks", self.chunks)
        _positive("window", self.window)
        if self.schedule not in SCHEDULE_NAMES:
            raise ValueError(f"Pipeline.schedule={self.schedule!r} is not one of {SCHEDULE_NAMES}")
        if self.chunks > 1 and self.schedule != "interleaved_1f1b":
            raise ValueError(
                f"Pipeline.chunks={self.chunks} needs schedule='interleaved_1f1b' (got {self.schedule!r}); "
                f"use chunks=1 or the interleaved schedule"
            )
        if isinstance(self.split, str):
            if self.split not in ("equal", "auto"):
                raise ValueError(f"Pipeline.split={self.split!r} must be 'equal', 'auto' or a list of layer counts")
        else:
            counts = list(self.split)
            if len(counts) != self.pieces or any(not isinstance(c, int) or isinstance(c, bool) or c < 1
                                                 for c in counts):
                raise ValueError(
                    f"Pipeline.split={counts!r} must be {self.pieces} positive layer counts (stages x chunks = "
                    f"{self.stages} x {self.chunks}); every piece needs at least one layer"
                )
            object.__setattr__(self, "split", tuple(counts))
        if self.redundancy and (self.stages < 2 or self.schedule not in FLUSH_SCHEDULES):
            raise ValueError(
                f"Pipeline.redundancy=True keeps a replica of each worker's successor stage, refreshed at every "
                f"step's flush: it needs stages >= 2 (got {self.stages}) and a flush schedule "
                f"{FLUSH_SCHEDULES} (got {self.schedule!r})")
        if self.redundant_compute not in ("eager", "lazy"):
            raise ValueError(f"Pipeline.redundant_compute={self.redundant_compute!r} must be 'eager' (redundant "
                             f"forwards in idle slots, the default) or 'lazy' (recompute on a failover)")
        if self.memory_limit_gib is not None and not (self.memory_limit_gib > 0):
            raise ValueError(f"Pipeline.memory_limit_gib={self.memory_limit_gib!r} must be positive or None")

    @property
    def pieces(self) -> int:
        """Model pieces: ``stages * chunks``."""
        return self.stages * self.chunks

    @property
    def flush(self) -> bool:
        return self.schedule in FLUSH_SCHEDULES

    @property
    def eager_forwards(self) -> bool:
        """Whether workers run their successor's forwards on their replicas (``redundant_compute``)."""
        return (bool(self.redundancy) and self.redundant_compute == "eager" and self.chunks == 1
                and self.schedule in ("1f1b", "gpipe"))


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"Pipeline.{name}={value!r} must be a positive int")


def layers_of(model: nn.Module) -> list[nn.Module]:
    """The layers a pipelined model is cut between: the children of its ``nn.Sequential``."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(
            f"a pipelined job's model must be an nn.Sequential (its children are the layers cut into "
            f"stages); got {type(model).__name__}. Wrap a model of another kind with "
            f"virtualflow.tracing.sequential_from(model, example_input, split_points=[...])"
        )
    return list(model.children())


def bounds_from_counts(counts: Sequence[int]) -> tuple[tuple[int, int], ...]:
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return tuple(out)


def resolve_bounds(pipeline: Pipeline, n_layers: int) -> tuple[tuple[int, int], ...]:
    """Layer ranges ``[a, b)`` of the ``stages * chunks`` pieces for an explicit or equal split.
    (``"auto"`` is resolved by the launcher's profiler into explicit counts first.)"""
    pieces = pipeline.pieces
    if n_layers < pieces:
        raise ValueError(
            f"the model has {n_layers} layers but the pipeline needs {pieces} non-empty pieces "
            f"(stages={pipeline.stages} x chunks={pipeline.chunks}); use at most {n_layers} stages x chunks, "
            f"or cut the model into more layers"
        )
    if isinstance(pipeline.split, str):
        if pipeline.split == "auto":
            raise ValueError("Pipeline.split='auto' must be resolved by the profiler before stages are built")
        return tuple(equal_layer_split(n_layers, pieces))
    counts = list(pipeline.split)
    if sum(counts) != n_layers:
        raise ValueError(
            f"Pipeline.split={counts} covers {sum(counts)} layers but the model has {n_layers}; "
            f"give {pieces} counts that sum to {n_layers}"
        )
    return bounds_from_counts(counts)


def piece_module(layers: Sequence[nn.Module], lo: int, hi: int) -> nn.Sequential:
    """Layers ``[lo, hi)`` as an ``nn.Sequential`` whose children keep their whole-model names."""
    return nn.Sequential(OrderedDict((str(i), layers[i]) for i in range(lo, hi)))


def successor_pieces(pipeline: Pipeline, layers: Sequence[nn.Module], bounds: Sequence[tuple[int, int]],
                     stage_rank: int) -> dict[int, nn.Sequential] | None:
    """``Pipeline.redundancy``: the pieces of the successor stage ``(stage_rank + 1) mod p`` that a
    worker keeps a replica of (cut from the whole model it built, so they start equal to the
    successor's own); ``None`` without redundancy."""
    if not pipeline.redundancy:
        return None
    succ = (stage_rank + 1) % pipeline.stages
    return {k: piece_module(layers, a, b) for k, (a, b) in enumerate(bounds) if k % pipeline.stages == succ}


@dataclass(slots=True)
class Grid:
    """Where a worker sits: ``replica`` of ``replicas``, ``stage_rank`` of ``stages``.

    Ranks run replica after replica. After a Bamboo failover the replicas may differ in depth
    (a failed-over replica has one worker fewer): ``sizes`` then gives each replica's worker
    count, and ``stage_rank`` is the worker's position in its replica."""

    stages: int
    replicas: int
    rank: int
    sizes: tuple[int, ...] | None = None
    """Workers per replica where they differ (``None``: ``stages`` each)."""
    stage_rank: int = field(init=False)
    replica: int = field(init=False)

    def __post_init__(self) -> None:
        if self.sizes is None:
            self.stage_rank = self.rank % self.stages
            self.replica = self.rank // self.stages
            return
        if len(self.sizes) != self.replicas or not 0 <= self.rank < sum(self.sizes):
            raise ValueError(f"rank {self.rank} is not in {self.replicas} replicas of sizes {list(self.sizes)}")
        offset = 0
        for j, n in enumerate(self.sizes):
            if self.rank < offset + n:
                self.replica, self.stage_rank = j, self.rank - offset
                break
            offset += n

    def rank_of(self, replica: int, stage_rank: int) -> int:
        if self.sizes is None:
            return replica * self.stages + stage_rank
        return sum(self.sizes[:replica]) + stage_rank

    def describe(self) -> str:
        if self.sizes is not None:
            return (f"{sum(self.sizes)} workers in {self.replicas} pipeline replicas of "
                    f"{', '.join(map(str, self.sizes))} workers")
        return (f"{self.stages * self.replicas} workers = {self.stages} stages x {self.replicas} "
                f"pipeline replica{'s' if self.replicas != 1 else ''}")


def check_workers(pipeline: Pipeline, workers: int) -> int:
    """Pipeline replicas for ``workers``; a clear error when it is not a multiple of the stages."""
    if workers % pipeline.stages:
        lo = (workers // pipeline.stages) * pipeline.stages
        hint = f"{lo} or {lo + pipeline.stages}" if lo else str(pipeline.stages)
        raise ValueError(
            f"workers={workers} is not a multiple of Pipeline.stages={pipeline.stages}; a pipelined job runs "
            f"whole pipelines (workers = stages x replicas): use workers={hint}"
        )
    return workers // pipeline.stages


def describe_split(layers: Sequence[nn.Module], bounds: Sequence[tuple[int, int]], stages: int) -> str:
    lines = []
    for k, (a, b) in enumerate(bounds):
        names = ", ".join(type(layers[i]).__name__ for i in range(a, min(b, a + 3))) + (", ..." if b - a > 3 else "")
        params = sum(p.numel() for i in range(a, b) for p in layers[i].parameters())
        lines.append(f"  piece {k} (worker {k % stages}): layers {a}-{b - 1} [{names}], {params:,} parameters")
    return "\n".join(lines)


def tensors_of(value: object) -> tuple[torch.Tensor, ...]:
    """The tensors a layer boundary carries: one tensor, or a tuple/list of tensors."""
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(value)
    raise TypeError(
        f"a pipeline stage boundary must carry a tensor or a tuple of tensors, got {type(value).__name__}; "
        f"make each layer return tensors (and take the previous layer's output as its one argument)"
    )


# ---- launch-time resolution (called by virtualflow.launch before any worker starts) ------------
def parse_split(text: str) -> SplitSpec:
    """``auto``, ``equal`` or comma-separated layer counts (``3,2,2,1``)."""
    if text in ("auto", "equal"):
        return text
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--split {text!r} must be auto, equal or comma-separated layer counts such as 3,2,2,1") from None


def pipeline_of(job: Any, options: Any) -> Pipeline | None:
    """The job's pipeline with the launch options' pipeline knobs applied (``None``: no pipeline)."""
    import dataclasses

    knobs = {"schedule": options.schedule, "chunks": options.chunks,
             "split": parse_split(options.split) if options.split is not None else None}
    given = {k: v for k, v in knobs.items() if v is not None}
    base = job.pipeline
    if options.pipeline_stages is None and base is None:
        if given:
            flags = ", ".join(f"--{k}" for k in given)
            raise ValueError(f"{flags} apply to pipelined jobs only; add --pipeline-stages P (pipeline_stages=P) or "
                             f"give the job a Job.pipeline")
        return None
    if options.pipeline_stages is not None:
        given["stages"] = options.pipeline_stages
    if "stages" in given and "split" not in given and base is not None and not isinstance(base.split, str):
        given["split"] = "equal"  # explicit counts were for another stage count
    pipeline = dataclasses.replace(base, **given) if base is not None else Pipeline(**given)
    if job.output_loss is None:
        raise ValueError(
            "a pipelined job needs Job.output_loss=(outputs, batch) -> scalar: the loss is computed on the last "
            "stage, which holds only the model's outputs and the batch"
        )
    return pipeline


def plan_pipeline(job: Any, dataset: Any, workers: int, log: Any = None, device: str = "cpu",
                  deterministic: bool = False) -> Pipeline:
    """Check a pipelined job against its model and worker count, resolve ``split="auto"`` with the
    profiler (on ``device``, the workers' kind of device), and return the pipeline with explicit
    layer counts (what every worker uses).
    Raises ``ValueError`` naming the value, the rule and the knob when something does not fit."""
    import dataclasses
    import logging

    from virtualflow.plan.vnmap import contiguous_assignment
    from virtualflow.runtime.pipeline import schedule_for

    log = log or logging.getLogger(__name__)
    pipeline: Pipeline = job.pipeline
    replicas = check_workers(pipeline, workers)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(job.seed)
        model = job.model()
    layers = layers_of(model)
    if not pipeline.flush and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        raise ValueError(
            f"Pipeline.schedule={pipeline.schedule!r} streams steps without a flush, which cannot keep BatchNorm's "
            f"per-step statistics exact; use a flush schedule (1f1b, gpipe, interleaved_1f1b, zb_h1)"
        )
    sizes = sorted({len(b) for b in contiguous_assignment(job.virtual_nodes, replicas)})
    for m in sizes:
        schedule_for(pipeline, m, pipeline.window)  # raises with the schedule's own rule and knob
    from virtualflow.runtime.profile import auto_split, predict, profile_model

    # The profile costs a few ms for a small model (about 0.75 s more on first use in a process):
    # worth it for the split and the predicted time per stage printed before the run.
    import os

    if pipeline.split != "auto":
        check_shared_parameters(layers, resolve_bounds(pipeline, len(layers)), pipeline, deterministic)
    threads = max(1, (os.cpu_count() or 1) // workers)  # a local worker's thread budget
    profile = profile_model(job, weight_grad=pipeline.schedule == "zb_h1", threads=threads, device=device)
    if pipeline.split == "auto":
        counts, _ = auto_split(job, pipeline, workers=workers, profiles=profile)
        pipeline = dataclasses.replace(pipeline, split=tuple(counts))
    bounds = resolve_bounds(pipeline, len(layers))
    check_shared_parameters(layers, bounds, pipeline, deterministic)
    pipeline = dataclasses.replace(pipeline, split=tuple(b - a for a, b in bounds))
    grid = Grid(pipeline.stages, replicas, 0)
    log.info("pipeline: %s, schedule %s, %d micro-batches (virtual nodes) per replica; split:\n%s",
             grid.describe(), pipeline.schedule, sizes[-1], describe_split(layers, bounds, pipeline.stages))
    try:
        pred = predict(job, pipeline, pipeline.split, profile, workers=workers)
        stage_ms = ", ".join(f"{1e3 * t:.2f}" for t in pred["piece_time_s"])
        log.info("pipeline prediction (profiled on this machine): time per piece per micro-batch [%s] ms; step %.1f ms; "
                 "bubble %.0f%%", stage_ms, 1e3 * pred["step_time_s"], 100 * pred["bubble"])
    except Exception as exc:  # noqa: BLE001 - the prediction is information, never a reason to refuse a run
        log.info("pipeline prediction unavailable: %s", exc)
    return pipeline


def tied_parameters(layers: Sequence[nn.Module], bounds: Sequence[tuple[int, int]],
                    stages: int) -> list[list[tuple[int, str]]]:
    """Parameters shared by layers on different workers (a tied embedding and output matrix,
    say): for each, its ``(layer index, name in that layer)`` locations, in model order."""
    def worker_of(layer: int) -> int:
        return next(k for k, (a, b) in enumerate(bounds) if a <= layer < b) % stages

    where: dict[int, list[tuple[int, str]]] = {}
    for i, layer in enumerate(layers):
        for name, param in layer.named_parameters():
            where.setdefault(id(param), []).append((i, name))
    return [locs for locs in where.values() if len({worker_of(i) for i, _ in locs}) > 1]


def check_shared_parameters(layers: Sequence[nn.Module], bounds: Sequence[tuple[int, int]],
                            pipeline: Pipeline, deterministic: bool = False) -> list[list[tuple[int, str]]]:
    """A weight shared by layers on different workers is held by each of them as a copy; the
    runtime sums the copies' gradients before every update (default mode, flush schedules), so
    they stay equal. Deterministic mode and the no-flush schedules refuse it: the exact per-VN
    order of that sum, and a version per copy, are not implemented."""
    groups = tied_parameters(layers, bounds, pipeline.stages)
    if groups and (deterministic or not pipeline.flush):
        (j, first), (i, name) = groups[0][0], groups[0][1]
        why = "deterministic mode" if deterministic else f"the {pipeline.schedule} schedule"
        raise ValueError(
            f"parameter {j}.{first} is also layer {i}'s {name}, on another pipeline worker: {why} cannot keep the "
            f"copies of a shared weight exact; untie it (e.g. GPT2Config(tie_word_embeddings=False)), cut the "
            f"model so both layers are on one worker (Pipeline.split), or train in default mode with a flush "
            f"schedule"
        )
    return groups


def tied_for_worker(layers: Sequence[nn.Module], bounds: Sequence[tuple[int, int]], stages: int,
                    stage_rank: int) -> list[tuple[Any, int, torch.dtype]]:
    """For each weight shared across workers (same order everywhere): this worker's copy, or
    None if its pieces do not hold it; its size; its dtype."""
    out = []
    for locs in tied_parameters(layers, bounds, stages):
        i0, n0 = locs[0]
        param0 = layers[i0].get_parameter(n0)
        mine = None
        for i, name in locs:
            if next(k for k, (a, b) in enumerate(bounds) if a <= i < b) % stages == stage_rank:
                mine = layers[i].get_parameter(name)
                break
        out.append((mine, param0.numel(), param0.dtype))
    return out
