"""Predictions for a pipelined job from a layer profile: the pure half of the profiler.

:mod:`virtualflow.runtime.profile` measures each layer of a model (it runs the model); this
module turns such a measurement (a :class:`ModelProfile`, or plain
:class:`~virtualflow.plan.pipeline.partition.LayerProfile` entries) into decisions and
predictions, without running anything:

- :func:`auto_split` (``Pipeline.split="auto"``): the partitioner under
  ``Pipeline.memory_limit_gib`` and the schedule's stash bound;
- :func:`predict`: a split's per-piece time, the simulated step time and bubble, and memory per
  worker; :func:`split_partition`: a given split's per-piece costs;
- :func:`micro_batches`, :func:`stage_in_flight`, :func:`min_peak_split`: the pieces they share.

Invariants: a pure function of its arguments (the same profile gives the same split and
prediction); schedules come from THE factory (:func:`~virtualflow.plan.pipeline.schedules.schedule_of`).
A job and a pipeline are read by their fields (``Job.virtual_nodes``, ``Job.global_batch_size``,
``Job.pipeline``; ``Pipeline.stages``, ``chunks``, ``schedule``, ``split``, ``window``,
``memory_limit_gib``), so this layer imports neither.

What the predictions leave out: the all-reduce of gradients between the ``d`` pipeline replicas,
the optimizer step, and data loading; the link is one :class:`Link` for every boundary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence, Union

from virtualflow.plan.pipeline.geometry import check_workers, split_bounds
from virtualflow.plan.pipeline.partition import (
    InfeasiblePartition, LayerProfile, Link, Partition, evaluate_split, partition,
)
from virtualflow.plan.pipeline.schedules import Schedule, schedule_of
from virtualflow.plan.pipeline.simulate import simulate

LOOPBACK = Link(bandwidth_bytes_per_s=2.0e9, latency_s=1.0e-4)
"""Default link between pipeline workers on one machine: about 2 GB/s and 0.1 ms per message
(gloo over loopback TCP; ``bench/results/README.md`` measured 2.3 GB/s for large messages)."""

DEFAULT_OPTIMIZER_STATE_FACTOR = 4.0
"""Resident bytes per parameter byte when the optimizer's state cannot be measured (fp32 Adam:
weights, gradients and two moments)."""

SplitArg = Union[str, Sequence[int], Sequence[Sequence[int]]]


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """One profile of a job's model: per-layer costs plus what the predictions need besides."""

    layers: tuple[LayerProfile, ...]
    """One entry per layer, in order (``name`` is ``"<child name>:<type>"``)."""
    weight_grad_s: tuple[float, ...] | None
    """Per layer: the weight-gradient part of ``backward_s`` (``backward_s`` minus the time of the
    input gradient alone), measured only with ``profile_model(weight_grad=True)``; ``None``
    otherwise. The zero-bubble schedule needs it."""
    optimizer_state_factor: float
    """Resident bytes per parameter byte: 2 (weights and gradients) plus the optimizer's state,
    measured after one optimizer step (``DEFAULT_OPTIMIZER_STATE_FACTOR`` when that fails)."""
    micro_batch_size: int
    """Samples in the profiled batch: ``B / V``."""
    device: str
    repeats: int
    elapsed_s: float
    """Wall time of the whole profile (model build, data, warm-up, passes, optimizer step)."""


# ---- schedules, grid ------------------------------------------------------------------------------


def pipeline_for(job: Any, pipeline: Any | None) -> Any:
    """``pipeline``, or the job's own ``Job.pipeline``; an error when there is none."""
    pipeline = pipeline if pipeline is not None else job.pipeline
    if pipeline is None:
        raise ValueError("the job has no pipeline: give Job(pipeline=Pipeline(stages=...)) or pass pipeline=...")
    if not all(hasattr(pipeline, knob) for knob in ("stages", "schedule", "chunks", "split", "window")):
        raise TypeError(f"pipeline must be a virtualflow.config.pipeline.Pipeline, got {type(pipeline).__name__}")
    return pipeline


