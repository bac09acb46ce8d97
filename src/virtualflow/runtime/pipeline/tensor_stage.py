"""A pipeline stage's tensor parallelism as one runtime object, chosen once per worker.

:func:`tensor_stage` gives the worker engine (:mod:`.worker_engine`) the object for its job:
:class:`TensorStage` without tensor parallelism (``Pipeline.tensor == 1``: no tensor group, the
generation's group is the pipeline's, states need no merging) or :class:`TensorParallelStage`
(``tensor = T > 1``: the D x P x T grid of :mod:`.tensor_grid`). The engine calls the object at
every point where the two differ and never asks which one it holds.

What the object owns:

- the generation's groups (:meth:`TensorStage.join`): the group the pipeline engine runs on (a
  plane with tensor parallelism) and, with it, the tensor-parallel group of the stage;
- the shard layout: which layers are converted into this tensor rank's shards, which of the
  stage's parameters hold a shard, this worker's tensor rank;
- the training loop's hooks (:meth:`TensorStage.hook_loop`): the tensor-group sum the gradient
  check uses, the sharded parameters and the tensor rank, given to the loop when the stage is
  built (the sum runs over the current generation's group);
- the state merge: a checkpoint's stages gathered into the single-worker layout
  (:meth:`TensorStage.gather`), a worker's part of a sharded checkpoint written without a gather
  (:meth:`TensorStage.sharded_parts`: its shards, named so that a reader merges them into that
  layout) and a stage resumed from a state in that layout (:meth:`TensorStage.build`: cut for this
  worker's tensor rank, whatever tensor degree wrote it).

Invariant: a worker's tensor rank is fixed once its stage is built (generations add or remove
whole replicas of ``P T`` consecutive ranks, so ``rank % T`` stays).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import torch
from torch import nn

from virtualflow.comm.groups import Group
from virtualflow.config.pipeline import Pipeline
from virtualflow.plan.pipeline.geometry import layers_of, piece_module
from virtualflow.runtime.breakdown import Raw
from virtualflow.runtime.pipeline.engine import StageEngine
from virtualflow.runtime.step.finish import TensorSlots
from virtualflow.runtime.pipeline.loop import StageLoop
from virtualflow.runtime.dcp import Piece
from virtualflow.runtime.pipeline.stage_state import (gather_stages, grid_parts, load_scaler, optimizer_names,
                                                      reorder_optimizer, resume_stage, sharded_parts, stage_state,
                                                      transfer_stages)
from virtualflow.runtime.pipeline.tensor_grid import (TensorPlanes, convert_layers, merge_stage_states, rebind_comm,
                                                      shard_stage_state, whole_splits)
from virtualflow.runtime.transfer import broadcast_state

__all__ = ["TensorParallelStage", "TensorStage", "tensor_stage"]

Subgroup = Callable[..., Group]
"""``subgroup(generation, name, rank, size, duplex=False)``: a named group of a generation."""


class TensorStage:
    """A stage without tensor parallelism (``T = 1``): no tensor group, the generation's group
    is the pipeline's, a stage's state is already the single-worker layout."""

    def __init__(self, pipeline: Pipeline, bounds: list[tuple[int, int]], device: torch.device) -> None:
        self.pipeline = pipeline
        self.bounds = bounds
        """The job's stages' layer ranges (a tensor-parallel job is never re-laid out)."""
        self.device = device

    def join(self, group: Group) -> Group:
        """Adopt a generation; returns the group the pipeline engine runs on. Collective."""
        return group

    def leave(self) -> None:
        """Close this generation's groups (a broken or a finished generation)."""

    def stage_group_name(self, stage: int) -> str:
        """The name of job stage ``stage``'s group over the replicas."""
        return f"stage{stage}"

    def convert(self, layers: list[nn.Module], stage_rank: int) -> list[nn.Module]:
        """The layers this worker's pieces of stage-rank ``stage_rank`` (and, with Bamboo's
        redundancy, its replica of the successor's stage) are cut from."""
        return layers

    def convert_stages(self, layers: list[nn.Module], stage_ranks: set[int]) -> list[nn.Module]:
        """The whole model's (unconverted) ``layers`` with the pieces of ``stage_ranks`` in the form
        this worker runs them (a Bamboo re-layout: the job stages it runs and keeps a replica of)."""
        return layers

    def plane_layout(self, layout: list[list[int]]) -> list[list[int]]:
        """A Bamboo layout (one run per generation member) as the pipeline engine's group sees it."""
        return layout

    def hook_loop(self, loop: StageLoop, pieces: dict[int, nn.Module]) -> StageLoop:
        """The training loop of a stage built from ``pieces``, with this object's hooks."""
        return loop

    def bind(self, stage: StageEngine) -> None:
        """Point the stage at this generation's groups (after :meth:`join`)."""

    def agree_control(self, control: int | Callable[[], int]) -> int | Callable[[], int]:
        """The control position the step starts with."""
        return control

    def transfer(self, stage: StageEngine, group: Group, steps: list[int], target: int) -> int:
        """:func:`~.stage_state.transfer_stages` over the pipeline's group; returns the bytes moved."""
        return transfer_stages(stage, self.pipeline, group, steps, target, self.device)

    def generation_rows(self, rows: Raw | None) -> Raw | None:
        """The step breakdown's rows in generation-rank order."""
        return rows

    def generation_rank(self, group: Group) -> int:
        """This worker's rank in the generation (``group``: the pipeline's group)."""
        return group.rank

    def build(self, build: Callable[[], StageEngine], model: nn.Module | None, state: dict[str, Any] | None,
              stage_rank: int) -> StageEngine:
        """This worker's stage (``build()``), loaded with a gathered ``state`` when one is given."""
        stage = build()
        if state is not None:
            resume_stage(stage, model, state, stage_rank)
        return stage

    def gather(self, stage: StageEngine, group: Group, layout: Any,
               whole_model: Callable[[], nn.Module]) -> list[dict[str, Any]] | None:
        """Collective over ``group`` (the pipeline's): rank 0 gets every job stage's state in the
        single-worker layout (:func:`~.stage_state.gather_stages`); others get ``None``."""
        return gather_stages(stage, self.pipeline, layout, self.bounds, group, self.device)

    def sharded_parts(self, stage: StageEngine, rank: int, size: int) -> tuple[list[Piece], dict[str, Any] | None]:
        """Generation rank ``rank``'s part of a sharded checkpoint (:func:`~.stage_state.sharded_parts`). Local."""
        return sharded_parts(stage, self.pipeline, self.bounds, rank, size)


