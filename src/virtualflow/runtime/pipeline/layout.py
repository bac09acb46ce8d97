"""Building a worker's stage engine, for the job's layout or for a Bamboo re-layout.

:class:`StageBuilder` holds what every :class:`~.engine.StageEngine` of a worker is built from
(the job, its data, the worker's mode and device) and builds one: for the job's own stages
(:meth:`StageBuilder.stage`, tensor-parallel shards included through a
:class:`~.tensor_stage.TensorStage`) or, after a Bamboo failover or reconfiguration, for a run of
job stages of a failed-over replica (:meth:`StageBuilder.relaid`). The collective part of a
re-layout (who sends which stage's state) is :func:`~.stage_state.exchange_for_layout`.

Invariants: every stage is cut from the whole model built from the job's seed (so its pieces
start from the unpipelined model's weights); a re-laid stage is loaded with the job stages'
states it runs (and its successor's, into its replica) before it takes a step; its reduction over
the replicas goes job stage by job stage when replicas differ in depth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from virtualflow.config.pipeline import Pipeline
from virtualflow.plan.data import DataPlan
from virtualflow.plan.pipeline.geometry import (bounds_from_counts, layers_of, piece_module, successor_pieces,
                                                tied_for_worker)
from virtualflow.runtime.pipeline.engine import StageEngine
from virtualflow.runtime.pipeline.loop import StageLoop, stage_loop
from virtualflow.runtime.pipeline.redundancy import RELAID_TIES, StageReplica
from virtualflow.runtime.pipeline.stage_state import load_merged, stage_states, successor
from virtualflow.runtime.pipeline.tensor_stage import TensorStage
from virtualflow.runtime.streaming import loader_of

__all__ = ["StageBuilder", "check_relayout", "held_states", "stages_held"]


@dataclass(slots=True)
class StageBuilder:
    """What a worker's stage engines are built from; fixed for the worker's life."""

    job: Any
    dataset: Any
    plan: DataPlan
    deterministic: bool
    device: torch.device
    eager_every_wait: bool
    breakdown: bool
    loader_workers: int = 0
    """Threads per engine that load the next micro-batches ahead (``--loader-workers``)."""

    def engine(self, pipeline: Pipeline, pieces: dict[int, nn.Module], n_pieces: int, stage_rank: int,
               loop: StageLoop, **more: Any) -> StageEngine:
        """A :class:`StageEngine` of ``pieces`` (``more``: its other keywords)."""
        job = self.job
        return StageEngine(
            pieces=pieces, n_pieces=n_pieces, stage_rank=stage_rank, build_optimizer=job.build_optimizer,
            scheduler_factory=job.lr_scheduler, pipeline=pipeline, plan=self.plan,
            loader=loader_of(self.dataset, job.collate_fn, self.plan), model_input=job.input_of,
            output_loss=job.output_loss, seed=job.seed, batchnorm=job.batchnorm, deterministic=self.deterministic,
            device=self.device, eager_every_wait=self.eager_every_wait, loop=loop, breakdown=self.breakdown,
            loader_workers=self.loader_workers, **more)

    def stage(self, pipeline: Pipeline, layers: list[nn.Module], bounds: list[tuple[int, int]], stage_rank: int,
              tensor: TensorStage, reduction: str) -> StageEngine:
        """Stage-rank ``stage_rank``'s engine of the job's layout, cut from the whole model's
        ``layers`` (its tensor rank's shards of them with tensor parallelism)."""
        p = pipeline.stages
        mine = tensor.convert(layers, stage_rank)
        pieces = {k: piece_module(mine, a, b) for k, (a, b) in enumerate(bounds) if k % p == stage_rank}
        loop = tensor.hook_loop(stage_loop(self.job, layers, bounds, p), pieces)
        return self.engine(pipeline, pieces, len(bounds), stage_rank, loop,
                           tied=tied_for_worker(mine, bounds, p, stage_rank),
                           successor_pieces=successor_pieces(pipeline, mine, bounds, stage_rank),
                           reduction=reduction)

    def relaid(self, pipeline: Pipeline, full_bounds: list[tuple[int, int]], runs: list[list[int]], pos: int,
               got: dict[int, dict[str, Any]], old_replica: StageReplica | None,
               by_job_stage: bool, tensor: TensorStage) -> tuple[StageEngine, list[tuple[int, int]]]:
        """Member ``pos`` of a re-laid replica whose members run the job stages ``runs``: its
        engine, loaded with those stages' states (``got``, per job stage: its own and its
        successor's), and the replica's layer bounds. ``old_replica``: the replica this worker
        held (its eager forwards of a stage it now runs are reused by the redone step).
        ``by_job_stage``: reduce job stage by job stage (the replicas differ in depth).
        ``tensor``: the stages' tensor parallelism (with ``T > 1`` this worker runs, and keeps
        the replica of, its tensor rank's shards of the stages, in its tensor group)."""
        m = len(runs)
        mine, succ = runs[pos], runs[(pos + 1) % m]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.job.seed)
            base = [layer.to(self.device) for layer in layers_of(self.job.model())]
        layers = tensor.convert_stages(base, set(mine) | set(succ))
        whole = torch.nn.Sequential(*layers)
        whole.load_state_dict({k: v for s in set(mine) | set(succ) for k, v in got[s]["model"].items()},
                              strict=False)
        counts = [full_bounds[run[-1]][1] - full_bounds[run[0]][0] for run in runs]
        relaid = Pipeline(stages=m, schedule=pipeline.schedule, split=counts, redundancy=m >= 2,
                          redundant_compute=pipeline.redundant_compute, tensor=pipeline.tensor,
                          tensor_chunks=pipeline.tensor_chunks)
        bounds = bounds_from_counts(counts)
        a, b = bounds[pos]
        sa, sb = bounds[(pos + 1) % m]
        pieces = {pos: piece_module(layers, a, b)}
        # (the norm leaves out the copies of weights tied across the job's stages: twins included;
        # read before the twins get their own parameters)
        loop = tensor.hook_loop(stage_loop(self.job, base, full_bounds, pipeline.stages), pieces)
        tied, twins = RELAID_TIES[self.deterministic](layers, full_bounds, pipeline.stages, runs, pos)
        stage = self.engine(relaid, pieces, m, pos, loop,
                            tied=tied, tied_twins=twins,  # the tied weights re-planned for the new layout
                            successor_pieces={(pos + 1) % m: piece_module(layers, sa, sb)} if m >= 2 else None)
        load_merged(stage, [got[s] for s in mine])
        load_merged(stage.replica_of_successor, [got[s] for s in succ])
        if old_replica is not None and old_replica.eager:
            # Eager redundant forwards of the interrupted step, of a stage this worker now runs:
            # the redone step takes them instead of running that stage's forwards again.
            names = [int(name) for mod in old_replica.pieces.values() for name, _ in mod.named_children()]
            lo, hi = min(names), max(names) + 1
            if a <= lo and hi <= b and stage.pipeline.eager_forwards:
                stage.take_over(lo, hi, old_replica.eager)
            old_replica.eager.clear()
        if by_job_stage and len(mine) > 1:
            stage.set_job_stages([(s, *full_bounds[s]) for s in mine])
        return stage, bounds


