"""How a model is cut into pipeline pieces and where a worker sits: pure geometry.

The model of a pipelined job is a chain of *layers* (the children of an ``nn.Sequential``). A
pipeline of ``p`` stages and ``v`` chunks cuts it into ``p * v`` contiguous, non-empty *pieces*;
piece ``k`` covers layers ``[a, b)`` and lives on worker ``k % p`` of its pipeline replica. A run
with ``W`` workers has ``d = W / p`` replicas; worker rank ``r`` is stage-rank ``r % p`` of replica
``r // p`` (or, after a Bamboo failover, its position in replicas of unequal depth: :class:`Grid`).

Invariants: bounds cover every layer exactly once, in order; a piece module keeps the layer
names of the whole model (so the union of the pieces' state dicts is the model's state dict);
errors name the value, the rule and the ``Pipeline`` knob to change.

Functions here read a pipeline description by its fields (``stages``, ``chunks``, ``split``,
``schedule``, ``redundancy``, ``flush``): they take a :class:`virtualflow.Pipeline` without
importing it (that config lives above this layer).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence, Union

import torch
from torch import nn

from virtualflow.plan.pipeline.partition import equal_layer_split

SplitSpec = Union[str, Sequence[int]]
"""``"equal"``, ``"auto"`` or explicit layer counts per piece."""


def check_split(split: SplitSpec, stages: int, chunks: int) -> SplitSpec:
    """``split`` checked against ``stages * chunks`` pieces: ``"equal"``, ``"auto"``, or that many
    positive layer counts (returned as a tuple)."""
    if isinstance(split, str):
        if split not in ("equal", "auto"):
            raise ValueError(f"Pipeline.split={split!r} must be 'equal', 'auto' or a list of layer counts")
        return split
    counts = list(split)
    pieces = stages * chunks
    if len(counts) != pieces or any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in counts):
        raise ValueError(
            f"Pipeline.split={counts!r} must be {pieces} positive layer counts (stages x chunks = "
            f"{stages} x {chunks}); every piece needs at least one layer"
        )
    return tuple(counts)


def split_bounds(stages: int, chunks: int, split: SplitSpec, n_layers: int) -> tuple[tuple[int, int], ...]:
    """Layer ranges ``[a, b)`` of the ``stages * chunks`` pieces for an explicit or equal split.
    (``"auto"`` is resolved by the launcher's profiler into explicit counts first.)"""
    pieces = stages * chunks
    split = check_split(split, stages, chunks)
    if n_layers < pieces:
        raise ValueError(
            f"the model has {n_layers} layers but the pipeline needs {pieces} non-empty pieces "
            f"(stages={stages} x chunks={chunks}); use at most {n_layers} stages x chunks, "
            f"or cut the model into more layers"
        )
    if isinstance(split, str):
        if split == "auto":
            raise ValueError("Pipeline.split='auto' must be resolved by the profiler before stages are built")
        return tuple(equal_layer_split(n_layers, pieces))
    counts = list(split)
    if sum(counts) != n_layers:
        raise ValueError(
            f"Pipeline.split={counts} covers {sum(counts)} layers but the model has {n_layers}; "
            f"give {pieces} counts that sum to {n_layers}"
        )
    return bounds_from_counts(counts)


def resolve_bounds(pipeline: Any, n_layers: int) -> tuple[tuple[int, int], ...]:
    """Layer ranges ``[a, b)`` of ``pipeline``'s pieces for an explicit or equal split
    (:func:`split_bounds` of its ``stages``, ``chunks`` and ``split``)."""
    return split_bounds(pipeline.stages, pipeline.chunks, pipeline.split, n_layers)


def bounds_from_counts(counts: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Contiguous ``[a, b)`` ranges of the given sizes, from layer 0."""
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return tuple(out)


def layers_of(model: nn.Module) -> list[nn.Module]:
    """The layers a pipelined model is cut between: the children of its ``nn.Sequential``."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(
            f"a pipelined job's model must be an nn.Sequential (its children are the layers cut into "
            f"stages); got {type(model).__name__}. Wrap a model of another kind with "
            f"virtualflow.parallel.tracing.sequential_from(model, example_input, split_points=[...])"
        )
    return list(model.children())


def piece_module(layers: Sequence[nn.Module], lo: int, hi: int) -> nn.Sequential:
    """Layers ``[lo, hi)`` as an ``nn.Sequential`` whose children keep their whole-model names."""
    return nn.Sequential(OrderedDict((str(i), layers[i]) for i in range(lo, hi)))


def successor_pieces(pipeline: Any, layers: Sequence[nn.Module], bounds: Sequence[tuple[int, int]],
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


def check_workers(pipeline: Any, workers: int) -> int:
    """Pipeline replicas (D) for ``workers``; a clear error when it is not a multiple of the
    workers per replica (``stages * tensor``)."""
    tensor = getattr(pipeline, "tensor", 1)
    unit = pipeline.stages * tensor
    if workers % unit:
        lo = (workers // unit) * unit
        hint = f"{lo} or {lo + unit}" if lo else str(unit)
        what = (f"Pipeline.stages={pipeline.stages}" if tensor == 1 else
                f"Pipeline.stages x tensor = {pipeline.stages} x {tensor} = {unit}")
        shape = "stages x replicas" if tensor == 1 else "replicas x stages x tensor"
        raise ValueError(
            f"workers={workers} is not a multiple of {what}; a pipelined job runs "
            f"whole pipelines (workers = {shape}): use workers={hint}"
        )
    return workers // unit


def stage_workers(stage: int, stages: int, replicas: int = 1, tensor: int = 1, most: int = 4) -> str:
    """The workers (generation ranks) that run pipeline stage ``stage``: ``worker 1``, ``workers
    2-3`` (a stage of ``tensor`` = 2 workers), ``workers 1, 3`` (one per replica), at most
    ``most`` groups then ``...``. Ranks are laid out replica by replica, stage by stage, and a
    stage's ``tensor`` workers side by side: rank = (replica * stages + stage) * tensor + t."""
    groups = []
    for replica in range(replicas):
        first = (replica * stages + stage) * tensor
        groups.append(str(first) if tensor == 1 else f"{first}\u2013{first + tensor - 1}")
    shown = ", ".join(groups[:most]) + (", ..." if len(groups) > most else "")
    return f"worker {shown}" if replicas == 1 and tensor == 1 else f"workers {shown}"


def describe_split(layers: Sequence[nn.Module], bounds: Sequence[tuple[int, int]], stages: int, replicas: int = 1,
                   tensor: int = 1) -> str:
    """One line per piece: its stage's workers (:func:`stage_workers`), layers and parameters.
    Piece ``k`` runs on stage ``k % stages`` (several pieces a stage with interleaved chunks)."""
    lines = []
    for k, (a, b) in enumerate(bounds):
        names = ", ".join(type(layers[i]).__name__ for i in range(a, min(b, a + 3))) + (", ..." if b - a > 3 else "")
        params = sum(p.numel() for i in range(a, b) for p in layers[i].parameters())
        where = stage_workers(k % stages, stages, replicas, tensor)
        if stages != len(bounds) or replicas != 1 or tensor != 1:
            where = f"stage {k % stages}: {where}"
        lines.append(f"  piece {k} ({where}): layers {a}-{b - 1} [{names}], {params:,} parameters")
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


def _piece_of(bounds: Sequence[tuple[int, int]], layer: int) -> int:
    return next(k for k, (a, b) in enumerate(bounds) if a <= layer < b)


def _locations(layers: Sequence[nn.Module]) -> list[list[tuple[int, str]]]:
    """Per parameter object, its ``(layer index, name in that layer)`` locations, in model order."""
    where: dict[int, list[tuple[int, str]]] = {}
    for i, layer in enumerate(layers):
        for name, param in layer.named_parameters():
            where.setdefault(id(param), []).append((i, name))
    return list(where.values())


def tied_parameters(layers: Sequence[nn.Module], bounds: Sequence[tuple[int, int]],
                    stages: int) -> list[list[tuple[int, str]]]:
    """Parameters shared by layers on different workers (a tied embedding and output matrix,
    say): for each, its ``(layer index, name in that layer)`` locations, in model order."""
    return [locs for locs in _locations(layers)
            if len({_piece_of(bounds, i) % stages for i, _ in locs}) > 1]


def shared_across_pieces(layers: Sequence[nn.Module],
                         bounds: Sequence[tuple[int, int]]) -> list[list[tuple[int, str]]]:
    """Parameters read by layers of different pieces (on one worker or several): for each, its
    locations in model order. Deterministic mode sums their per-piece gradients per virtual node
    before the tree (see :func:`virtualflow.launching.composition.check_shared_parameters`)."""
    return [locs for locs in _locations(layers) if len({_piece_of(bounds, i) for i, _ in locs}) > 1]


EXACT_USES = 2
"""Locations of one shared weight deterministic mode keeps bit-identical: the unpipelined job adds
the per-VN gradients of its uses inside autograd, and one addition ``a + b == b + a`` is exact in
either order; with three or more the order of autograd's additions is not fixed."""


@dataclass(slots=True)
class TiedCopy:
    """One weight shared across workers, as one worker sees it (the same list, in the same order,
    on every worker: :func:`tied_for_worker`)."""

    param: Any
    """This worker's copy, or ``None`` if none of its pieces holds it."""
    numel: int
    dtype: torch.dtype
    workers: tuple[int, ...]
    """The stage-rank holding each location, in model order; ``workers[0]`` owns the weight in
    deterministic mode (it sums the copies' per-VN gradients and hands the total on)."""


def tied_for_worker(layers: Sequence[nn.Module], bounds: Sequence[tuple[int, int]], stages: int,
                    stage_rank: int) -> list[TiedCopy]:
    """For each weight shared across workers (same order everywhere): this worker's copy (or
    None), its size and dtype, and the workers holding its locations."""
    out = []
    for locs in tied_parameters(layers, bounds, stages):
        i0, n0 = locs[0]
        param0 = layers[i0].get_parameter(n0)
        workers = tuple(_piece_of(bounds, i) % stages for i, _ in locs)
        mine = None
        for (i, name), w in zip(locs, workers):
            if w == stage_rank:
                mine = layers[i].get_parameter(name)
                break
        out.append(TiedCopy(mine, param0.numel(), param0.dtype, workers))
    return out
