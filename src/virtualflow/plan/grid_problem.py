"""The grid planner's input and output rows (see :mod:`virtualflow.plan.grid` for the cost model
and the search): :class:`GridProblem` (validated on construction), :class:`GridCandidate` (one
layout with its split, predicted) and THE ranking (:func:`rank_key`). Pure data, no processes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from virtualflow.plan.pipeline.partition import LayerProfile, Link
from virtualflow.plan.pipeline.predict import DEFAULT_OPTIMIZER_STATE_FACTOR, LOOPBACK

GRID_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")
"""The flush schedules the grid planner searches (the no-flush ones keep extra weight versions and
are not planned here)."""
REDUCTIONS = ("allreduce", "sharded", "fsdp")
TIME_RESOLUTION_S = 1e-12
"""Predicted step times equal to this resolution are ties (broken by :func:`rank_key`)."""
NO_PIPELINE = "1f1b"
"""The schedule entry of ``P = 1`` candidates (no pipeline: the ``m`` micro-batches run one after
the other, one stashed at a time)."""


def _positive_int(owner: str, name: str, value: Any, rule: str, knob: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{owner}.{name}={value!r} must be a positive integer ({rule}); set {knob}")


@dataclass(frozen=True, slots=True, kw_only=True)
class GridProblem:
    """What the grid planner needs; validated on construction (errors name the value, the rule
    and the knob, with the ``virtualflow plan`` flag that sets it)."""

    layers: tuple[LayerProfile, ...]
    """Per layer, costs per VN micro-batch at ``T = 1`` (from the profiler)."""
    tensor_parallel: tuple[int, ...]
    """Per layer: how many Megatron column-then-row-parallel pairs it holds (an attention or an MLP
    sub-layer is one; a transformer layer with both is two), 0 for a replicated layer. A layer
    with pairs divides its compute, weights and stash by ``T``; each pair adds 4 collectives per
    micro-batch. ``True``/``False`` read as 1/0."""
    heads: int
    """Attention heads (or the column-parallel width unit): ``T`` must divide it."""
    workers: int
    """``W = D x P x T``."""
    virtual_nodes: int
    """The job's VNs per step; each replica runs ``ceil(V / D)`` of them."""
    memory_limit_bytes: float | None = None
    """Per worker; ``None``: no limit."""
    optimizer_state_factor: float = DEFAULT_OPTIMIZER_STATE_FACTOR
    """Resident bytes per parameter byte: weights, gradients and optimizer state (fp32 Adam: 4)."""
    link: Link = LOOPBACK
    """Between consecutive stages and between data-parallel replicas."""
    tp_link: Link | None = None
    """Inside a tensor-parallel group (``None``: ``link``)."""
    weight_grad_s: tuple[float, ...] | None = None
    """Per layer: the weight-gradient part of ``backward_s`` (zero-bubble); ``None``: half."""
    vn_batch: int | None = None
    """Samples per VN; when given, micro-batches per VN must divide it."""
    microbatches_per_vn: tuple[int, ...] = (1,)
    """``k`` values tried: a VN cut into ``k`` micro-batches. The pipeline engine runs one
    micro-batch per VN (``k = 1``, the default); larger values are what-ifs of the cost model."""
    schedules: tuple[str, ...] = GRID_SCHEDULES
    """Schedules tried for ``P > 1``."""
    chunks: tuple[int, ...] = (2,)
    """Model chunks per worker tried with ``interleaved_1f1b``."""
    max_splits: int = 64
    """Search every split when a layout has at most this many; else the partitioner's and the equal one."""
    reduction: str = "allreduce"
    """``allreduce`` (ring), ``sharded`` (reduce-scatter + all-gather, optimizer state divided by D)
    or ``fsdp`` (parameters, gradients and optimizer state divided by D, units gathered for their
    use: :func:`virtualflow.plan.memory.worker_bytes`; no pipeline, no tensor parallelism)."""
    unit_bytes: tuple[float, ...] | None = None
    """``fsdp``: the parameter bytes of each sharding unit, the root unit's apart (``None``: each
    layer is a unit)."""
    root_bytes: float = 0.0
    """``fsdp``: the root unit's parameter bytes (every parameter outside the units; gathered for
    the whole forward and backward)."""
    overhead_s: tuple[tuple[float, float], ...] | None = None
    """Per layer: the (forward, backward) seconds per micro-batch that neither a tensor-parallel
    group nor a smaller micro-batch divides, the fixed CPU cost of running the layer (Python,
    autograd, small kernels' launches), as the profiler measures it on the model with nothing
    else to do (:func:`virtualflow.runtime.profile.profile_model`); ``None``: 0."""
    cores: float | None = None
    """CPU cores the workers share (``None``: every worker has its own device: no contention). The
    ``D T`` workers that run a layer at the same moment (a stage's tensor-parallel group in lock step,
    the replicas on the same schedule) take ``max(1, D T / cores)`` times its :attr:`overhead_s`."""

    def __post_init__(self) -> None:
        owner = "GridProblem"
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "tensor_parallel", tuple(int(x) if isinstance(x, bool) else x
                                                          for x in self.tensor_parallel))
        for name in ("microbatches_per_vn", "schedules", "chunks"):  # each value once, in the order given
            object.__setattr__(self, name, tuple(dict.fromkeys(getattr(self, name))))
        if self.weight_grad_s is not None:
            object.__setattr__(self, "weight_grad_s", tuple(self.weight_grad_s))
        if self.overhead_s is not None:
            object.__setattr__(self, "overhead_s", tuple((float(f), float(b)) for f, b in self.overhead_s))
        if not self.layers:
            raise ValueError(f"{owner}.layers is empty; the model needs at least one layer (profile the job's model)")
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, LayerProfile):
                raise ValueError(f"{owner}.layers[{i}] is a {type(layer).__name__}, not a LayerProfile")
        if len(self.tensor_parallel) != len(self.layers):
            raise ValueError(f"{owner}.tensor_parallel has {len(self.tensor_parallel)} entries for "
                             f"{len(self.layers)} layers; give one per layer (--tensor-parallel-layers)")
        for i, pairs in enumerate(self.tensor_parallel):
            if not isinstance(pairs, int) or pairs < 0:
                raise ValueError(f"{owner}.tensor_parallel[{i}]={pairs!r} must be an integer >= 0 (column/row-parallel "
                                 f"pairs in layer {i}; 0: replicated); fix --tensor-parallel-layers")
        _positive_int(owner, "workers", self.workers, "W = D x P x T workers", "--workers")
        _positive_int(owner, "heads", self.heads, "attention heads; T must divide them", "--heads")
        _positive_int(owner, "virtual_nodes", self.virtual_nodes, "the job's virtual nodes per step",
                      "Job.virtual_nodes")
        lim = self.memory_limit_bytes
        if lim is not None and (isinstance(lim, bool) or not isinstance(lim, (int, float)) or not lim > 0
                                or math.isinf(lim)):
            raise ValueError(f"{owner}.memory_limit_bytes={lim!r} must be a finite number > 0 (bytes per worker); "
                             f"set --memory-limit-gib to a positive value or leave it out for no limit")
        fac = self.optimizer_state_factor
        if isinstance(fac, bool) or not isinstance(fac, (int, float)) or not (1 <= fac < math.inf):
            raise ValueError(f"{owner}.optimizer_state_factor={fac!r} must be a finite number >= 1 (resident bytes "
                             f"per parameter byte: 4 for fp32 Adam); set optimizer_state_factor")
        for name in ("link", "tp_link"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Link):
                raise ValueError(f"{owner}.{name}={value!r} must be a Link(bandwidth_bytes_per_s=..., latency_s=...)")
        if self.weight_grad_s is not None:
            if len(self.weight_grad_s) != len(self.layers):
                raise ValueError(f"{owner}.weight_grad_s has {len(self.weight_grad_s)} entries for "
                                 f"{len(self.layers)} layers; give one per layer or None")
            for i, (w, layer) in enumerate(zip(self.weight_grad_s, self.layers)):
                if not (0 <= w <= layer.backward_s):
                    raise ValueError(f"{owner}.weight_grad_s[{i}]={w!r} must be within 0..backward_s="
                                     f"{layer.backward_s} (the weight part of the backward); re-profile")
        if self.overhead_s is not None:
            if len(self.overhead_s) != len(self.layers):
                raise ValueError(f"{owner}.overhead_s has {len(self.overhead_s)} entries for {len(self.layers)} "
                                 f"layers; give one (forward, backward) pair per layer or None")
            for i, pair in enumerate(self.overhead_s):
                if not all(math.isfinite(x) and x >= 0 for x in pair):
                    raise ValueError(f"{owner}.overhead_s[{i}]={pair!r} must be finite seconds >= 0; re-profile")
        cores = self.cores
        if cores is not None and (isinstance(cores, bool) or not isinstance(cores, (int, float)) or not cores > 0
                                  or math.isinf(cores)):
            raise ValueError(f"{owner}.cores={cores!r} must be a finite number > 0 (CPU cores the workers share) "
                             f"or None (a device each)")
        if self.vn_batch is not None:
            _positive_int(owner, "vn_batch", self.vn_batch, "samples per virtual node", "Job.global_batch_size")
        if not self.microbatches_per_vn:
            raise ValueError(f"{owner}.microbatches_per_vn is empty; give at least one (--microbatches-per-vn 1)")
        for k in self.microbatches_per_vn:
            _positive_int(owner, "microbatches_per_vn", k, "micro-batches a VN is cut into", "--microbatches-per-vn")
        if not self.schedules:
            raise ValueError(f"{owner}.schedules is empty; give some of {GRID_SCHEDULES} (--schedule)")
        for s in self.schedules:
            if s not in GRID_SCHEDULES:
                raise ValueError(f"{owner}.schedules has {s!r}, which the grid planner does not search: it plans "
                                 f"the flush schedules {GRID_SCHEDULES}; set --schedule to one of them")
        for v in self.chunks:
            if not isinstance(v, int) or isinstance(v, bool) or v < 2:
                raise ValueError(f"{owner}.chunks has {v!r}; interleaved chunks per worker must be integers >= 2 "
                                 f"(--chunks)")
        _positive_int(owner, "max_splits", self.max_splits, "splits searched exhaustively per layout",
                      "max_splits")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"{owner}.reduction={self.reduction!r} must be one of {REDUCTIONS}; set reduction")
        if self.unit_bytes is not None:
            object.__setattr__(self, "unit_bytes", tuple(self.unit_bytes))
        if (self.unit_bytes is not None or self.root_bytes) and self.reduction != "fsdp":
            raise ValueError(f"{owner}.unit_bytes/root_bytes describe reduction='fsdp''s units; reduction="
                             f"{self.reduction!r} has none: drop them or set reduction='fsdp' (--reduction fsdp)")
        if not all(math.isfinite(b) and b >= 0 for b in (*(self.unit_bytes or ()), self.root_bytes)):
            raise ValueError(f"{owner}.unit_bytes={self.unit_bytes!r}, root_bytes={self.root_bytes!r} must be finite "
                             f"byte counts >= 0 (the units' parameter bytes)")

    @property
    def tensor_link(self) -> Link:
        return self.tp_link if self.tp_link is not None else self.link