def check_relayout(layout: list[list[int]], pipeline: Pipeline, size: int, steps: list[int] | None,
                   target: int | None) -> tuple[list[list[list[int]]], list[list[int]]]:
    """A Bamboo layout's replicas (each a list of runs of job stages) and its flat form (one run
    per member, replica after replica); raises where the generation cannot adopt it."""
    from virtualflow.plan.pipeline.failover import flatten, split_replicas

    layouts = split_replicas(layout, pipeline.stages)
    new = flatten(layouts)
    if len(new) != size:
        raise RuntimeError(f"layout {layout} names {len(new)} workers; the generation has {size}")
    if steps is not None and target is not None and any(0 <= t != target for t in steps):
        raise RuntimeError(f"a failover needs every surviving worker at the same step (steps {steps}); a "
                           f"failure struck between the stages' updates of one step: resume from a checkpoint")
    if pipeline.chunks != 1:
        raise RuntimeError("a Bamboo failover needs chunks=1")
    return layouts, new


def stages_held(stage: StageEngine | None, layout: Sequence[Sequence[int]] | None, p: int,
                rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(job stages ``stage`` runs, job stages its replica holds) of member ``rank`` (``layout``:
    the current flat layout, ``None`` for one stage per member)."""
    if stage is None:
        return (), ()
    if layout is None:
        own = (stage.stage_rank,)
        rep = ((stage.stage_rank + 1) % p,) if stage.replica_of_successor is not None else ()
        return own, rep
    own = tuple(layout[rank])
    if stage.replica_of_successor is None:  # a replica of one worker keeps no replica
        return own, ()
    return own, tuple(layout[successor(layout, p, rank)])


def held_states(stage: StageEngine | None, own: tuple[int, ...], rep: tuple[int, ...],
                full_bounds: list[tuple[int, int]]) -> dict[int, dict[str, Any]]:
    """Per job stage, the state this worker holds of it (the stages it runs, then its replica's)."""
    local: dict[int, dict[str, Any]] = {}
    if stage is not None:
        local.update(stage_states(stage.replica_of_successor, rep, full_bounds) if rep else {})
        local.update(stage_states(stage, own, full_bounds))
    return local