class TensorParallelStage(TensorStage):
    """A stage of ``T > 1`` workers (:mod:`.tensor_grid`): the pipeline engine runs on this
    worker's plane; the stage's layers are this tensor rank's shards."""

    def __init__(self, pipeline: Pipeline, bounds: list[tuple[int, int]], device: torch.device, *,
                 subgroup: Subgroup, build_optimizer: Callable[[nn.Module], Any]) -> None:
        super().__init__(pipeline, bounds, device)
        self.tensor = pipeline.tensor
        self.subgroup = subgroup
        self.build_optimizer = build_optimizer
        self.planes: TensorPlanes | None = None
        """This generation's plane and tensor-parallel groups (``None`` between generations)."""
        self.rank = 0
        """This worker's tensor rank (fixed once its stage is built: the shards it holds)."""
        self.sharded_names: frozenset[str] = frozenset()
        """Whole-model names of the stage's parameters that hold a shard (set by :meth:`convert`)."""
        self.splits: dict[str, Any] = {}
        """How every whole-model state key is cut over the ``T`` ranks (set by :meth:`convert`)."""
        self.names: list[str] = []
        """The unconverted stage's optimizer order (set by :meth:`convert`): a checkpoint's."""

    def join(self, group: Group) -> Group:
        self.leave()
        self.planes = TensorPlanes(group, self.tensor, self.subgroup)
        self.rank = self.planes.t
        return self.planes.plane

    def leave(self) -> None:
        if self.planes is not None:
            self.planes.close()
            self.planes = None

    def stage_group_name(self, stage: int) -> str:
        return f"stage{stage}.t{self.rank}"  # one stage group per plane

    def convert(self, layers: list[nn.Module], stage_rank: int) -> list[nn.Module]:
        # With redundancy, the successor's stage too: Bamboo's replica of it is this tensor rank's
        # shard of it, cut by the same splits as the successor's own (docs/bamboo.md, "With tensor
        # parallelism"); without it no piece keeps those layers, so they are not converted.
        self.names = self.unconverted_names(stage_rank, layers)
        return self.convert_stages(layers, self.pipeline.held_stages(stage_rank))

    def convert_stages(self, layers: list[nn.Module], stage_ranks: set[int]) -> list[nn.Module]:
        p = self.pipeline.stages
        self.splits = whole_splits(layers, self.tensor)
        self.sharded_names = frozenset(n for n, split in self.splits.items() if not split.replicated)
        for k, (a, b) in enumerate(self.bounds):
            if k % p in stage_ranks:
                layers = convert_layers(layers, a, b, self.planes.comm, self.pipeline.tensor_chunks)
        return layers

    def plane_layout(self, layout: list[list[int]]) -> list[list[int]]:
        """This plane's members' runs (every member of a tensor group runs its group's run)."""
        return layout[self.rank::self.tensor]

    def hook_loop(self, loop: StageLoop, pieces: dict[int, nn.Module]) -> StageLoop:
        """The loss scaler's inf check and the clipping norm sum the shards' parts over the tensor
        group (:class:`~virtualflow.runtime.step.finish.TensorSlots`): :meth:`sum` runs over the
        current generation's group; the stage's parameters that hold a shard (by ``id``) fill the
        slot of this worker's tensor rank, the replicated ones their one slot."""
        sharded = frozenset(id(q) for n, q in stage_module(pieces).named_parameters() if n in self.sharded_names)
        rank = self.rank
        loop.slots_of = lambda device: TensorSlots(self.sum, sharded, rank, device)
        return loop

    def sum(self, vector: torch.Tensor) -> None:
        """Sum ``vector`` in place over this generation's tensor-parallel group."""
        self.planes.tp.all_reduce(vector)

    def bind(self, stage: StageEngine) -> None:
        rebind_comm(stage.model, self.planes.comm)
        replica = stage.replica_of_successor  # Bamboo: its shards run in this stage's tensor group
        if replica is not None:
            rebind_comm(replica.model, self.planes.comm)

    def agree_control(self, control: int | Callable[[], int]) -> int:
        """Every plane must stop for a command at the same step, but only generation rank 0 reads
        the control position and the planes' statistics all-reduces are apart: the position is
        read now, before the schedule, and the first tensor-parallel group hands rank 0's to every
        plane's rank 0."""
        control = int(control()) if callable(control) else control
        if self.planes.plane_rank == 0:
            c = torch.tensor([float(control)], dtype=torch.float64)
            self.planes.tp.all_reduce(c)
            control = int(c.item())
        return control

    def transfer(self, stage: StageEngine, group: Group, steps: list[int], target: int) -> int:
        """Each plane brings its own members up to date."""
        return transfer_stages(stage, self.pipeline, self.planes.plane, self.planes.plane_steps(steps), target,
                               self.device, state_of=named_stage_state)

    def generation_rows(self, rows: Raw | None) -> Raw | None:
        """The rows of plane 0 (tensor rank 0 of every stage, generation ranks ``0, T, 2T, ...``; the
        stage's other workers run the same schedule on the same shapes), ``None`` for the others."""
        return None if rows is None else rows.spread(self.tensor)

    def generation_rank(self, group: Group) -> int:
        return self.planes.generation_group.rank

    def build(self, build: Callable[[], StageEngine], model: nn.Module | None, state: dict[str, Any] | None,
              stage_rank: int) -> StageEngine:
        """From a gathered state: the whole model's weights first (the shards are cut from them),
        then this shard of the stage's optimizer state."""
        if state is None:
            return build()
        model.load_state_dict(state["model"])
        layers = layers_of(model)
        names = self.unconverted_names(stage_rank, layers)
        splits = whole_splits(layers, self.tensor)
        stage = build()
        full = {"model": {n: state["model"][n] for n in names},
                "optimizer": state["optimizer"]["pipeline_stages"][stage_rank]}
        mine = shard_stage_state(full, names, splits, self.rank, self.tensor)
        stage.optimizer.load_state_dict(reorder_optimizer(mine["optimizer"], names,
                                                          optimizer_names(stage.optimizer, stage.model)))
        sched = state["lr_scheduler"]["pipeline_stages"][stage_rank]
        if stage.scheduler is not None and sched is not None:
            stage.scheduler.load_state_dict(sched)
        load_scaler(stage, state.get("grad_scaler"))
        return stage

    def unconverted_names(self, stage_rank: int, layers: list[nn.Module]) -> list[str]:
        """The optimizer's parameter order of stage ``stage_rank`` without tensor parallelism (the
        order of a checkpoint's per-stage optimizer state): the job's optimizer built on the
        unconverted stage module."""
        p = self.pipeline.stages
        module = torch.nn.Sequential(*[piece_module(layers, a, b) for k, (a, b) in enumerate(self.bounds)
                                       if k % p == stage_rank])
        flat = torch.nn.Sequential(OrderedDict(
            (name, layer) for piece in module.children() for name, layer in piece.named_children()))
        return optimizer_names(self.build_optimizer(flat), flat)

    def gather(self, stage: StageEngine, group: Group, layout: Any,
               whole_model: Callable[[], nn.Module]) -> list[dict[str, Any]] | None:
        """Each plane's stages gathered on its plane rank 0 (generation ranks ``0 .. T-1``, one
        tensor-parallel group), then sent to rank 0, which merges the shards into the
        single-worker layout (``whole_model()``: the unconverted model, for the splits)."""
        planes = self.planes
        mine = gather_stages(stage, self.pipeline, layout, self.bounds, planes.plane, self.device,
                             state_of=named_stage_state)
        if planes.plane_rank != 0:
            return None
        per_plane = gather_on_root(planes.tp, mine, self.device)
        if per_plane is None:
            return None
        layers = layers_of(whole_model())
        splits = whole_splits(layers, self.tensor)
        out = []
        for s in range(self.pipeline.stages):
            merged = merge_stage_states([plane[s] for plane in per_plane], splits)
            target = self.unconverted_names(s, layers)
            merged["optimizer"] = reorder_optimizer(merged["optimizer"], merged["param_names"], target)
            out.append(merged)
        return out

    def sharded_parts(self, stage: StageEngine, rank: int, size: int) -> tuple[list[Piece], dict[str, Any] | None]:
        """This worker's shards, written as they are (:func:`~.stage_state.grid_parts`). Local."""
        return grid_parts(stage, self.pipeline, self.bounds, rank, size, self.splits, self.names)