def micro_batches(job: Any, pipeline: Any, workers: int | None = None) -> tuple[int, int]:
    """``(replicas d, m)``: pipeline replicas for ``workers`` (default ``stages``: one replica) and
    the most VNs any replica runs per step (its micro-batches; the slowest replica sets the pace)."""
    workers = pipeline.stages if workers is None else workers
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"workers={workers!r} must be a positive integer (stages x pipeline replicas)")
    d = check_workers(pipeline, workers)
    v = job.virtual_nodes
    if v < d:
        raise ValueError(
            f"virtual_nodes={v} is fewer than the {d} pipeline replicas of workers={workers} / "
            f"stages={pipeline.stages}; every replica needs at least one virtual node (micro-batch): use at most "
            f"workers={v * pipeline.stages} or raise virtual_nodes"
        )
    return d, -(-v // d)


def stage_in_flight(schedule: Schedule) -> tuple[int, ...]:
    """Per schedule stage (model piece): the most micro-batches whose activations it holds at
    once (forward done, last backward part not yet done)."""
    split = schedule.split_backward()
    last = "W" if split else "B"
    held = [0] * schedule.stages
    peak = [0] * schedule.stages
    for acts in schedule.actions:
        for a in acts:
            if a.kind == "F":
                held[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], held[a.stage])
            elif a.kind == last:
                held[a.stage] -= 1
    return tuple(peak)


def _factor(profile_factor: float, schedule: Schedule) -> float:
    """Resident bytes per parameter byte under ``schedule``: no-flush schedules keep extra weight
    versions (2BW: 2; asynchronous PipeDream: up to ``p - s``); the most any stage keeps is used."""
    return profile_factor + (max(schedule.weight_versions) - 1)


def as_profile(profiles: ModelProfile | Sequence[LayerProfile]) -> ModelProfile:
    if isinstance(profiles, ModelProfile):
        return profiles
    layers = tuple(profiles)
    for k, layer in enumerate(layers):
        if not isinstance(layer, LayerProfile):
            raise TypeError(f"profiles[{k}] is a {type(layer).__name__}, not a LayerProfile")
    return ModelProfile(layers=layers, weight_grad_s=None, optimizer_state_factor=DEFAULT_OPTIMIZER_STATE_FACTOR,
                        micro_batch_size=0, device="", repeats=0, elapsed_s=0.0)


def _limit_bytes(pipeline: Any) -> float | None:
    return None if pipeline.memory_limit_gib is None else pipeline.memory_limit_gib * 2**30


# ---- auto split -----------------------------------------------------------------------------------


def auto_split(
    job: Any,
    pipeline: Any | None = None,
    *,
    workers: int | None = None,
    link: Link = LOOPBACK,
    profiles: ModelProfile | Sequence[LayerProfile],
) -> tuple[tuple[int, ...], Partition]:
    """``Pipeline.split="auto"``: the layer counts per model piece that minimise the slowest
    piece's time, with each worker's memory within ``pipeline.memory_limit_gib``.

    ``pipeline`` defaults to ``job.pipeline``; ``workers`` (default ``stages``) fixes the replicas
    and so ``m``, the micro-batches per replica, which with the schedule gives each piece's
    stashed micro-batches (``in_flight``). ``profiles`` is a measured profile
    (:func:`virtualflow.runtime.profile.profile_model`, whose ``auto_split`` measures one when none
    is given). With ``chunks = v > 1`` each of a worker's ``v`` pieces must fit in ``1/v`` of the
    limit (a sufficient condition for the worker's sum).

    Raises :class:`~virtualflow.plan.pipeline.partition.InfeasiblePartition` (a ``ValueError``)
    when no split fits the limit, naming the smallest limit that would and what else to change.
    """
    pipeline = pipeline_for(job, pipeline)
    profile = as_profile(profiles)
    layers = profile.layers
    pieces, v = pipeline.pieces, pipeline.chunks
    split_bounds(pipeline.stages, v, "equal", len(layers))  # enough layers for the pieces
    _, m = micro_batches(job, pipeline, workers)
    schedule = schedule_of(pipeline, m)
    in_flight = stage_in_flight(schedule)
    factor = _factor(profile.optimizer_state_factor, schedule)
    limit = _limit_bytes(pipeline)
    piece_limit = None if limit is None else limit / v
    try:
        best = partition(layers, pieces, link=link, memory_limit_bytes=piece_limit, in_flight=in_flight,
                         optimizer_state_factor=factor)
    except InfeasiblePartition:
        raise _infeasible(pipeline, layers, in_flight, factor, m) from None
    return best.stage_sizes, best


