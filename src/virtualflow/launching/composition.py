"""The refusals of pairs of capabilities applied at launch, before any worker starts.

Purpose: the launch's half of THE table of refused combinations
(:data:`virtualflow.config.composition.REFUSALS`, from which docs/composition.md's pairs are
generated): the functions here gather the facts a launch knows (the resolved ``Pipeline``, the
options, the model's layers) and name the rows that apply to them. The rows themselves, their
conditions and their one-line messages (the value, the rule and the knob to change) live in the
table only; the ``Pipeline`` applies the rows about its own fields, and the worker's engines those
that need the built stage.

Invariant: nothing here starts anything; :func:`check_pipeline_balance` reads only the resolved
``Pipeline`` and the options, so it runs before the profile.
"""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn

from virtualflow.config.composition import check
from virtualflow.config.options import LaunchOptions
from virtualflow.plan.batch_schedule import fewest_virtual_nodes
from virtualflow.plan.pipeline.geometry import EXACT_USES, shared_across_pieces, tied_parameters

__all__ = ["check_batch_schedule", "check_fsdp_layout", "check_pipeline_balance", "check_shared_parameters", "check_streaming"]


def check_pipeline_balance(pipeline: Any, opts: LaunchOptions) -> None:
    """What speed-weighted micro-batch shares cannot do for a pipelined job (docs/pipeline.md,
    "Replicas of unequal speed"). A tensor-parallel grid is weighed like any pipeline: its
    replicas' time model takes each stage's ``T`` workers as one group (docs/heterogeneity.md)."""
    check("pipeline+uneven_vn_sizes", "balance+no_flush", "balance+interleaved_chunks",
          uneven_vn_sizes=opts.uneven_vn_sizes, balanced=opts.balanced,
          flush=pipeline.flush, schedule=pipeline.schedule, chunks=pipeline.chunks, stages=pipeline.stages)


def check_fsdp_layout(pipeline: Any, opts: LaunchOptions) -> None:
    """What sharded parameters (``reduction="fsdp"``) cannot combine with yet: a pipeline
    (``pipeline``: the resolved ``Pipeline``, or ``None``) with Bamboo, tensor parallelism or
    several stages; the most particular row first."""
    if pipeline is not None:
        check("fsdp+bamboo", "fsdp+tensor", "fsdp+pipeline", reduction=opts.reduction,
              redundancy=pipeline.redundancy, tensor=pipeline.tensor, stages=pipeline.stages)


def check_batch_schedule(job: Any, streaming: bool, opts: LaunchOptions, max_workers: int) -> None:
    """What a batch schedule (``Job.batch_schedule``) cannot combine with: a pipeline, a sharded
    state, speed-weighted maps, a stream, and more workers than a change's V (``max_workers``: the
    most the run may have)."""
    schedule = tuple(job.batch_schedule)
    fewest = fewest_virtual_nodes(job)
    check("batch_schedule+pipeline", "batch_schedule+sharded", "batch_schedule+balance", "batch_schedule+streaming",
          "batch_schedule+workers", batch_schedule=bool(schedule), pipeline=job.pipeline is not None,
          reduction=opts.reduction, balanced=opts.balanced, streaming=streaming, workers=max_workers,
          fewest=fewest[0], step=fewest[1])


def check_streaming(streaming: bool, opts: LaunchOptions) -> None:
    """What a streaming dataset (``streaming``: the job's data plan streams) cannot combine with."""
    check("uneven_vn_sizes+streaming", streaming=streaming, uneven_vn_sizes=opts.uneven_vn_sizes)


def check_shared_parameters(layers: Sequence[nn.Module], bounds: Sequence[tuple[int, int]],
                            pipeline: Any, deterministic: bool = False) -> list[list[tuple[int, str]]]:
    """A weight shared by layers on different workers is held by each of them as a copy; the
    runtime sums the copies' gradients before every update (flush schedules), so they stay equal.
    Deterministic mode forms, per virtual node, the sum of the two uses' gradients before the
    fixed tree, as autograd does in the unpipelined job: exact for a weight read by two layers
    (in different pieces, on one worker or two). Refused: a weight read by three or more layers of
    different pieces in deterministic mode (no fixed order of autograd's additions to match), a
    weight shared across workers with a no-flush schedule (one version per copy is not
    implemented). With ``Pipeline.redundancy`` a replica holds its own copy, refreshed with its
    source, and a failover re-plans the copies' sum for the new layout. Returns the weights shared across workers, each
    as its locations in model order (:func:`~virtualflow.plan.pipeline.geometry.tied_parameters`)."""
    groups = tied_parameters(layers, bounds, pipeline.stages)
    if groups:
        (j, first), (i, name) = groups[0][0], groups[0][1]
        check("tied_across_workers+no_flush", tied=True, flush=pipeline.flush, schedule=pipeline.schedule,
              j=j, first=first, i=i, name=name)
    if deterministic:
        for locs in shared_across_pieces(layers, bounds):
            check("deterministic+tied_uses", deterministic=True, uses=len(locs), exact_uses=EXACT_USES,
                  names=", ".join(f"{i}.{name}" for i, name in locs))
    return groups
