"""The pipeline description of a job, and how a model is cut into stages.

A job opts into pipeline parallelism with ``Job(..., pipeline=Pipeline(stages=4))``. The model is
then a chain of *layers*: the children of the ``nn.Sequential`` that ``Job.model`` returns (a
model that is not a ``Sequential`` is first turned into one by a tracer, see
:func:`virtualflow.parallel.tracing.sequential_from`). Layer ``k`` takes the output of layer ``k-1`` (one
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

This module holds what the user writes: the :class:`Pipeline` config, THE split parser
(:func:`parse_split`, the text form of ``--split``) and THE knob merger (:func:`merge_knobs`: the
job's pipeline with command-line or option knobs applied). The geometry of cutting lives in
:mod:`virtualflow.plan.pipeline.geometry`, the schedule table in
:mod:`virtualflow.plan.pipeline.schedules`, and launch-time planning (profiling, ``split="auto"``)
in :mod:`virtualflow.launching.pipeline`. Imports only ``plan/``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from virtualflow.config.composition import check
from virtualflow.plan.pipeline.geometry import SplitSpec, check_split
from virtualflow.plan.pipeline.schedules import FLUSH_SCHEDULES, SCHEDULE_NAMES

DEFAULT_SPLIT = "equal"
"""THE default split: what ``Pipeline(stages=p)`` cuts by when no split is given."""


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
    split: SplitSpec = DEFAULT_SPLIT
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
    failover re-lays) and ``tensor=1``; elsewhere the mode is lazy (a tensor-parallel forward is a
    collective of its stage's group, and each worker picks its idle slots by its own timing)."""

    tensor: int = 1
    """T: tensor-parallel width of every stage. Each stage is a group of ``tensor`` workers running
    the stage's transformer blocks Megatron-style (column- then row-parallel; blocks recognised by
    :func:`virtualflow.parallel.tensor_parallel_layer`), so a pipeline replica has
    ``stages * tensor`` workers and a run of ``W`` workers has ``D = W / (stages * tensor)``
    replicas (see docs/parallel3d.md)."""
    tensor_chunks: int = 1
    """Tensor-parallel overlap chunks per block (CoCoNeT: each block's token rows cut into this
    many chunks whose collectives overlap the next chunk's compute); ``tensor > 1`` only."""

    def __post_init__(self) -> None:
        _positive("stages", self.stages)
        _positive("tensor", self.tensor)
        _positive("tensor_chunks", self.tensor_chunks)
        _positive("chunks", self.chunks)
        _positive("window", self.window)
        if self.schedule not in SCHEDULE_NAMES:
            raise ValueError(f"Pipeline.schedule={self.schedule!r} is not one of {SCHEDULE_NAMES}")
        check("chunks+schedule", chunks=self.chunks, schedule=self.schedule)
        object.__setattr__(self, "split", check_split(self.split, self.stages, self.chunks))
        check("redundancy+flush", "tensor_chunks+tensor", redundancy=self.redundancy,
              stages=self.stages, flush=self.flush, schedule=self.schedule, flush_schedules=FLUSH_SCHEDULES,
              tensor=self.tensor, tensor_chunks=self.tensor_chunks)
        if self.redundant_compute not in ("eager", "lazy"):
            raise ValueError(f"Pipeline.redundant_compute={self.redundant_compute!r} must be 'eager' (redundant "
                             f"forwards in idle slots, the default) or 'lazy' (recompute on a failover)")
        if self.memory_limit_gib is not None and not (self.memory_limit_gib > 0):
            raise ValueError(f"Pipeline.memory_limit_gib={self.memory_limit_gib!r} must be positive or None")

    @property
    def replica_workers(self) -> int:
        """Workers per pipeline replica: ``stages * tensor`` (the unit a run grows and shrinks by)."""
        return self.stages * self.tensor

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
                and self.schedule in ("1f1b", "gpipe") and self.tensor == 1)

    def held_stages(self, stage: int) -> set[int]:
        """The stages a worker of stage ``stage`` holds the layers of: its own and, with Bamboo's
        redundancy, its successor's (the replica it keeps)."""
        return {stage, (stage + 1) % self.stages} if self.redundancy else {stage}


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"Pipeline.{name}={value!r} must be a positive int")