def _infeasible(pipeline: Any, layers: Sequence[LayerProfile], in_flight: Sequence[int], factor: float,
                m: int) -> InfeasiblePartition:
    """The error for a limit no split meets: the smallest per-worker peak any split reaches."""
    peak, bounds = min_peak_split(layers, in_flight, factor)
    v = pipeline.chunks
    s = max(range(len(bounds)), key=lambda k: _piece_memory(layers, bounds[k], in_flight[k], factor))
    a, b = bounds[s]
    weights = factor * sum(layers[i].param_bytes for i in range(a, b))
    stashed = in_flight[s] * sum(layers[i].stash_bytes for i in range(a, b))
    need_gib = peak * v / 2**30
    share = f" ({1 / v:.3g} of it per model chunk, chunks={v})" if v > 1 else ""
    return InfeasiblePartition(
        f"Pipeline.memory_limit_gib={pipeline.memory_limit_gib} per worker{share} is below what any split of "
        f"{len(layers)} layers into {pipeline.pieces} pieces needs under schedule={pipeline.schedule!r} with m={m} "
        f"micro-batches per replica: the smallest peak is {peak / 2**20:.2f} MiB, on piece {s} (layers {a}-{b - 1}: "
        f"weights, gradients and optimizer state {weights / 2**20:.2f} MiB + {in_flight[s]} stashed micro-batches "
        f"{stashed / 2**20:.2f} MiB). Raise memory_limit_gib to at least {_ceil3(need_gib):g}, use "
        f"more stages (Pipeline.stages), or stash less: more virtual_nodes (smaller micro-batches), or a schedule "
        f"with fewer micro-batches in flight (1f1b rather than gpipe)"
    )


def _ceil3(x: float) -> float:
    """``x`` rounded up to 3 significant digits (a limit that is surely enough)."""
    if x <= 0:
        return 0.0
    scale = 10 ** (math.floor(math.log10(x)) - 2)
    return math.ceil(x / scale * (1 - 1e-12)) * scale


def _piece_memory(layers: Sequence[LayerProfile], bound: tuple[int, int], in_flight: int, factor: float) -> float:
    a, b = bound
    return sum(factor * layers[i].param_bytes + in_flight * layers[i].stash_bytes for i in range(a, b))


def min_peak_split(layers: Sequence[LayerProfile], in_flight: Sequence[int],
                   factor: float) -> tuple[float, tuple[tuple[int, int], ...]]:
    """The split into ``len(in_flight)`` contiguous non-empty pieces with the smallest peak piece
    memory (``factor * params + in_flight * stash``), and that peak. ``O(L^2 p)``."""
    n, p = len(layers), len(in_flight)
    best = [[math.inf] * (n + 1) for _ in range(p + 1)]  # best[k][i]: layers [i, n) as the last k pieces
    choice = [[0] * (n + 1) for _ in range(p + 1)]
    best[0][n] = 0.0
    for k in range(1, p + 1):
        s = p - k
        for i in range(s, n - k + 1):
            mem = 0.0
            for j in range(i + 1, n - k + 2):
                mem += factor * layers[j - 1].param_bytes + in_flight[s] * layers[j - 1].stash_bytes
                v = max(mem, best[k - 1][j])
                if v < best[k][i]:
                    best[k][i], choice[k][i] = v, j
    bounds, i = [], 0
    for k in range(p, 0, -1):
        j = choice[k][i]
        bounds.append((i, j))
        i = j
    return best[p][0], tuple(bounds)