def tensor_stage(pipeline: Pipeline, bounds: list[tuple[int, int]], device: torch.device, *, subgroup: Subgroup,
                 build_optimizer: Callable[[nn.Module], Any]) -> TensorStage:
    """The job's :class:`TensorStage` (chosen here, once)."""
    if pipeline.tensor > 1:
        return TensorParallelStage(pipeline, bounds, device, subgroup=subgroup, build_optimizer=build_optimizer)
    return TensorStage(pipeline, bounds, device)


def gather_on_root(group: Group, mine: Any, device: torch.device) -> list[Any] | None:
    """Collective over ``group``: rank 0 gets every member's ``mine`` in rank order (each member
    in turn sends it to rank 0 alone); the others get ``None``."""
    out = [mine]
    for r in range(1, group.size):
        got, _ = broadcast_state(group, r, mine if group.rank == r else None, device, receivers=[0])
        out.append(got)
    return out if group.rank == 0 else None


def stage_module(pieces: dict[int, nn.Module]) -> nn.Sequential:
    """The stage's layers under their whole-model names, as :func:`~.pieces.stage_model` joins them."""
    return nn.Sequential(OrderedDict((name, layer) for k in sorted(pieces)
                                     for name, layer in pieces[k].named_children()))


def named_stage_state(stage: StageEngine) -> dict[str, Any]:
    """:func:`~.stage_state.stage_state` with the optimizer's parameter names (``param_names``):
    the planes' states are merged by name (:func:`~.tensor_grid.merge_stage_states`)."""
    return {**stage_state(stage), "param_names": optimizer_names(stage.optimizer, stage.model)}