# ---- the text form of --split, and the one knob merger ---------------------------------------
def parse_split(text: str) -> SplitSpec:
    """THE split parser: ``auto``, ``equal`` or comma-separated layer counts (``3,2,2,1``)."""
    text = text.strip()
    if text in ("auto", "equal"):
        return text
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--split {text!r} must be auto, equal or comma-separated layer counts such as 3,2,2,1") from None


def merge_knobs(base: Pipeline | None, *, stages: int | None = None, schedule: str | None = None,
                chunks: int | None = None, split: SplitSpec | str | None = None,
                memory_limit_gib: float | None = None, new_split: SplitSpec = DEFAULT_SPLIT,
                tensor: int | None = None) -> Pipeline:
    """THE knob merger: ``base`` (a job's ``Job.pipeline``, or ``None``) with the knobs given
    (``None``: not given) applied, validated as a new :class:`Pipeline`.

    A text ``split`` goes through :func:`parse_split`. Without ``split``, the job's split is kept
    while it still fits; ``new_split`` (default :data:`DEFAULT_SPLIT`) is used for a job without a
    pipeline and where the job's explicit counts were for another number of pieces. A schedule
    other than ``interleaved_1f1b`` given without ``chunks`` runs one chunk per worker.
    Without ``base``, ``stages`` is required."""
    changes: dict[str, Any] = {k: v for k, v in (("stages", stages), ("schedule", schedule), ("chunks", chunks),
                                                  ("memory_limit_gib", memory_limit_gib), ("tensor", tensor)) if v is not None}
    if split is not None:
        changes["split"] = parse_split(split) if isinstance(split, str) else split
    if base is None:
        if "stages" not in changes:
            raise ValueError("the job has no Job.pipeline: give --stages P (pipeline_stages=P), the workers per "
                             "pipeline replica")
        changes.setdefault("split", new_split)
        return Pipeline(**changes)
    if "chunks" not in changes and changes.get("schedule", base.schedule) != "interleaved_1f1b":
        changes["chunks"] = 1
    if "split" not in changes and not isinstance(base.split, str) and (
            changes.get("stages", base.stages) * changes.get("chunks", base.chunks) != len(base.split)):
        changes["split"] = new_split  # the job's explicit counts no longer fit the pieces asked for
    return dataclasses.replace(base, **changes)


def pipeline_of(job: Any, options: Any) -> Pipeline | None:
    """The job's pipeline with the launch options' pipeline knobs (``pipeline_stages``,
    ``schedule``, ``chunks``, ``split``) applied by :func:`merge_knobs`; ``None``: no pipeline."""
    knobs = {"schedule": options.schedule, "chunks": options.chunks, "split": options.split,
             "tensor": options.tensor_parallel}
    given = {k: v for k, v in knobs.items() if v is not None}
    stages = options.pipeline_stages
    if stages is None and job.pipeline is None and options.tensor_parallel is not None:
        stages = 1  # tensor parallelism alone: one stage of T workers
    if stages is None and job.pipeline is None:
        if given:
            flags = ", ".join(f"--{k}" for k in given)
            raise ValueError(f"{flags} apply to pipelined jobs only; add --pipeline-stages P (pipeline_stages=P) or "
                             f"give the job a Job.pipeline")
        return None
    pipeline = merge_knobs(job.pipeline, stages=stages, **given)
    if job.output_loss is None:
        raise ValueError(
            "a pipelined job needs Job.output_loss=(outputs, batch) -> scalar: the loss is computed on the last "
            "stage, which holds only the model's outputs and the batch"
        )
    return pipeline


__all__ = ["DEFAULT_SPLIT", "FLUSH_SCHEDULES", "Pipeline", "SCHEDULE_NAMES", "SplitSpec", "merge_knobs",
           "parse_split", "pipeline_of"]