# ---- predictions ----------------------------------------------------------------------------------


def bounds_of(pipeline: Any, split: SplitArg | None, n_layers: int) -> tuple[tuple[int, int], ...]:
    """Layer ranges of ``split`` (``"equal"``/``None``, layer counts, or ``(start, stop)`` ranges)."""
    if split is None or isinstance(split, str):
        if split == "auto":
            raise ValueError("predict: split='auto' must be resolved first (auto_split gives the counts)")
        return split_bounds(pipeline.stages, pipeline.chunks, split or "equal", n_layers)
    items = list(split)
    if items and all(isinstance(c, int) and not isinstance(c, bool) for c in items):
        return split_bounds(pipeline.stages, pipeline.chunks, tuple(items), n_layers)
    bounds = tuple((int(a), int(b)) for a, b in items)
    if len(bounds) != pipeline.pieces:
        raise ValueError(
            f"predict: {len(bounds)} layer ranges for {pipeline.pieces} pieces (stages={pipeline.stages} x "
            f"chunks={pipeline.chunks}); give one (start, stop) per piece"
        )
    return bounds


def predict(
    job: Any,
    pipeline: Any | None,
    split: SplitArg | None,
    profiles: ModelProfile | Sequence[LayerProfile],
    *,
    workers: int | None = None,
    link: Link = LOOPBACK,
) -> dict[str, Any]:
    """Predicted costs of running ``job`` cut by ``split`` (layer counts per piece, ``(start,
    stop)`` ranges, or ``"equal"``) under ``pipeline`` (default ``job.pipeline``) on ``workers``
    (default ``stages``).

    Per piece: compute (forward + backward), communication (its output boundary, forward and
    back, over ``link``) and their sum, as the partitioner counts them. The step is simulated:
    ``simulate(schedule(p, m), f_time, b_time, w_time)`` with ``f_time = forward + one transfer``
    and ``b_time = backward + one transfer`` per piece (so a piece's ``f + b`` is its time above),
    ``m`` the virtual nodes of the busiest pipeline replica; no-flush schedules are simulated over
    ``Pipeline.window`` steps and the step time is the average. Memory per worker is exact under
    the cost model: the weights of its pieces (times the optimizer-state factor, plus the extra
    weight versions of no-flush schedules) plus the peak of the stash the schedule holds on it.

    Returns a JSON-ready dict (see the keys below); ``fits`` compares the peak with
    ``Pipeline.memory_limit_gib``.
    """
    pipeline = pipeline_for(job, pipeline)
    profile = as_profile(profiles)
    layers = profile.layers
    bounds = bounds_of(pipeline, split, len(layers))
    d, m = micro_batches(job, pipeline, workers)
    schedule = schedule_of(pipeline, m)
    p, v, pieces = pipeline.stages, pipeline.chunks, pipeline.pieces
    in_flight = stage_in_flight(schedule)
    base_factor = profile.optimizer_state_factor
    factor = _factor(base_factor, schedule)
    limit = _limit_bytes(pipeline)
    part = evaluate_split(layers, bounds, link=link, in_flight=in_flight, optimizer_state_factor=factor,
                          memory_limit_bytes=limit)

    f_time, b_time, w_time = [], [], []
    for s, (a, b) in enumerate(bounds):
        hop = link.transfer_s(layers[b - 1].activation_bytes) if s < pieces - 1 else 0.0
        f_time.append(sum(layers[i].forward_s for i in range(a, b)) + hop)
        b_time.append(sum(layers[i].backward_s for i in range(a, b)) + hop)
        if profile.weight_grad_s is not None:
            w_time.append(sum(profile.weight_grad_s[i] for i in range(a, b)))
        else:
            w_time.append(0.5 * sum(layers[i].backward_s for i in range(a, b)))
    split_bw = schedule.split_backward()
    sim = simulate(schedule, f_time, b_time, w_time if split_bw else None)
    step = float(sim.step_time) / schedule.steps

    params = [sum(layers[i].param_bytes for i in range(a, b)) for a, b in bounds]
    stashes = [sum(layers[i].stash_bytes for i in range(a, b)) for a, b in bounds]
    memory = []
    for r in range(p):
        resident = sum((base_factor + schedule.weight_versions[s] - 1) * params[s] for s in range(r, pieces, p))
        now = peak = 0.0
        for act in schedule.actions[r]:  # stash held: forward done, last backward part not yet
            if act.kind == "F":
                now += stashes[act.stage]
                peak = max(peak, now)
            elif act.kind == ("W" if split_bw else "B"):
                now -= stashes[act.stage]
        memory.append(resident + peak)

    if pipeline.schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
        analytic = (p - 1) / (v * m + p - 1)
    else:
        analytic = None
    names = [layer.name for layer in layers]
    peak_memory = max(memory)
    return {
        "schedule": pipeline.schedule,
        "stages": p,
        "chunks": v,
        "workers": d * p,
        "replicas": d,
        "micro_batches": m,
        "micro_batch_size": job.global_batch_size // job.virtual_nodes,
        "counts": [b - a for a, b in bounds],
        "bounds": [[a, b] for a, b in bounds],
        "piece_layers": [names[a:b] for a, b in bounds],
        "piece_worker": [s % p for s in range(pieces)],
        "piece_compute_s": list(part.stage_compute_s),
        "piece_comm_s": list(part.stage_comm_s),
        "piece_time_s": list(part.stage_time_s),
        "piece_memory_bytes": list(part.stage_memory_bytes),
        "in_flight": list(in_flight),
        "worker_time_s": [sum(part.stage_time_s[s] for s in range(r, pieces, p)) for r in range(p)],
        "bottleneck_piece": part.bottleneck,
        "bottleneck_s": part.bottleneck_s,
        "step_time_s": step,
        "bubble": sum(sim.bubble) / p,
        "bubble_per_worker": list(sim.bubble),
        "analytic_bubble": analytic,
        "samples_per_s": job.global_batch_size / step if step > 0 else math.inf,
        "memory_bytes": memory,
        "peak_memory_bytes": peak_memory,
        "memory_limit_bytes": limit,
        "fits": limit is None or peak_memory <= limit,
        "optimizer_state_factor": factor,
        "weight_grad": None if not split_bw else ("measured" if profile.weight_grad_s is not None else "estimated"),
        "link": {"bandwidth_bytes_per_s": link.bandwidth_bytes_per_s, "latency_s": link.latency_s},
    }


def split_partition(job: Any, pipeline: Any | None, split: SplitArg | None,
                    profiles: ModelProfile | Sequence[LayerProfile], *, workers: int | None = None,
                    link: Link = LOOPBACK) -> Partition:
    """The :class:`Partition` (per-piece costs, for ``Partition.describe``) of a given split under
    the same in-flight counts and optimizer-state factor ``auto_split`` uses."""
    pipeline = pipeline_for(job, pipeline)
    profile = as_profile(profiles)
    bounds = bounds_of(pipeline, split, len(profile.layers))
    _, m = micro_batches(job, pipeline, workers)
    schedule = schedule_of(pipeline, m)
    return evaluate_split(profile.layers, bounds, link=link, in_flight=stage_in_flight(schedule),
                          optimizer_state_factor=_factor(profile.optimizer_state_factor, schedule),
                          memory_limit_bytes=_limit_bytes(pipeline))


__all__ = [
    "DEFAULT_OPTIMIZER_STATE_FACTOR", "LOOPBACK", "ModelProfile", "SplitArg", "as_profile", "auto_split",
    "bounds_of", "micro_batches", "min_peak_split", "pipeline_for", "predict", "split_partition", "stage_in_flight",
]