@dataclass(frozen=True, slots=True)
class GridCandidate:
    """One layout with its best split and its predicted costs (seconds, bytes)."""

    data: int
    stages: int
    tensor: int
    schedule: str
    chunks: int
    microbatches_per_vn: int
    micro_batches: int
    """``m``: micro-batches per replica per step."""
    counts: tuple[int, ...]
    """Layers per piece (``P x chunks`` pieces; piece ``s`` on stage rank ``s % P``)."""
    split: str
    """How the split was found: ``searched`` (every split), ``auto`` (partitioner), ``equal``."""
    step_time_s: float
    pipeline_s: float
    """The simulated schedule's makespan (without the data-parallel all-reduce)."""
    allreduce_s: float
    """The slowest stage rank's gradient all-reduce across the D replicas."""
    bubble: float
    memory_bytes: float
    """Peak per worker (the most over stage ranks)."""
    fits: bool
    tp_bytes: float
    hop_bytes: float
    data_bytes: float
    """Bytes each worker sends per step (the most over stage ranks) per kind of communication."""

    @property
    def layout(self) -> str:
        return f"D={self.data} P={self.stages} T={self.tensor}"

    @property
    def comm_bytes(self) -> float:
        return self.tp_bytes + self.hop_bytes + self.data_bytes

    def describe(self) -> str:
        sched = "no pipeline" if self.stages == 1 else self.schedule + (
            f" ({self.chunks} chunks)" if self.chunks > 1 else "")
        per_vn = f"{self.microbatches_per_vn} micro-batch{'es' if self.microbatches_per_vn > 1 else ''} per VN"
        return f"{self.layout} ({sched}, {per_vn}, m={self.micro_batches}, split {','.join(map(str, self.counts))})"

    def as_json(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__slots__}
        out["counts"] = list(self.counts)
        return out


def schedule_preference(stages: int, schedule: str) -> int:
    """Tie-break order of schedules: Megatron's interleaved 1F1B first for ``P > 2``."""
    order = (("interleaved_1f1b", "1f1b", "zb_h1", "gpipe") if stages > 2
             else ("1f1b", "interleaved_1f1b", "zb_h1", "gpipe"))
    return order.index(schedule)


def rank_key(c: GridCandidate) -> tuple:
    """THE ranking (see the module docstring): fits first, then time, then the tie rules."""
    return (not c.fits, round(c.step_time_s / TIME_RESOLUTION_S), c.comm_bytes, c.microbatches_per_vn,
            c.memory_bytes, -c.data, c.tensor, c.stages, schedule_preference(c.stages, c.schedule), c.chunks, c.counts)


__all__ = ["GRID_SCHEDULES", "GridCandidate", "GridProblem", "NO_PIPELINE", "REDUCTIONS", "TIME_RESOLUTION_S",
           "rank_key", "schedule_preference"]
